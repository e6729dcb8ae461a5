"""The hint table: every hint name and what it means, in one place (RRFP §4, App. A).

:data:`HINTS` maps a name (``bf``, ``1f1b``, ``wfloat``...) to a :class:`HintEntry`: the
factory of the policy it runs in readiness mode, its default backward form, the order it needs
(a schedule built from the pipeline's shape), its strict form, whether ``auto`` may try it and
a one-line help. Everything that knows hint names reads it: the resolver
(:func:`rrfp.scheduler.hints.resolve_hint`), the arbiter (which policy a rank builds),
``rrfp train``'s early checks, ``auto``'s candidates (:func:`rrfp.sim.auto.all_candidates`), the
``--help`` of ``rrfp train --hint`` and ``rrfp simulate --hints`` and docs/scheduling.md's table
(:func:`markdown_table`; a test keeps the two equal). PyTorch's schedule names are aliases
(:data:`ALIASES`, :func:`canonical`).

Adding a hint is :func:`register` (``register("oldest", HintEntry(factory=..., help=...))``)
from any module: every front door then accepts the name. ``rrfp train`` and ``rrfp simulate``
import such a module with ``--plugin MODULE`` (in the launcher and in every rank, before the
hint is resolved; docs/scheduling.md).

Pure module: no torch, no asyncio, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from .policy import Hint, PolicyFactory, backfill_order, in_order, kind_policy, placement_schedule, strict_order
from .schedules import SCHEDULES, Order
from .tasks import B, F, PipelineSpec
from .wfloat import check_limits, order_ahead, w_float

FULL, SPLIT = "full", "split"
"""Backward forms: ``B`` (full), or ``I`` then ``W`` (split)."""

COMPILE, ORDER, ALWAYS = "compile", "order", "always"
"""Strict forms. ``COMPILE``: ``strict-<name>`` runs the policy's own nominal run as a fixed
order (:func:`rrfp.scheduler.hints.compile_policy`); ``ORDER``: ``strict-<name>`` runs the
entry's order exactly; ``ALWAYS``: the hint is strict by nature (``backfill``, built in only);
None: no strict form."""

OrderFn = Callable[[PipelineSpec], Order]
"""Builds per-rank orders for a pipeline's shape; raises ValueError (one line) when the shape
does not fit."""

_DEFAULT = "default"


@dataclass(frozen=True)
class HintEntry:
    """What one hint name means.

    Attributes:
        factory: builds the rank's policy in readiness mode (:data:`PolicyFactory`: keywords
            ``order``, ``ready``, ``state``, ``backfill``, ``memory``, ``w_bytes``); None:
            readiness over :attr:`order` (:class:`~rrfp.scheduler.policy.InOrder`).
        backward: the backward form unless the caller forces one: :data:`FULL` or
            :data:`SPLIT`.
        order: the order it needs, built from the pipeline's shape (a schedule); None: a
            policy that ranks whatever is ready.
        strict: its strict form (:data:`COMPILE`, :data:`ORDER`, None); default: ``COMPILE``
            for a policy, ``ORDER`` for an entry with an order.
        auto: ``auto`` may try it (:func:`rrfp.sim.auto.all_candidates`): an entry with an order
            in its strict form (the fixed order), a policy as itself.
        auto_rank: ``auto``'s preference on a tie, lower first (the built-ins use 10-50).
        help: one line for ``--help`` and docs/scheduling.md.
        split_only: it needs the split backward; forcing the full one is an error.
        check: refuses settings its policy cannot run under (readiness mode, an entry with an
            order): called as ``check(name, spec, order, inflight_limit, backpressure)`` when
            the hint resolves; raises ValueError (one line). None: any settings.

    Raises:
        ValueError: a field out of range, or neither a factory nor an order.
    """

    factory: PolicyFactory | None = None
    backward: str = FULL
    order: OrderFn | None = None
    strict: str | None = _DEFAULT
    auto: bool = False
    auto_rank: int = 100
    help: str = ""
    split_only: bool = False
    check: Callable[..., None] | None = None

    def __post_init__(self) -> None:
        if self.factory is None and self.order is None:
            raise ValueError("a hint entry needs a policy factory, an order, or both")
        if self.factory is not None and not callable(self.factory):
            raise ValueError(f"factory={self.factory!r}: expected a callable that builds a policy")
        if self.check is not None and not callable(self.check):
            raise ValueError(f"check={self.check!r}: expected a callable (name, spec, order, limit, backpressure)")
        if self.order is not None and not callable(self.order):
            raise ValueError(f"order={self.order!r}: expected a callable spec -> per-rank orders")
        if self.backward not in (FULL, SPLIT):
            raise ValueError(f"backward={self.backward!r}: expected {FULL!r} or {SPLIT!r}")
        if self.strict == _DEFAULT:
            object.__setattr__(self, "strict", COMPILE if self.order is None else ORDER)
        allowed = (COMPILE, None) if self.order is None else (ORDER, ALWAYS, None)
        if self.strict not in allowed:
            raise ValueError(f"strict={self.strict!r}: expected one of {', '.join(map(repr, allowed))} for an "
                             f"entry {'without' if self.order is None else 'with'} an order")
        if "\n" in self.help:
            raise ValueError("help: expected one line")

    def auto_text(self, name: str) -> str | None:
        """The hint text ``auto`` tries for this entry under ``name`` (None: it never does):
        an order in its strict form (the fixed order is what auto must beat), a policy as
        itself."""
        if not self.auto:
            return None
        return "strict-" + name if self.strict == ORDER else name

    @property
    def strict_forms(self) -> bool:
        """Whether ``strict-<name>`` exists (and differs from the name)."""
        return self.strict in (COMPILE, ORDER)


HINTS: dict[str, HintEntry] = {}
"""The hint table: name -> :class:`HintEntry`, in registration order (the built-ins below,
then any :func:`register` call)."""

ALIASES: dict[str, str] = {}
"""Other names of hints, lower-case: PyTorch's schedule names (``interleaved1f1b``,
``zbvzerobubble``...) -> the hint that ranks ready work the same way (:func:`canonical`)."""

GRAMMAR = ("backfill:<strict order>", "order:<per-rank orders>", "csv:<path> or <path>.csv")
"""Hint forms that take an argument (:func:`rrfp.scheduler.hints.resolve_hint`), beside the names."""


def register(name: str, entry: HintEntry | PolicyFactory) -> None:
    """Add hint ``name``: from then on every front door accepts it (``rrfp train --hint``,
    ``rrfp simulate --hints``, ``Pipeline(hint=)``, ``LocalPipeline(hint=)``; ``auto`` tries
    it when the entry says so). A bare policy factory stands for ``HintEntry(factory=...)``.

    Raises:
        ValueError: ``name`` is taken (by a hint or an alias), or is not a plain name
            (empty, ``strict-``, ``auto``, a form of :data:`GRAMMAR`, a ``.csv`` path,
            whitespace or a comma).
        TypeError: ``entry`` is neither a :class:`HintEntry` nor callable.
    """
    if not isinstance(entry, HintEntry):
        if not callable(entry):
            raise TypeError(f"hint {name!r}: expected a HintEntry or a policy factory, got {entry!r}")
        entry = HintEntry(factory=entry)
    if (not isinstance(name, str) or not name or name != name.strip() or any(c in name for c in " \t\n,|")
            or name.startswith("strict-") or name == "auto" or ":" in name or name.endswith(".csv")):
        raise ValueError(f"hint name {name!r}: expected a plain name (no spaces, commas, ':' or 'strict-' "
                         "prefix; not 'auto' or a .csv path)")
    if name in HINTS or name.lower() in ALIASES and ALIASES[name.lower()] != name:
        raise ValueError(f"hint {name!r} is already registered")
    if entry.strict == ALWAYS and name != "backfill":
        raise ValueError(f"hint {name!r}: strict={ALWAYS!r} is backfilling's alone (the runtime's notices run it)")
    HINTS[name] = entry


def alias(other: str, name: str) -> None:
    """Let ``other`` (any case; a leading ``Schedule`` is dropped) name hint ``name``.

    Raises:
        ValueError: ``name`` is not registered.
    """
    if name not in HINTS:
        raise ValueError(f"alias {other!r}: no hint {name!r}")
    ALIASES[_alias_key(other)] = name


def _alias_key(text: str) -> str:
    key = text.lower()
    return key[len("schedule"):] if key.startswith("schedule") else key


def canonical(text: str) -> str:
    """Hint text with an alias replaced by its hint (``"Interleaved1F1B"`` ->
    ``"interleaved-1f1b"``, ``"strict-ScheduleGPipe"`` -> ``"strict-gpipe"``); other text
    unchanged."""
    prefix = "strict-" if text.startswith("strict-") else ""
    base = text[len(prefix):]
    return prefix + ALIASES.get(_alias_key(base), base)


def lookup(name: str) -> HintEntry | None:
    """The entry of hint ``name`` (no ``strict-``, no alias), or None."""
    return HINTS.get(name)


def names(*, order: bool | None = None, strict: bool | None = None, auto: bool | None = None) -> tuple[str, ...]:
    """Registered hint names, in registration order, filtered: ``order`` (the entry needs an
    order, or not), ``strict`` (``strict-<name>`` exists, or not), ``auto`` (``auto`` may try
    it, or not); None: either."""
    return tuple(n for n, e in HINTS.items()
                 if (order is None or (e.order is not None) == order)
                 and (strict is None or e.strict_forms == strict)
                 and (auto is None or e.auto == auto))


def auto_candidates() -> list[str]:
    """The hint text ``auto`` tries for each entry that allows it, in tie order
    (:attr:`HintEntry.auto_rank`, then registration): an entry with an order in its strict
    form (``strict-split``: the fixed order is what auto must beat), a policy as itself."""
    items = [(e.auto_rank, i, e.auto_text(n)) for i, (n, e) in enumerate(HINTS.items()) if e.auto]
    return [text for _, _, text in sorted(items)]


def forms() -> str:
    """Every hint form in one line (``--help``, an unknown hint's error)."""
    with_strict = ", ".join(names(strict=True))
    without = [n for n, e in HINTS.items() if e.strict is None]
    always = [n for n, e in HINTS.items() if e.strict == ALWAYS]
    parts = [f"{with_strict} (each also as strict-<name>)"]
    if without:
        parts.append(f"{', '.join(without)} (no strict form)")
    parts += always
    return ", ".join(parts + list(GRAMMAR))


def policy_factory(hint: Hint, strict: bool, backfill: bool) -> PolicyFactory:
    """The factory of the policy a rank runs ``hint`` with: strict mode's fixed order (with
    backfilling when ``backfill``), else the hint's entry (:attr:`Hint.policy`, or its name
    for a policy), else readiness over the hint's order.

    Raises:
        ValueError: strict mode without a total order, backfilling outside strict mode, or a
            policy name without an entry that runs without an order.
    """
    if strict and hint.order is None:
        raise ValueError(f"strict mode needs a total-order hint, got the policy {hint.name!r}")
    if backfill:
        if not strict:
            raise ValueError("backfilling runs over a strict order: pass strict=True")
        return backfill_order
    if strict:
        return strict_order
    if hint.order is None:
        name = hint.policy or hint.name
        e = HINTS.get(name)
        if e is None or e.factory is None or e.order is not None:
            raise ValueError(f"hint {hint.name!r}: no policy {name!r} that runs without an order "
                             f"(policies: {', '.join(names(order=False))})")
        return e.factory
    e = HINTS.get(hint.policy) if hint.policy else None
    # A policy over an order (wfloat); a policy's name beside a compiled order is a label.
    return e.factory if e is not None and e.factory is not None and e.order is not None else in_order


def placement_order(spec: PipelineSpec) -> Order:
    """The placement's own fixed order (:func:`~rrfp.scheduler.policy.placement_schedule`:
    1F1B, interleaved 1F1B or ZB-V) for ``spec``.

    Raises:
        ValueError: the placement has none.
    """
    place = spec.placement
    sched = placement_schedule(place.n_virtual, place.kind)
    if sched is None:
        raise ValueError(f"the {place.kind} placement with {place.n_virtual} virtual stages has no fixed order "
                         "(1f1b: 1, interleaved-1f1b: loop, zb-v: v with 2)")
    return SCHEDULES[sched](spec)


def markdown_table() -> str:
    """docs/scheduling.md's hint table, from :data:`HINTS` (``tests/test_scheduler_registry.py``
    checks the document holds exactly this)."""
    rows = ["| hint | backward | needs an order | `strict-<name>` | `auto` tries | what it does |",
            "|---|---|---|---|---|---|"]
    strict_text = {COMPILE: "the compiled policy", ORDER: "the order, fixed", ALWAYS: "(always strict)", None: "none"}
    for n, e in HINTS.items():
        tried = e.auto_text(n)
        rows.append(f"| `{n}` | {e.backward} | {'yes' if e.order is not None else 'no'} | {strict_text[e.strict]} "
                    f"| {f'`{tried}`' if tried else 'no'} | {e.help} |")
    return "\n".join(rows)


def _builtins() -> Iterator[tuple[str, HintEntry]]:
    def kind(name, first, alternate, split, help, **kw):
        auto = kw.pop("auto", False)
        rank = kw.pop("auto_rank", 100)
        return name, HintEntry(kind_policy(name, first, alternate, **kw), SPLIT if split else FULL, auto=auto,
                               auto_rank=rank, help=help)

    yield kind("bf", B, True, False, "RRFP's BF: rounds of one ready backward then one ready forward",
               auto=True, auto_rank=30)
    yield kind("fb", F, True, False, "rounds of one ready forward then one ready backward")
    yield kind("bfw", B, False, True, "split backward: a ready I first, else a forward, W only when neither may run")
    yield kind("b-priority", B, False, False, "any ready backward first, else a forward")
    yield kind("f-priority", F, False, False, "any ready forward first, else a backward")
    # bfw-alt: bf's rounds with the split backward, W only when neither kind may run. Under a
    # memory budget the forward a round may run is capped by the budget, so a ready F goes
    # downstream as soon as memory allows instead of waiting behind every ready I (bfw).
    yield kind("bfw-alt", B, True, True, "bf's rounds with the split backward, W only when neither kind may run")
    yield kind("bf-df", B, True, False, "bf, forwards on later virtual stages first", depth_first=True)
    yield kind("bfw-df", B, False, True, "bfw, forwards on later virtual stages first", depth_first=True)
    yield kind("bfw-alt-df", B, True, True, "bfw-alt, forwards on later virtual stages first", depth_first=True)
    # bfw-mem: bfw-alt-df that frees bytes first (KindPolicy.free_first) with one stage per
    # rank. Measured on the suite at 1F1B's memory (docs/suite.md): median speedup 1.085x ->
    # 1.098x, min 1.005x both; with virtual stages the rule was mixed (J3 -2%, J1 +2%), so the
    # guard reports a refusal only with one stage per rank.
    yield kind("bfw-mem", B, True, True, "bfw-alt-df that runs the W freeing bytes first when the memory budget "
               "refuses an admission", depth_first=True, free_first=True, auto=True, auto_rank=40)
    schedule_help = {
        "gpipe": ("all forwards, then all backwards", FULL),
        "looped-bfs": ("each virtual stage's forwards for every microbatch in turn, then the backwards", FULL),
        "1f1b": ("one forward, one backward (Narayanan et al.)", FULL),
        "interleaved-1f1b": ("1F1B over virtual stages, loop placement (Megatron)", FULL),
        "zb-h1": ("zero bubble H1: 1F1B with W filling the bubbles (Qi et al.)", SPLIT),
        "zb-v": ("zero bubble V: two virtual stages, v placement", SPLIT),
        "dualpipev": ("DualPipeV (DeepSeek): two virtual stages, v placement, paired F and B", SPLIT),
    }
    for name, fn in SCHEDULES.items():
        text, backward = schedule_help[name]
        yield name, HintEntry(order=fn, backward=backward, help=f"named schedule: {text}")
    yield "split", HintEntry(order=placement_order, backward=SPLIT, auto=True, auto_rank=10,
                             help="the placement's fixed order (1f1b, interleaved-1f1b, zb-v) with each backward "
                             "split into I then W")
    yield "backfill", HintEntry(backfill_order, SPLIT, placement_order, ALWAYS, auto=True, auto_rank=20,
                                help="strict-split with conservative backfilling (backfill:ORDER over another strict "
                                "order)")
    # wfloat keeps the order's forwards: below the order's own in-flight limits it can deadlock.
    yield "wfloat", HintEntry(w_float, SPLIT, placement_order, None, auto=True, auto_rank=50, split_only=True,
                              check=check_limits, help="split's order with each W free to run later, while the next task waits")
    yield "ahead", HintEntry(order_ahead, SPLIT, placement_order, None, split_only=True,
                             help="wfloat that also runs later ready tasks of the order within its byte profile")


for _name, _entry in _builtins():
    register(_name, _entry)
for _other, _name in {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved1f1b": "interleaved-1f1b",
                      "loopedbfs": "looped-bfs", "interleavedzerobubble": "zb-h1", "zbvzerobubble": "zb-v",
                      "dualpipev": "dualpipev"}.items():
    alias(_other, _name)  # torch.distributed.pipelining's schedule names (get_schedule_class's, any case)
