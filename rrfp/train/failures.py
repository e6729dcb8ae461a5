"""How a rank of ``rrfp train`` ends: when something fails, the root cause named by global
rank, a peer's loss found when a collective only says it broke, and a quiet stop when rank 0's
stdout reader went away (``rrfp train | head``); when its run finished, an exit that skips the
interpreter's finalization (:func:`end_finished`)."""

from __future__ import annotations

import os
import sys


def interrupted():
    """A rank's end on Ctrl-C (KeyboardInterrupt): one line on stderr, exit 130 (128 + SIGINT),
    without the interpreter's finalization. Never returns."""
    from ..lines import say

    say(f"rrfp train: rank {os.environ.get('RANK', '?')}: interrupted", sys.stderr)
    os._exit(130)


class QuietAfterReaderLeft:
    """Drops the transport's lost-peer error records once rank 0's reader has gone: the peer
    stopped on purpose (`rrfp train | head`)."""

    def filter(self, record) -> bool:
        return record.levelno < 40 or not reader_gone()


class GlobalRankNames:
    """Rewords the transport's records (``"rank %d: ..."``, the rank numbered within its
    pipeline, as is any lost peer in them) to name global ranks with their coordinates, as
    every other report of a failure does."""

    LOGGERS = ("rrfp.transport", "rrfp.transport.zmq", "rrfp.transport.planes", "rrfp.transport.torch")

    def __init__(self, layout) -> None:
        self.layout = layout

    def name(self, pp_rank: int) -> str:
        from ..parallel.layout import ParallelLayout

        return ParallelLayout.name(self.layout.rank_at(pp_rank), self.layout.dp, self.layout.tp)

    def filter(self, record) -> bool:
        from ..transport.base import PeerLost

        args = record.args
        if isinstance(record.msg, str) and record.msg.startswith("rank %d: ") and isinstance(args, tuple) and args \
                and args[0] == self.layout.pp_rank:
            record.msg = "%s: " + record.msg.removeprefix("rank %d: ")
            record.args = (self.name(args[0]), *(f"{self.name(a.rank)} lost: {a.reason}" if isinstance(a, PeerLost)
                                                 else a for a in args[1:]))
        return True


PIPE_CLOSED = 141
"""Exit code of a rank whose stdout reader went away (128 + SIGPIPE, as a shell reports it)."""
_PIPE_KEY = "rrfp/train/stdout-closed"


def mark_reader_gone() -> None:
    """Tell the other ranks (through the launcher's store) that rank 0's reader went away."""
    try:
        from ..parallel.bootstrap import default_store

        default_store().set(_PIPE_KEY, "1")
    except Exception:  # noqa: BLE001 - no store: the launcher still sees exit code 141
        pass


def stop_quietly() -> None:
    """Stop as Unix tools do when their reader is gone: quietly, exit code :data:`PIPE_CLOSED`."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    mark_reader_gone()
    os._exit(PIPE_CLOSED)


def reader_gone() -> bool:
    """Whether rank 0's stdout reader went away (then a peer's loss is no error to report)."""
    try:
        from ..parallel.bootstrap import default_store

        return default_store().check([_PIPE_KEY])
    except Exception:  # noqa: BLE001
        return False


def lost_peer(pipe, exc: BaseException, rank: int):
    """The first peer the transport lost, when ``exc`` names none (a collective that failed
    because a peer died): the transport's loop runs only inside the pipeline's calls, so it
    is run until it notices. When ``exc`` says a peer's connection closed (gloo's "closed by
    peer"), a peer certainly went: the wait is bounded only by the transport's own worst case
    (its heartbeat timeout), not by a guess a loaded machine can outlast; otherwise 3 s."""
    from .guard import blamed_rank

    wait = getattr(pipe.transport, "wait_lost", None)
    if wait is None or blamed_rank(exc, rank) != rank:
        return None
    try:
        peer_gone = any(w in str(exc) for w in ("closed by peer", "reset by peer", "Broken pipe"))
        return pipe.run(wait(None if peer_gone else 3.0))
    except Exception:
        return None


def named_globally(exc: BaseException, layout):
    """The :class:`~rrfp.transport.base.PeerLost` in ``exc``'s chain, whose ``rank`` is a
    pp_rank of this rank's pipeline (the transport's numbering), as a new ``PeerLost`` of
    the global rank, its message naming the coordinates (``rank 2 (pp 1, dp 0, tp 0) lost:
    ...``); None when the chain holds none."""
    from ..parallel.layout import ParallelLayout
    from ..transport.base import PeerLost

    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and not isinstance(e, PeerLost) and id(e) not in seen:
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    if not isinstance(e, PeerLost):
        return None
    rank = layout.rank_at(e.rank)
    named = PeerLost(rank, e.reason)
    named.args = (f"{ParallelLayout.name(rank, layout.dp, layout.tp)} lost: {e.reason}",)
    return named


def flush_output() -> None:
    """Flush the logging handlers, stdout and stderr (before :func:`end_finished`).

    Raises:
        BrokenPipeError: stdout's reader went away.
    """
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()


def end_finished(code: int = 0):
    """End a rank whose run finished and whose process group is destroyed: ``os._exit``,
    after :func:`flush_output`, never the interpreter's finalization.

    Why: a daemon thread inside a torch C++ call that released the GIL (a gloo work's
    ``wait()``, a ``TCPStore`` wait, a pyzmq poll) and returns while the interpreter finalizes
    is ended by CPython with ``pthread_exit``; the unwind runs through pybind11's GIL guard, a
    ``noexcept`` destructor, and C++ aborts: ``terminate called without an active exception``,
    SIGABRT, after a run that printed ``done`` and committed its checkpoint (a flaky exit code
    134 under load, where finalization is slow). Nothing is left to do at that point (pipeline
    closed, checkpoint committed, process group destroyed, output flushed), so nothing is lost
    by skipping finalization; tests/test_clean_ends.py reproduces the abort.
    """
    try:
        flush_output()
    except BrokenPipeError:
        os._exit(PIPE_CLOSED)
    os._exit(code)
