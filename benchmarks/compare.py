"""rrfp against PyTorch's own pipeline schedules, in the same rank processes, alternating.

One set of rank processes (gloo default group; rrfp's pipelines use ZeroMQ through the same
store) builds every system side by side, each with its own copy of the same initial weights:

- rrfp rows: a hint, an in-flight limit, a memory budget (:mod:`benchmarks.systems`), on one
  stage per rank or on a zero-bubble schedule's 2 virtual stages and placement;
- ``torch.distributed.pipelining``'s ``ScheduleGPipe``, ``Schedule1F1B``,
  ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble`` (two virtual stages per rank,
  loop placement), ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` (V placement).

A *phase* is one condition (a jitter level, fixed or variable-length microbatches). Each round
of a phase gives every system the same batch, step id and injected delays; the order of the
systems rotates from round to round so that drift of the machine cancels out of the paired
ratios. Round 0 warms up (PyTorch infers shapes, nothing injected), round 1 measures activation
memory (meter on, delays on; a row whose budget is another row's measured peak runs after that
row and gets it from then on), later rounds are timed. The optimizer never steps: weights stay
at their initial values, so every system computes on identical weights in every round.

After every step, every system's gradients are gathered into one full-model vector and compared
with the first system of the round (and, in round 0, with a single-process reference model):
fp32 ``rtol=1e-5, atol=1e-6``, or the benchmark fails naming the system and parameter.
"""

from __future__ import annotations

import abc

import copy
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from rrfp.model.gpt import GPT, GPTConfig, build_stage, count_tokens, lm_loss
from rrfp.sim.jitter import LEVELS

from .batches import Batch, TokenMeanLoss, make_batch  # noqa: F401 - importable from here
from .harness import ActivationMeter, BenchError, ComputeTimer, Injector, JitterStage, calibrate, round_order
from .workloads import MultimodalWorkload, TextWorkload, budgets_for, virtual_stage_bytes

RTOL, ATOL = 1e-5, 1e-6

from .settings import LEGACY_SYSTEMS, QUICK, SETTINGS, setting_config  # noqa: F401 - importable from here
from .systems import (  # noqa: F401 - importable from here
    ALL_SYSTEMS, CORE_SYSTEMS, MEMORY_ROWS, RRFP_SYSTEMS, TORCH_SYSTEMS, candidate_systems, default_hint,
    target_groups, virtual_stage_ids,
)


# --------------------------------------------------------------------------- systems


class System(abc.ABC):
    name: str
    inner: list[torch.nn.Module]  # the GPT stage modules (parameters)

    @abc.abstractmethod
    def step(self, batch: Batch) -> None:
        """Run one step (forwards and backwards) of ``batch``."""

    @abc.abstractmethod
    def busy(self) -> float:
        """Seconds this rank computed in the last step."""

    def peak_inflight(self) -> int:
        return -1

    def zero_grad(self) -> None:
        for m in self.inner:
            m.zero_grad(set_to_none=True)

    def close(self) -> None:
        pass


