"""Tasks, their kinds (:data:`KINDS`, the one table), placements and dependency rules of a
pipeline (RRFP §3, "Execution model").

A *task* is one unit of compute on one stage for one microbatch:

- ``F``: forward.
- ``B``: full backward (input and weight gradients together).
- ``I``: input-gradient backward only (the split backward's critical part; the paper's "B" in BFW).
- ``W``: weight-gradient backward (runs after ``I``; fills bubbles).

Text form follows ``torch.distributed.pipelining``'s action grammar: ``"2F0"`` is stage 2,
forward, microbatch 0; ``"1I3"``, ``"0W1"``, ``"3B2"``.

Pure module: no torch, no asyncio, no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, NamedTuple

F, B, I, W = "F", "B", "I", "W"

ACT, GRAD, LOCAL = "activation", "gradient", "local"
"""Input directions: a forward waits for the previous stage's activation, an input backward
for the next stage's gradient (the last stage: its own loss), ``W`` only for its own ``I``."""


class Kind(NamedTuple):
    """One task kind (a row of :data:`KINDS`).

    Attributes:
        name: ``F``, ``B``, ``I`` or ``W``.
        code: the ready-set flag array it lives in (:class:`~rrfp.scheduler.readyset.ReadySet`;
            0: F, 1: B or I, of which a step has one, 2: W).
        input: the input it waits for (:data:`ACT`, :data:`GRAD`, :data:`LOCAL`).
        needs_agreement: a TP-sharded stage issues collectives in it, so a TP group agrees on
            it first (RRFP §4.2); W computes local weight gradients only.
        finalises: after it the stage's weight gradients for the microbatch are complete
            (``B``, ``W``).
        frees_input: after it the forward's saved activations are all free (``B``; ``W``,
            which reads the split layers' inputs ``F`` saved): the microbatch's in-flight count
            drops (:data:`IN_FLIGHT_END`).
        split: the backward form it exists in: True (split backward only: ``I``, ``W``),
            False (full backward only: ``B``), None (both: ``F``).
    """

    name: str
    code: int
    input: str
    needs_agreement: bool
    finalises: bool
    frees_input: bool
    split: bool | None


KINDS: dict[str, Kind] = {
    F: Kind(F, 0, ACT, True, False, False, None),
    B: Kind(B, 1, GRAD, True, True, True, False),
    I: Kind(I, 1, GRAD, True, False, False, True),
    W: Kind(W, 2, LOCAL, False, True, True, True),
}
"""The one table of task kinds, by name: what each kind is called, the ready-set code it is
stored under, which input it waits for, whether a TP group must agree on it before running it
(it issues collectives), whether it finalises the stage's gradients for its microbatch and
which backward form it belongs to. The arbiter, the ready set, TP agreement and the runtime
read it instead of comparing kind letters or spelling codes."""

KIND_CODE: dict[str, int] = {k.name: k.code for k in KINDS.values()}
"""Kind name -> ready-set code (:attr:`Kind.code`)."""
F_CODE, B_CODE, W_CODE = KINDS[F].code, KINDS[B].code, KINDS[W].code
"""The ready-set codes by name: forwards, input backwards (``B`` or ``I``), ``W``."""
KIND_INDEX: dict[str, int] = {name: i for i, name in enumerate(KINDS)}
"""Kind name -> a stable small integer (F 0, B 1, I 2, W 3: wire encodings, TP agreement's
all-gather, and the kind code of :mod:`rrfp.sim.jitter`'s keys, so a new kind goes last)."""
BACKWARD_INPUT = tuple(k.name for k in KINDS.values() if k.input == GRAD)
"""Kinds that produce the gradient the previous stage waits for (``B``, ``I``)."""
IN_FLIGHT_END = tuple(k.name for k in KINDS.values() if k.frees_input)
"""Kinds that end a microbatch's flight on a stage (``B``, ``W``): the in-flight count (``D``)
runs from its ``F`` to its ``B``, or with the split backward to its ``W``, not its ``I``: ``W``
reads the split layers' inputs that ``F`` saved, so a microbatch whose ``W`` is pending still
holds activations (counted until ``I``, ``bfw`` at 1F1B's limits held 3-5x strict 1F1B's bytes
on the last rank). One rule for the arbiter's guards and :mod:`rrfp.scheduler.validate`'s
limits; the zero-bubble orders at 1F1B's memory (ZB-H1) count the same way."""


