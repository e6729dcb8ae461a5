"""Rank 0's report of ``rrfp train``: per-step lines (loss, tokens per second, each rank's
bubble and peak in-flight) from the statistics every rank sends as control messages, the
evaluations, and the closing summary. Statistics from peers are validated before use: a forged
or malformed one is counted, logged (rate-limited) and dropped.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from ..scheduler.tasks import Placement
from .memory import mem_problem, step_text, summary_text
from .progress import Output
from ..lines import say


class Reporter:
    """Rank 0's view of the run: collects per-rank step statistics and prints them."""

    def __init__(self, args: argparse.Namespace, n_ranks: int, place: Placement, out: Output | None = None) -> None:
        self.args = args
        self.out = out if out is not None else Output(args.steps, args.quiet)
        self.evals: dict[int, float] = {}
        self.n_ranks = n_ranks
        self.place = place
        self.pending: dict[int, dict[int, dict]] = {}
        self.tokens: dict[int, int] = {}
        self.step_time: dict[int, float] = {}
        self.rows: list[dict] = []
        self.next_step = 0
        self.notes: dict[int, list[str]] = {}
        self.extras = None  # lr, grad norm, TFLOP/s, MFU: a StepExtras (rrfp/train/stepline.py) the worker sets

    memory_sources = ""
    """Said after the memory breakdown in the summary: how the peak and the limit are read
    (:meth:`rrfp.train.memory.RankMemory.sources`)."""

    hint_detail = ""
    """Said after the hint's name in the summary (``auto``: what it kept, or that the run ended
    before it chose)."""

    def note(self, step: int, line: str) -> None:
        """Show ``line`` (an evaluation, a committed checkpoint) right after the line of step
        ``step`` (1-based: the step it follows), at once if that line is out already. Step
        lines wait for every rank's statistics, so printing the note directly could put it
        before the step it follows."""
        if step <= self.next_step:
            self.out.message(line)
        else:
            self.notes.setdefault(step, []).append(line)

    def flush_notes(self) -> None:
        """Print the notes still waiting for their step lines (the run is failing: those step
        lines may never come, but a committed checkpoint must still be told)."""
        for step in sorted(self.notes):
            for line in self.notes.pop(step):
                self.out.message(line)

    def add(self, meta: dict, src: int) -> None:
        """Take one rank's statistics or evaluation; a malformed one is counted, logged
        (rate-limited) and dropped.

        Checked: kind, step in the window still open, finite non-negative numbers of the
        right types, busy <= wall, and that only the rank holding the last stage reports a
        loss (the sender owns the stage it reports)."""
        if isinstance(meta, dict) and meta.get("kind") == "eval":
            step, loss = meta.get("step"), meta.get("loss")
            if (type(step) is int and type(loss) in (int, float) and math.isfinite(loss)
                    and 0 <= step <= self.args.steps):
                self.evals[step] = float(loss)
                if self.extras is not None:
                    self.extras.evaluation(step, float(loss))
                self.note(step, f"eval after step {step:4d}/{self.args.steps}  validation loss {loss:7.4f}")
                return
        why = _stats_problem(meta, src, self)
        if why is not None:
            self.ignored = getattr(self, "ignored", 0) + 1
            n = self.ignored
            if n <= 3 or n & (n - 1) == 0:  # a flood must not flood the log
                say(f"rrfp train: rank 0: ignored statistics message #{n} from rank {src}: {why}", sys.stderr)
            return
        if meta["step"] in self.pending and src in self.pending[meta["step"]]:
            return  # a second copy: the first stands
        self.pending.setdefault(meta["step"], {})[src] = meta

    def flush(self) -> None:
        while self.next_step in self.pending and len(self.pending[self.next_step]) == self.n_ranks:
            k = self.next_step
            per_rank = self.pending.pop(k)
            loss = next((m["loss"] for m in per_rank.values() if m.get("loss") is not None), math.nan)
            bubble = [1.0 - per_rank[r]["busy"] / per_rank[r]["wall"] if per_rank[r]["wall"] > 0 else 0.0 for r in range(self.n_ranks)]
            peak = [per_rank[r]["peak"] for r in range(self.n_ranks)]
            t = self.step_time[k]
            mem = [per_rank[r].get("mem") for r in range(self.n_ranks)]
            row = dict(step=k, loss=loss, seconds=t, tokens=self.tokens[k], tok_s=self.tokens[k] / t, bubble=bubble,
                       peak=peak, mem=mem)
            more = ""
            if self.extras is not None:
                row.update(self.extras.fields(per_rank))
                more = self.extras.text(row) + "  "
                self.extras.publish(row)
            self.rows.append(row)
            self._say_overrun(k, per_rank)
            mem_text = step_text(mem)
            self.out.step(
                f"step {k + 1:4d}/{self.args.steps}  loss {loss:7.4f}  tok/s {row['tok_s']:8.0f}  {more}"
                f"step {t:6.3f} s  bubble/rank [{' '.join(f'{b:.2f}' for b in bubble)}]  "
                f"peak in-flight [{' '.join(str(p) for p in peak)}]{'  ' + mem_text if mem_text else ''}",
                postfix=f"loss {loss:.4f}, {row['tok_s']:.0f} tok/s",
            )
            self.next_step += 1
            for line in self.notes.pop(self.next_step, []):
                self.out.message(line)

    def _say_overrun(self, k: int, per_rank: dict) -> None:
        # Never a silent overrun: the first step in which a rank broke the memory budget, once.
        over = [(r, per_rank[r]["mem"]["activations"], per_rank[r]["peak"]) for r in range(self.n_ranks)
                if per_rank[r].get("over")]
        if over and not self.overrun_said and getattr(self.args, "memory_budget", None) is not None:
            from ..scheduler.memory import budget_bytes, overrun_line

            self.overrun_said = True
            hint = per_rank[over[0][0]]["over"]
            self.note(k + 1, "rrfp train: " + overrun_line(hint, budget_bytes(self.args.memory_budget), k + 1, over))

    overrun_said = False
    """The line of a broken memory budget was said (:meth:`_say_overrun`)."""

    def summary(self, total: float) -> None:
        rows = self.rows
        if self.extras is not None:
            self.extras.close()
        if getattr(self.args, "loss_file", None):
            write_loss_file(self.args.loss_file, rows)
        if not rows:
            return
        first, last = rows[0]["loss"], rows[-1]["loss"]
        steady = rows[1:] or rows
        which = "after the first step" if len(rows) > 1 else "(one step, warm-up included)"
        tok_s = sum(r["tokens"] for r in steady) / sum(r["seconds"] for r in steady)
        mean_bubble = [sum(r["bubble"][i] for r in steady) / len(steady) for i in range(self.n_ranks)]
        val = f"; validation loss {self.evals[max(self.evals)]:.4f}" if self.evals else ""
        self.out.close_bar()
        self.out.message(
            f"done: {len(rows)} steps in {total:.1f} s, {tok_s:.0f} tok/s {which}; "
            f"loss {first:.4f} -> {last:.4f} ({_change(first, last)}); "
            f"per-step mean bubble/rank [{' '.join(f'{b:.2f}' for b in mean_bubble)}]; hint {self.args.hint}{self.hint_detail}{val}"
        )
        if any(rows[-1]["mem"]):
            self.out.message(summary_text(rows[-1]["mem"], self.memory_sources))