class RrfpSystem(System):
    def __init__(self, name: str, spec: dict, wrappers, inner, stage_ids, n_stages, rank, n_ranks, n_mb, job,
                 budgets: dict[int, int] | None = None, hold=None, chosen_hint: str | None = None,
                 loss_fn=lm_loss, record: bool = False) -> None:
        from rrfp.runtime.doors.pipeline import Pipeline
        from rrfp.runtime.engine.stage import PipelineStage
        from rrfp.scheduler.schedules import one_f_one_b_limits

        from .systems import torch_order_hint

        self.name, self.inner = name, inner
        # Every rank's limits, not only its own: a strict policy compiles under all of them, and
        # auto ranks its candidates on them (the same on every rank).
        limit = one_f_one_b_limits(n_ranks) if spec["limit"] == "1f1b" else int(spec["limit"])
        self.first, self.last = 0 in stage_ids, n_stages - 1 in stage_ids
        stages = [PipelineStage(w, s, n_stages) for w, s in zip(wrappers, stage_ids)]
        hint = {} if spec["hint"] is None else {"hint": torch_order_hint(spec["hint"], n_ranks, n_mb)}
        if spec["hint"] is None:  # the default rows: auto (Pipeline's default), or the run's --hint
            hint = {"hint": chosen_hint or default_hint()}
        # Per step: what the schedule holds for that step's microbatches (set before each step).
        self.budgets = budgets
        # A budget measured from another system (budget_from) is set by set_budget after that
        # system's memory round; until then (the warm-up) the ledger runs with no real limit.
        self.budget_from = spec.get("budget_from")
        budget = max(budgets.values()) if budgets else 2**62 if self.budget_from else None
        self.pipe = Pipeline(
            stages, n_mb, loss_fn, inflight_limit=limit, loss_weight_fn=count_tokens,
            rank=rank, n_ranks=n_ranks, job=job, watchdog=120.0, placement=spec.get("placement", "loop"),
            memory_budget=budget, record=record, **hint,
        )
        # With record: per step id, this rank's task records and step edges (sim_pred.fit_model).
        self.recorded: dict[int, dict] | None = {} if record else None
        self.pipe.runtime.inbox.hold = hold
        if self.pipe.auto is not None and budgets:
            self.pipe.auto.budget = _gather_obj(max(budgets.values()))

    def set_budget(self, nbytes: int) -> None:
        """This rank's ``memory_budget`` from now on (the bytes ``budget_from`` measured here);
        ``auto`` ranks its candidates at every rank's (a collective: every rank calls it at the
        same point)."""
        self.pipe.runtime.memory_budget = max(1, int(nbytes))
        if self.pipe.auto is not None:
            # Every rank's budget: auto's ranking must be the same on every rank (one rank's
            # own figure for all would rank differently on each and split their choices).
            self.pipe.auto.budget = _gather_obj(self.pipe.runtime.memory_budget)

    def restart_auto(self) -> None:
        """Under ``auto``, a fresh choice for a new phase (its condition differs): a new
        controller that measures and tries again from the next step, with no re-checks (the
        timed rounds must all run the kept hint)."""
        from rrfp.runtime.features.auto import AutoHint

        old = self.pipe.auto
        if old is None:
            return
        new = AutoHint(self.pipe, old.share, say=old.say, recheck_every=0)
        new.current, new.budget = old.current, old.budget  # its first step switches from what runs now
        self.pipe.auto = new

    def auto_pending(self) -> bool:
        """Whether ``auto`` has not kept a hint yet (False under a named hint)."""
        return self.pipe.auto is not None and self.pipe.auto.chosen is None

    def kept(self) -> str | None:
        """The hint ``auto`` kept (None under a named hint, or before its trial ended)."""
        return self.pipe.auto.chosen if self.pipe.auto is not None else None

    def step(self, batch: Batch) -> None:
        if self.budgets:
            self.pipe.runtime.memory_budget = self.budgets[batch.step_id]
        t0 = time.perf_counter()
        self.pipe.step(
            microbatches=batch.rrfp_mbs if self.first else None,
            targets=batch.rrfp_targets if self.last else None,
        )
        if self.recorded is not None:
            self.recorded[batch.step_id] = {
                "rank": self.pipe.runtime.rank, "t0": t0, "t1": time.perf_counter(),
                "tasks": [(r.task.stage, str(r.task.kind), r.task.mb, r.start, r.end) for r in self.pipe.last_stats.records]}

    def busy(self) -> float:
        return self.pipe.last_stats.busy

    def peak_inflight(self) -> int:
        return self.pipe.last_stats.peak_inflight

    def close(self) -> None:
        self.pipe.close()


class TorchSystem(System):
    def __init__(self, name: str, spec: dict, wrappers, inner, stage_ids, n_stages, n_mb, loss) -> None:
        import torch.distributed.pipelining as pp

        self.name, self.inner = name, inner
        self.first, self.last = 0 in stage_ids, n_stages - 1 in stage_ids
        self.timer = ComputeTimer()
        stages = [pp.PipelineStage(w, s, n_stages, torch.device("cpu")) for w, s in zip(wrappers, stage_ids)]
        for st in stages:
            for meth in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                self.timer.wrap(st, meth)
        cls = getattr(pp, spec["cls"])
        self.sched = cls(stages[0] if len(stages) == 1 else stages, n_microbatches=n_mb, loss_fn=loss, scale_grads=False)
        self.timer.wrap(self.sched, "_compute_loss")

    def step(self, batch: Batch) -> None:
        self.timer.busy = 0.0
        args = (batch.torch_args or (batch.tokens, batch.mbid)) if self.first else ()
        kwargs = {"target": batch.targets} if self.last else {}
        self.sched.step(*args, return_outputs=False, **kwargs)

    def busy(self) -> float:
        return self.timer.busy