def kinds_of(split_backward: bool) -> tuple[str, ...]:
    """The kinds a step runs: ``F, B`` or, with the split backward, ``F, I, W`` (:data:`KINDS`)."""
    return tuple(k.name for k in KINDS.values() if k.split in (None, split_backward))


def needs_agreement(task: Task) -> bool:
    """Whether a TP group must agree on ``task`` before running it (:data:`KINDS`)."""
    return KINDS[task[1]].needs_agreement


def finalising_kind(split_backward: bool) -> str:
    """The kind after which a stage's weight gradients for a microbatch are complete, in a
    step with (``W``) or without (``B``) the split backward (:data:`KINDS`)."""
    return next(k.name for k in KINDS.values() if k.finalises and k.split in (None, split_backward))

_ACTION_RE = re.compile(r"^\s*(\d+)\s*([FBIW])\s*(\d+)\s*$")


class Task(NamedTuple):
    """One compute task: ``stage`` (global stage index, virtual stages included), ``kind``
    (one of ``F``, ``B``, ``I``, ``W``) and ``mb`` (microbatch index)."""

    stage: int
    kind: str
    mb: int

    def __str__(self) -> str:  # PyTorch action grammar, e.g. "2F0"
        return f"{self.stage}{self.kind}{self.mb}"


@dataclass(slots=True)
class TaskRecord:
    """One executed task: where (``rank``), in which ``step``, which ``task``, and when
    (``start``/``end`` in seconds). The simulator and the runtime both write it, so
    :mod:`rrfp.obs.trace` draws simulated and real runs alike."""

    rank: int
    step: int
    task: Task
    start: float
    end: float


def parse_action(text: str) -> Task:
    """Parse one action in PyTorch's grammar (``"2F0"``) into a :class:`Task`.

    Raises:
        ValueError: naming the text when it is not ``<stage><F|B|I|W><microbatch>``.
    """
    m = _ACTION_RE.match(text)
    if not m:
        raise ValueError(
            f"bad action {text!r}: expected <stage><F|B|I|W><microbatch>, e.g. '2F0'"
        )
    return Task(int(m.group(1)), m.group(2), int(m.group(3)))


def format_order(order: Iterable[Task]) -> str:
    """Text form of one rank's order: actions separated by spaces (``"0F0 0F1 0B0"``)."""
    return " ".join(str(t) for t in order)


def parse_order(text: str) -> list[Task]:
    """Inverse of :func:`format_order`; commas and whitespace both separate actions."""
    return [parse_action(a) for a in re.split(r"[\s,]+", text.strip()) if a]


PLACEMENTS = ("loop", "v")