def write_loss_file(path: str, rows: list[dict]) -> None:
    """``--loss-file``: one line per step, ``<step (1-based)> <loss as float.hex>``, the
    exact float64 each step reported (two runs compare bit for bit); written atomically.

    Raises:
        OSError: naming the file.
    """
    from .guard import atomic_write_text

    atomic_write_text(Path(path), "".join(f"{r['step'] + 1} {float(r['loss']).hex()}\n" for r in rows))


def _change(first: float, last: float) -> str:
    if first == 0 or not (math.isfinite(first) and math.isfinite(last)):
        return "change n/a"
    return f"{(last - first) / first * 100:+.1f}%"


def _stats_problem(meta: object, src: int, rep: Reporter) -> str | None:
    """Why a statistics message is refused, or None."""
    if not isinstance(meta, dict) or meta.get("kind") != "stats":
        return "not a statistics message"
    step = meta.get("step")
    if type(step) is not int or not rep.next_step <= step < rep.args.steps:
        return f"step {step!r} outside {rep.next_step}..{rep.args.steps - 1}"
    if not 0 <= src < rep.n_ranks:
        return "unknown rank"
    for k in ("busy", "wall"):
        v = meta.get(k)
        if type(v) not in (int, float) or not math.isfinite(v) or v < 0:
            return f"{k}={v!r} is not a finite non-negative number"
    if meta["busy"] > meta["wall"] * 1.001 + 1e-6:
        return f"busy {meta['busy']} exceeds wall {meta['wall']}"
    peak = meta.get("peak")
    if type(peak) is not int or not 0 <= peak <= rep.args.microbatches * rep.place.n_stages:
        return f"peak={peak!r} out of range"
    loss, owns_last = meta.get("loss"), rep.place.n_stages - 1 in rep.place.stages_of(src)
    if loss is not None and not owns_last:
        return f"a loss from rank {src}, which does not hold the last stage"
    if loss is not None and (type(loss) not in (int, float) or not math.isfinite(loss)):
        return f"loss={loss!r} is not a finite number"
    if loss is None and owns_last and not getattr(rep.args, "skip_nonfinite", False):
        return "no loss from the rank holding the last stage"
    if "mem" in meta and (why := mem_problem(meta["mem"])) is not None:
        return why
    over = meta.get("over", False)
    if over is not False and not (type(over) is str and 0 < len(over) <= 200 and "mem" in meta):
        return f"over={repr(over)[:80]} is neither False nor a hint's name beside memory figures"
    if rep.extras is not None:
        from .stepline import fields_problem

        return fields_problem(meta)
    return None