# --------------------------------------------------------------------------- gradients


class GradIndex:
    """Offsets of every full-model parameter in one flat vector (``GPT.named_parameters`` order)."""

    def __init__(self, model: GPT) -> None:
        self.offsets: dict[str, tuple[int, int]] = {}
        self.names: list[tuple[int, str]] = []
        off = 0
        for n, p in model.named_parameters():
            self.offsets[n] = (off, p.numel())
            self.names.append((off, n))
            off += p.numel()
        self.total = off

    def name_at(self, i: int) -> str:
        best = self.names[0][1]
        for off, n in self.names:
            if off > i:
                break
            best = n
        return best

    def vector(self, modules: Sequence[torch.nn.Module], what: str, use_grad: bool = True) -> torch.Tensor:
        v = torch.zeros(self.total)
        for mod in modules:
            for n, p in mod.named_parameters():
                full = mod.stage_param_names[n] if hasattr(mod, "stage_param_names") else n
                off, numel = self.offsets[full]
                if use_grad:
                    if p.grad is None:
                        raise BenchError(f"{what}: parameter {full} got no gradient")
                    v[off:off + numel] = p.grad.reshape(-1)
                else:
                    v[off:off + numel] = 1.0
        return v


def check_close(got: torch.Tensor, ref: torch.Tensor, what: str, index: GradIndex) -> float:
    """Largest ``|got - ref| / (atol + rtol |ref|)`` (<= 1 passes); raises :class:`BenchError`
    naming the worst parameter otherwise."""
    if not torch.isfinite(got).all():
        i = int((~torch.isfinite(got)).nonzero()[0])
        raise BenchError(f"{what}: non-finite gradient in {index.name_at(i)}")
    ratio = (got - ref).abs() / (ATOL + RTOL * ref.abs())
    worst = float(ratio.max())
    if worst > 1.0:
        i = int(ratio.argmax())
        n_bad = int((ratio > 1.0).sum())
        raise BenchError(
            f"{what}: gradients differ (rtol={RTOL}, atol={ATOL}): {n_bad} of {got.numel()} values, worst in "
            f"{index.name_at(i)}: {float(got[i]):.8g} vs {float(ref[i]):.8g}"
        )
    return worst


# --------------------------------------------------------------------------- one rank


