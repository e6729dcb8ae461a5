"""A training run's integrity guards: the job secret, non-finite steps, root-cause reports.

- :func:`configure_auth`: the job secret from ``--job-secret-file`` or ``RRFP_JOB_SECRET``
  for this rank's transport (:mod:`rrfp.transport.auth`).
- :func:`check_finite`: every rank agrees, per step, whether a loss or gradient norm was
  non-finite and on which rank it first appeared.
- :func:`write_error_file` / :func:`root_cause`: each failing rank records whom it blames
  (the rank it lost, or the rank where a non-finite value appeared) in torchrun's error
  file; the launcher follows the blame to the rank that really failed first.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import tempfile
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any

__all__ = ["NonFiniteStep", "check_finite", "configure_auth", "pause_for_test", "root_cause", "write_error_file"]

PAUSE_ENV = "RRFP_TEST_PAUSE_AFTER_STEP"
"""Test hook, a step count ``K`` (never set outside tests): after its ``K``-th step every
rank sets ``rrfp/test/paused/<rank>`` in the job's store and waits (at most ``--watchdog``
seconds) until ``rrfp/test/resume`` is set. A test then acts on a running job at a known
point, and resumes it, through events rather than timers
(``tests/test_security_jobs.py``)."""


class NonFiniteStep(RuntimeError):
    """A step whose loss or gradient norm was NaN or infinite. ``rank`` is where it first appeared."""

    def __init__(self, step: int, rank: int, what: str) -> None:
        self.step, self.rank, self.what = step, rank, what
        super().__init__(f"step {step + 1}: non-finite {what} first on rank {rank}")


def configure_auth(args: Any) -> None:
    """Hand this rank's transport the job secret (file first, then the environment).

    The environment copy is removed once read, so no child process inherits it.

    Raises:
        ValueError: an unreadable or too short secret (one line naming the file).
    """
    from ..transport import auth

    path = getattr(args, "job_secret_file", None)
    ja = auth.JobAuth.from_file(path) if path else auth.JobAuth.from_env()
    os.environ.pop(auth.ENV_SECRET, None)
    auth.configure(ja, bool(getattr(args, "insecure", False)))


def check_finite(step: int, rank: int, loss: float | None, grad_norm: float) -> NonFiniteStep | None:
    """Agree across all ranks (one gloo all-reduce of two integers) whether this step is poisoned.

    A non-finite loss is reported first (it can only appear on the rank holding the last
    stage); otherwise the highest rank whose gradient norm is non-finite, since gradients
    flow from the last stage to the first, where a poisoned gradient spreads.

    Returns:
        The same :class:`NonFiniteStep` on every rank, or None for a clean step.
    """
    import torch
    import torch.distributed as dist

    bad_loss = loss is not None and not math.isfinite(loss)
    flags = torch.tensor([rank if bad_loss else -1, rank if not math.isfinite(grad_norm) else -1])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags[0] >= 0:
        return NonFiniteStep(step, int(flags[0]), "loss")
    if flags[1] >= 0:
        return NonFiniteStep(step, int(flags[1]), "gradient norm")
    return None


def pause_for_test(store, done: int, rank: int, timeout_s: float) -> None:
    """The :data:`PAUSE_ENV` hook: a no-op unless it names ``done``.

    Raises:
        RuntimeError (torch's store timeout): nobody resumed within ``timeout_s``.
    """
    if os.environ.get(PAUSE_ENV) != str(done):
        return
    from datetime import timedelta

    store.set(f"rrfp/test/paused/{rank}", "1")
    store.wait(["rrfp/test/resume"], timedelta(seconds=timeout_s))


def blamed_rank(exc: BaseException, rank: int) -> int:
    """The rank ``exc`` is attributed to: a lost peer (:class:`~rrfp.transport.base.PeerLost`
    anywhere in the cause chain, else 'rank N lost' in a message), the origin of a
    non-finite step, or ``rank`` itself."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, NonFiniteStep):
            return e.rank
        r = getattr(e, "rank", None)
        if type(e).__name__ == "PeerLost" and isinstance(r, int):
            return r
        e = e.__cause__ or e.__context__
    m = re.search(r"\brank (\d+)(?: \([^)]*\))? lost\b", str(exc))
    return int(m.group(1)) if m else rank


def write_error_file(exc: BaseException, rank: int, line: str) -> None:
    """Record ``line`` and whom this rank blames in ``$TORCHELASTIC_ERROR_FILE`` (atomically).

    torchrun reads the file into its ``ProcessFailure`` (``message``, ``timestamp``, and the
    whole JSON as ``error_file_data``), where :func:`root_cause` finds ``rrfp``."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": line, "timestamp": int(time.time()),
            "rrfp": {"rank": rank, "blame": blamed_rank(exc, rank), "time": time.time()}}
    try:
        atomic_write_text(Path(path), json.dumps(data))
    except OSError:
        pass  # the launcher still reports the exit code


def root_cause(failures: dict[int, Any], launcher_signalled: set[int] | None = None) -> int:
    """The rank that failed first, from torchrun's ``{rank: ProcessFailure}``.

    Each failed rank's blame (from its error file) is followed to a rank that blames
    itself or left no record (killed by a signal); the rank most chains end at wins.
    Ties: a rank killed by a signal the launcher did not send (any signal to a pid not in
    ``launcher_signalled``; without that set, any but SIGTERM/SIGINT), then ranks that
    failed by themselves, and ranks the launcher stopped last of all; then the earliest
    failure time (the rank's own record, to the microsecond: torch's ``timestamp`` of a
    rank without one is only the second the launcher noticed it), then the lowest rank.
    """
    import signal

    info = {r: (getattr(f, "error_file_data", None) or {}).get("rrfp") or {} for r, f in failures.items()}
    blame = {r: i["blame"] for r, i in info.items() if isinstance(i.get("blame"), int) and i["blame"] != r}
    for r, f in failures.items():  # no record read back: the rank's own one-line message
        m = re.search(r"first on rank (\d+)|\brank (\d+)(?: \([^)]*\))? lost\b", str(getattr(f, "message", "") or ""))
        if r not in blame and m and int(m.group(1) or m.group(2)) != r:
            blame[r] = int(m.group(1) or m.group(2))

    def follow(r: int) -> int:
        seen = {r}
        while r in blame and blame[r] not in seen:
            r = blame[r]
            seen.add(r)
        return r

    votes: dict[int, int] = {}
    for r in failures:
        root = follow(r)
        votes[root] = votes.get(root, 0) + 1

    def key(r: int) -> tuple:
        f = failures.get(r)
        code = getattr(f, "exitcode", 0) if f is not None else 0
        stopped = False  # by the launcher, after something else failed: never first
        if launcher_signalled is not None:
            killed = code < 0 and getattr(f, "pid", None) not in launcher_signalled
            stopped = code < 0 and not killed and not info.get(r)
        else:
            killed = code < 0 and -code not in (signal.SIGTERM, signal.SIGINT)
        t = info.get(r, {}).get("time", getattr(f, "timestamp", math.inf) if f is not None else math.inf)
        return (-votes[r] if blame else 0, 0 if killed else 2 if stopped else 1, t, r)

    return min(votes, key=key)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename,
    so no reader ever sees half a file.

    Raises:
        OSError: with the file's name in the message.
    """
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        raise OSError(f"cannot write {str(path)!r}: {e.strerror or e}") from None


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` (same suffix, so writers that pick a format from it
    still do), renamed onto ``path`` when the block succeeds and removed when it fails.

    Raises:
        OSError: with the final file's name in the message.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as e:
        raise OSError(f"cannot write {str(path)!r}: {e.strerror or e}") from None
    finally:
        if tmp.exists():
            tmp.unlink()


def check_writable_dir(path: str, flag: str) -> str | None:
    """None if files can be created in folder ``path`` (made if missing), else a one-line
    error naming the flag and the folder."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".rrfp-write-check."):
            pass
    except OSError as e:
        return f"{flag}={path!r}: cannot write into the folder: {e.strerror or e}"
    return None


class LauncherSignals(logging.Filter):
    """Collects the pids torchrun's agent sends its closing signal to (it logs each one,
    at WARNING, before it signals), so that a rank killed by someone else's SIGTERM is told
    apart from those the launcher stopped.

    A logger *filter*, not a handler: it must see the record even when a later filter of the
    same logger keeps it off the screen (``rrfp train`` hides these lines), and logger filters
    run before any handler. It never drops a record."""

    LOGGER = "torch.distributed.elastic.multiprocessing.api"

    def __init__(self) -> None:
        super().__init__()
        self.pids: set[int] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "Sending process %s closing signal %s" and record.args:
            try:
                self.pids.add(int(record.args[0]))
            except (TypeError, ValueError):
                pass
        return True