@dataclass(frozen=True)
class Placement:
    """Which rank holds which stage.

    ``n_ranks`` pipeline ranks each hold ``n_virtual`` virtual stages, so the pipeline has
    ``n_stages = n_ranks * n_virtual`` stages.

    - ``loop`` (interleaved, Megatron/PyTorch ``Interleaved1F1B``): stage ``s`` on rank
      ``s % n_ranks``.
    - ``v`` (zig-zag, as ZB-V): stages run down the ranks then back up, so with two virtual
      stages rank ``r`` holds stages ``r`` and ``2 * n_ranks - 1 - r``.

    Raises:
        ValueError: for a non-positive count or an unknown placement.
    """

    n_ranks: int
    n_virtual: int = 1
    kind: str = "loop"

    def __post_init__(self) -> None:
        if self.n_ranks < 1:
            raise ValueError(f"n_ranks={self.n_ranks}: expected at least 1 pipeline rank")
        if self.n_virtual < 1:
            raise ValueError(f"n_virtual={self.n_virtual}: expected at least 1 virtual stage per rank")
        if self.kind not in PLACEMENTS:
            raise ValueError(f"placement {self.kind!r}: expected one of {', '.join(PLACEMENTS)}")

    @property
    def n_stages(self) -> int:
        return self.n_ranks * self.n_virtual

    def rank_of(self, stage: int) -> int:
        block, pos = divmod(stage, self.n_ranks)
        if self.kind == "v" and block % 2 == 1:
            return self.n_ranks - 1 - pos
        return pos

    # The stage graph is a chain; these two say so for the whole package (the runtime's
    # Router, the dependency rules below, the simulator). A non-chain graph changes them.
    def next_stage(self, stage: int) -> int | None:
        """The stage ``stage``'s activations feed (its forward's consumer), or None for the last."""
        return stage + 1 if stage + 1 < self.n_ranks * self.n_virtual else None

    def prev_stage(self, stage: int) -> int | None:
        """The stage ``stage``'s input gradients feed (its input backward's consumer), or None
        for the first."""
        return stage - 1 if stage > 0 else None

    def source(self, stage: int | None) -> str:
        """Where an input comes from, for messages: ``from stage 2 (rank 1)``, or ``from the
        step's inputs`` (``stage`` None: before the first stage)."""
        return "from the step's inputs" if stage is None else f"from stage {stage} (rank {self.rank_of(stage)})"

    def virtual_index(self, stage: int) -> int:
        """Position of ``stage`` among its rank's stages (0 = earliest in the pipeline)."""
        return stage // self.n_ranks

    def stages_of(self, rank: int) -> list[int]:
        """The global stages rank ``rank`` holds, ordered by virtual index."""
        return [s for s in range(self.n_stages) if self.rank_of(s) == rank]


@dataclass(frozen=True)
class PipelineSpec:
    """The shape of one step: a placement, the microbatch count, and whether the backward is
    split into ``I`` + ``W``.

    Raises:
        ValueError: for ``n_microbatches < 1``.
    """

    placement: Placement
    n_microbatches: int
    split_backward: bool = False

    def __post_init__(self) -> None:
        if self.n_microbatches < 1:
            raise ValueError(f"n_microbatches={self.n_microbatches}: expected at least 1")

    @property
    def n_stages(self) -> int:
        return self.placement.n_stages

    @property
    def backward_kind(self) -> str:
        return I if self.split_backward else B

    def tasks_of(self, rank: int) -> list[Task]:
        """Every task rank ``rank`` must run in one step (any order)."""
        kinds = kinds_of(self.split_backward)
        return [
            Task(s, k, m)
            for s in self.placement.stages_of(rank)
            for m in range(self.n_microbatches)
            for k in kinds
        ]

    def all_tasks(self) -> list[Task]:
        return [t for r in range(self.placement.n_ranks) for t in self.tasks_of(r)]

    def dependencies(self, task: Task) -> list[Task]:
        """The tasks that must finish before ``task`` may start (RRFP §3).

        ``F(s,m)`` needs the forward of the stage before (its activation); ``B/I(s,m)`` needs
        ``F(s,m)`` and, except on the last stage (which has its own loss), the input backward
        of the stage after (its gradient); ``W(s,m)`` needs ``I(s,m)``. "Before" and "after"
        are :meth:`Placement.prev_stage` and :meth:`Placement.next_stage`.
        """
        s, k, m = task
        if k == W:
            return [Task(s, I, m)]
        q = self.producer(task)
        if k == F:
            return [q] if q is not None else []
        return [Task(s, F, m)] if q is None else [Task(s, F, m), q]

    def producer(self, task: Task) -> Task | None:
        """The task on another stage whose output ``task`` waits for, or None (the first
        stage's forward, the last stage's input backward, ``W``)."""
        s, k, m = task
        if k == F:
            p = self.placement.prev_stage(s)
            return None if p is None else Task(p, F, m)
        if k in BACKWARD_INPUT:
            n = self.placement.next_stage(s)
            return None if n is None else Task(n, self.backward_kind, m)
        return None

    def consumer(self, task: Task) -> Task | None:
        """The task on another stage that waits for ``task``'s output message, or None."""
        s, k, m = task
        if k == F:
            n = self.placement.next_stage(s)
            return None if n is None else Task(n, F, m)
        if k in BACKWARD_INPUT:
            p = self.placement.prev_stage(s)
            return None if p is None else Task(p, self.backward_kind, m)
        return None