def rank_main(cfg: dict) -> dict | None:
    """One rank of a comparison setting: build every system, run the phases, return (on rank 0)
    every round's per-rank measurements."""
    from .workloads import MessageDelays, rrfp_hold

    rank, P = dist.get_rank(), dist.get_world_size()
    M, seed = cfg["n_microbatches"], cfg["seed"]
    rrfp_systems = {**RRFP_SYSTEMS, **candidate_systems(cfg.get("candidates") or [])}
    known = [*rrfp_systems, *TORCH_SYSTEMS]
    names = [s for s in cfg["systems"] if s in known]
    if len(names) != len(cfg["systems"]):
        raise BenchError(f"unknown systems {sorted(set(cfg['systems']) - set(known))}")
    work = (MultimodalWorkload if cfg.get("workload") == "multimodal" else TextWorkload)(cfg, rank, P)
    specs = {n: rrfp_systems.get(n) or TORCH_SYSTEMS[n] for n in names}

    # Base weights: this rank's stage of the one-stage-per-rank split, and its two virtual stages
    # of the loop or V split. Every system deep-copies them: identical initial weights.
    base = work.stage(P, rank)
    base_v = {pl: [work.stage(2 * P, s) for s in ids] for pl, ids in
              {sp.get("placement", "loop"): virtual_stage_ids(sp.get("placement", "loop"), rank, P)
               for sp in specs.values() if sp.get("virtual", 1) > 1}.items()}
    ref_model = work.reference()
    index = GradIndex(ref_model)
    batch0 = work.batch(0, False)
    example, example_target = work.stage_inputs(batch0)[0], batch0.rrfp_targets[0]
    e: dict[str, float] = {}
    for r in range(P):  # one rank at a time: ranks share the machine's cores
        dist.barrier()
        if r == rank:
            e = calibrate(copy.deepcopy(base), example)
    sleep = cfg.get("sleep")  # tasks that sleep for their compute: the costs stand in for e
    injector = Injector(LEVELS["J0"], seed, rank, dict(sleep) if sleep else e, base=sleep)
    delays = MessageDelays(LEVELS[cfg["comm"]], injector) if cfg.get("comm") else None
    budgets = budgets_for(work, base, cfg) if any(rrfp_systems.get(n, {}).get("budget") for n in names) else {}
    vbytes = {pl: virtual_stage_bytes(work, mods, virtual_stage_ids(pl, rank, P), example, example_target)
              for pl, mods in base_v.items()}
    meter = ActivationMeter()
    loss = TokenMeanLoss()

    systems: list[System] = []
    for name in names:
        spec = specs[name]
        if spec.get("virtual", 1) == 1:
            inner, stage_ids, n_stages = [copy.deepcopy(base)], [rank], P
        else:
            pl = spec.get("placement", "loop")
            inner, stage_ids, n_stages = [copy.deepcopy(m) for m in base_v[pl]], virtual_stage_ids(pl, rank, P), 2 * P
        share = 1.0 / len(inner)
        if name in rrfp_systems:
            wrappers = [JitterStage(m, injector, share, meter, last=s == n_stages - 1, stage=s, delays=delays,
                                    local_stages=frozenset(stage_ids)) for m, s in zip(inner, stage_ids)]
            sysobj: System = RrfpSystem(name, spec, wrappers, inner, stage_ids, n_stages, rank, P, M,
                                        job=f"{cfg['run_id']}-{names.index(name)}",
                                        budgets=budgets.get(spec.get("budget")),
                                        hold=rrfp_hold(delays) if delays is not None else None,
                                        chosen_hint=cfg.get("hint"), loss_fn=meter.metered(lm_loss),
                                        record=bool(cfg.get("record_tasks")))
        else:
            wrappers = [JitterStage(m, injector, share, meter, last=s == n_stages - 1, stage=s, delays=delays,
                                    pack=work.pack if s == 0 else None, local_stages=frozenset(stage_ids))
                        for m, s in zip(inner, stage_ids)]
            sysobj = TorchSystem(name, spec, wrappers, inner, stage_ids, n_stages, M, meter.metered(loss))
        meter.exclude([p for m in sysobj.inner for p in m.parameters()])
        # Every full-model parameter must be held by exactly one rank.
        cover = index.vector(sysobj.inner, name, use_grad=False)
        dist.all_reduce(cover)
        if not torch.equal(cover, torch.ones_like(cover)):
            raise BenchError(f"{name}: the ranks' stages do not cover the model exactly once")
        # Systems on the same split into stages get the same keyed delays (message delays are
        # keyed by the sending stage, so a split into 2P stages has other messages than one into P).
        sysobj.split = (len(stage_ids), spec.get("placement", "loop") if len(stage_ids) > 1 else "")
        systems.append(sysobj)

    phases = []
    for pi, ph in enumerate(cfg["phases"]):
        phases.append(_run_phase(pi, ph, cfg, systems, work, injector, meter, loss, index, ref_model))
    for s in systems:
        s.close()
    calibration = _gather_obj(e)
    budgets_all = _gather_obj({n: max(v.values()) for n, v in budgets.items()})
    vbytes_all = _gather_obj(vbytes)
    dist.barrier()
    if rank != 0:
        return None
    return {"config": cfg, "calibration": calibration, "phases": phases, "budgets": budgets_all,
            "virtual_stage_bytes": vbytes_all, "default_hint": cfg.get("hint") or default_hint()}


def _gather_obj(obj: Any) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _run_phase(pi: int, ph: dict, cfg: dict, systems: list[System], work: TextWorkload, injector: Injector,
               meter: ActivationMeter, loss: TokenMeanLoss, index: GradIndex, ref_model: GPT) -> dict:
    rank, P = dist.get_rank(), dist.get_world_size()
    injector.level = LEVELS[ph["level"]]
    rounds = []
    n_rounds = 2 + ph["rounds"]
    for s in systems:
        if isinstance(s, RrfpSystem):
            s.restart_auto()
    worst = 0.0
    inj_totals: dict[str, list] = {s.name: [] for s in systems}
    for k in range(n_rounds):
        step_id = 1000 * pi + k
        batch = work.batch(step_id, ph["varlen"])
        if cfg.get("comm"):
            batch = batch.with_stamps()
        batch.step_id = step_id
        loss.total = batch.n_tokens
        by_name = {s.name: s for s in systems}
        order = [by_name[n] for n in round_order(list(by_name), k, target_groups(list(by_name)))]
        if k == 1:  # the memory round: a system whose budget another measures runs after it
            order = [x for x in order if not getattr(x, "budget_from", None)] + \
                    [x for x in order if getattr(x, "budget_from", None)]
        ref_vec, ref_name = None, None
        per_sys: dict[str, list[float]] = {}
        for s in order:
            injector.enabled = k >= 1
            injector.step = step_id
            injector.reset()
            meter.active = k == 1
            meter.reset_peak()
            held_before = meter.current  # anything a previous system left is not this one's
            s.zero_grad()
            dist.barrier()
            t0 = time.perf_counter()
            s.step(batch)
            elapsed = time.perf_counter() - t0
            meter.active = False
            vec = index.vector(s.inner, s.name)
            dist.all_reduce(vec)
            if ref_vec is None:
                ref_vec, ref_name = vec, s.name
                if k == 0:
                    ref_model.zero_grad(set_to_none=True)
                    work.ref_loss(ref_model, batch).backward()
                    want = index.vector([ref_model], "single-process reference")
                    worst = max(worst, check_close(vec, want, f"phase {ph['name']} round {k}: {s.name} vs a single-process reference", index))
            else:
                worst = max(worst, check_close(vec, ref_vec, f"phase {ph['name']} round {k}: {s.name} vs {ref_name}", index))
            if k == 1:
                for x in systems:
                    if getattr(x, "budget_from", None) == s.name:
                        x.set_budget(meter.peak - held_before)
            per_sys[s.name] = [elapsed, s.busy(), float(meter.peak - held_before if k == 1 else -1), float(s.peak_inflight()),
                               injector.total, float(injector.count)]
            if k >= 1:
                inj_totals[s.name].append(injector.total)
        # One all_gather per round: [system][field] of every rank.
        names = [s.name for s in systems]
        mine = torch.tensor([per_sys[n] for n in names], dtype=torch.float64)
        got = [torch.zeros_like(mine) for _ in range(P)]
        dist.all_gather(got, mine)
        if rank == 0:
            stacked = torch.stack(got)  # [rank, system, field]
            rec = {"round": k, "kind": "warmup" if k == 0 else "memory" if k == 1 else "timed",
                   "order": [s.name for s in order], "lengths": batch.lengths, "systems": {}}
            for j, n in enumerate(names):
                f = stacked[:, j, :]
                rec["systems"][n] = {
                    "step": float(f[:, 0].max()), "elapsed": f[:, 0].tolist(), "busy": f[:, 1].tolist(),
                    "peak_bytes": f[:, 2].tolist(), "peak_inflight": f[:, 3].tolist(),
                    "injected": f[:, 4].tolist(), "n_injected": f[:, 5].tolist(),
                }
            rounds.append(rec)
        if k == 1:  # auto's choice, on budgets the memory round set, before the timed rounds
            auto_steps(pi, ph, cfg, systems, work, injector)
    # The same injected delays for everyone: per rank and round, equal totals.
    for s in systems:
        first = next(x.name for x in systems if x.split == s.split)
        for k, (a, b) in enumerate(zip(inj_totals[s.name], inj_totals[first])):
            if abs(a - b) > 1e-9:
                raise BenchError(f"phase {ph['name']}: rank {rank} injected {a:.6f} s into {s.name} but {b:.6f} s into {first} (round {k + 1})")
    kept = {s.name: s.kept() for s in systems if isinstance(s, RrfpSystem) and s.kept()}
    # The timed rounds' task records of every rrfp row (cfg "record_tasks"): the calibrated model
    # of the predictions is read off the strict rows' (benchmarks.sim_pred.fit_model), and every
    # row's lets a model be refit and checked offline (python -m benchmarks.sim_pred --from-json).
    timed = {1000 * pi + k for k in range(2, n_rounds)}
    mine = {s.name: {sid: r for sid, r in s.recorded.items() if sid in timed}
            for s in systems if getattr(s, "recorded", None) is not None}
    recorded: dict = {}
    for part in (_gather_obj(mine) if cfg.get("record_tasks") else []):
        for name, steps in part.items():
            for sid, r in steps.items():
                recorded.setdefault(name, {}).setdefault(sid, []).append(r)
    return {"name": ph["name"], "level": ph["level"], "varlen": ph["varlen"], "rounds": rounds, "worst_grad_ratio": worst,
            **({"recorded": recorded} if recorded else {}),
            "kept": kept}


def auto_steps(pi: int, ph: dict, cfg: dict, systems: list[System], work: TextWorkload, injector: Injector) -> None:
    """Every ``auto`` row's remaining measuring and trial steps (rounds 0 and 1 were its first
    two), each on a batch and injected delays of its own (:func:`benchmarks.workloads.auto_step_ids`:
    no timed round's), until it keeps a hint. Every rank runs the same steps: ``auto``'s
    decisions read figures the ranks share.

    Raises:
        BenchError: a row that kept no hint within the steps allowed.
    """
    from .workloads import auto_step_ids

    for s in systems:
        if not isinstance(s, RrfpSystem) or not s.auto_pending():
            continue
        for step_id in auto_step_ids(pi):
            batch = work.batch(step_id, ph["varlen"])
            if cfg.get("comm"):
                batch = batch.with_stamps()
            batch.step_id = step_id
            injector.enabled, injector.step = True, step_id
            injector.reset()
            s.zero_grad()
            dist.barrier()
            s.step(batch)
            if not s.auto_pending():
                break
        if s.auto_pending():
            raise BenchError(f"phase {ph['name']}: {s.name}: auto kept no hint within {len(auto_step_ids(pi))} steps")


# --------------------------------------------------------------------------- driver

def run_setting(cfg: dict, timeout: float = 600.0) -> dict:
    """Launch the rank processes of one setting and return rank 0's result (plus wall time)."""
    from .launcher import launch

    res = launch("benchmarks.compare:rank_main", cfg["n_ranks"], cfg, timeout=timeout, threads=cfg["threads"])
    out = res.result
    out["wall_seconds"] = res.seconds
    return out


# --------------------------------------------------------------------------- static shapes probe


def probe_rank_main(cfg: dict) -> dict | None:
    """Does PyTorch's pipelining accept a step whose sequence length differs from the first
    step's? Step 0 pads to ``T``, step 1 to ``T + 8``; reports what happens on each rank."""
    import torch.distributed.pipelining as pp

    from datetime import timedelta

    rank, P = dist.get_rank(), dist.get_world_size()
    # A group of its own with a short timeout: a mismatch shows up as a wait that never ends.
    group = dist.new_group(timeout=timedelta(seconds=cfg.get("op_timeout", 5)))
    gcfg = GPTConfig(n_layer=P, n_head=2, d_model=16, max_len=64)
    stage = pp.PipelineStage(build_stage(gcfg, P, rank, 0), rank, P, torch.device("cpu"), group=group)
    sched = pp.Schedule1F1B(stage, 2, loss_fn=lm_loss)
    outcome = []
    for k, T in enumerate(cfg.get("lengths", (16, 24))):
        tokens = torch.randint(0, 256, (4, T))
        try:
            sched.step(*((tokens,) if rank == 0 else ()), **({"target": tokens} if rank == P - 1 else {}),
                       return_outputs=False)
            outcome.append(f"step {k} (T={T}): ok")
        except Exception as e:  # noqa: BLE001 - this is what the probe reports
            text = str(e).strip().splitlines()[-1].split(" This is typically")[0]
            outcome.append(f"step {k} (T={T}): {type(e).__name__}: {text[:300]}")
            break
    print(f"rank {rank}: {outcome}", flush=True)
    got = _gather_obj(outcome)
    return {"ranks": got} if rank == 0 else None


def probe_static_shapes(timeout: float = 60.0) -> dict[str, list[str]]:
    """What happens to PyTorch's pipelining when the sequence length changes after the first
    step (longer, then shorter): each rank's outcome, in words."""
    from .harness import BenchError as _BE
    from .launcher import launch

    out = {}
    for label, lengths in (("longer", [16, 24]), ("shorter", [16, 8])):
        cfg = {"op_timeout": 5, "pg_timeout": 10, "lengths": lengths}
        try:
            res = launch("benchmarks.compare:probe_rank_main", 2, cfg, timeout=timeout, kill_on_failure=False)
            logs = res.logs
        except _BE as e:
            logs = e.logs
        lines = []
        for r in sorted(logs):
            text = logs[r]
            said = [l for l in text.splitlines() if l.startswith(f"rank {r}: ")]
            abort = [l.strip() for l in text.splitlines() if "what():" in l or "EnforceNotMet" in l]
            if said:
                lines.append(said[0])
            elif abort:
                lines.append(f"rank {r}: process aborted: {abort[-1][:300]}")
            else:
                lines.append(f"rank {r}: no outcome (killed after a peer failed)")
        out[label] = lines
    return out
