"""The hint table (rrfp.scheduler.registry): one table that every reader of hint names reads,
aliases, refusals, and a policy registered from a module outside the package run by every
front door: ``rrfp simulate --plugin``, ``rrfp train --plugin`` (launcher and ranks),
``LocalPipeline(hint=)`` and ``auto``. The module is docs/scheduling.md's own example, read
from the document, plus a few lines that log what the policy chose."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rrfp.cli import main as rrfp_main
from rrfp.runtime.doors.names import hint_text
from rrfp.scheduler import Placement, resolve_hint
from rrfp.scheduler.hints import hint_form
from rrfp.scheduler.registry import (ALIASES, HINTS, ORDER, SPLIT, HintEntry, auto_candidates, canonical, forms,
                                     markdown_table, names, register)
from rrfp.sim.auto import all_candidates, known_candidates

DOC = Path(__file__).resolve().parent.parent / "docs" / "scheduling.md"

LOGGING = '''

# --- the test's addition: log every task the policy chose, one file per process
import os as _os

_choose = Oldest.choose


def _logged(self, ready, state):
    t = _choose(self, ready, state)
    if t is not None and _os.environ.get("OLDEST_LOG"):
        with open(_os.path.join(_os.environ["OLDEST_LOG"], f"{_os.getpid()}.log"), "a") as f:
            f.write(f"{t}\\n")
    return t


Oldest.choose = _logged
register("oldest-auto", HintEntry(factory=lambda **_: Oldest(), auto=True, help="oldest, for auto"))
'''


def doc_example() -> str:
    """docs/scheduling.md's "Adding a hint" module (its one python block)."""
    (code,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    return code


@pytest.fixture
def table():
    """The hint table as it was, restored after the test (its registrations are its own)."""
    saved = dict(HINTS), dict(ALIASES)
    yield
    for live, old in zip((HINTS, ALIASES), saved):
        live.clear()
        live.update(old)


@pytest.fixture
def plugin(tmp_path, monkeypatch, table):
    """The example module, written to ``tmp_path/oldest_hints.py``; the test's registrations
    are removed afterwards (and the module from ``sys.modules``)."""
    (tmp_path / "oldest_hints.py").write_text(doc_example() + LOGGING)
    log = tmp_path / "log"
    log.mkdir()
    monkeypatch.setenv("OLDEST_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    yield tmp_path, log
    sys.modules.pop("oldest_hints", None)


def chosen(log: Path) -> list[str]:
    return [t for f in sorted(log.iterdir()) for t in f.read_text().split()]


# ------------------------------------------------------------------ the one table
def test_the_docs_table_is_the_registrys():
    assert markdown_table() in DOC.read_text(), ("docs/scheduling.md's hint table differs from the registry: "
                                                 "paste rrfp.scheduler.registry.markdown_table()")


def test_every_reader_reads_the_table(table):
    for name in names():
        assert hint_form(name) == ("backfill" if name == "backfill" else "name") and name in forms()
    assert auto_candidates() == ["strict-split", "backfill", "bf", "bfw-mem", "wfloat"]
    assert names(order=False, auto=True) == ("bf", "bfw-mem")
    # A name registered now is a name for the resolver, the forms, auto and both --help texts.
    register("late-bf", HintEntry(factory=HINTS["bf"].factory, auto=True, auto_rank=35, help="bf, registered late"))
    assert resolve_hint("late-bf", Placement(2), 4)[1].policy == "late-bf"
    assert "late-bf" in forms() and all_candidates() == ("strict", "strict-split", "backfill", "bf", "late-bf",
                                                         "bfw-mem", "wfloat")
    assert "late-bf" in known_candidates(2, 1, "loop", 4)[0]
    for cmd in ("train", "simulate"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            rrfp_main([cmd, "--help"])
        text = re.sub(r"-\s+", "-", " ".join(out.getvalue().split()))  # argparse wraps lines at hyphens
        assert all(n in text for n in names()) and "--plugin MODULE" in text, cmd


def test_torch_schedule_names_are_aliases():
    assert canonical("Interleaved1F1B") == "interleaved-1f1b" and canonical("strict-ScheduleGPipe") == "strict-gpipe"
    assert canonical("x.csv") == "x.csv" and canonical("BF") == "BF"  # only aliases change
    assert set(ALIASES.values()) <= set(HINTS)
    assert hint_text("ScheduleZBVZeroBubble") == "zb-v"
    spec, hint, strict = resolve_hint("strict-ScheduleInterleavedZeroBubble", Placement(2), 4)
    assert (hint.name, strict, spec.split_backward) == ("zb-h1", True, True)


def test_register_refuses_bad_names_and_entries(table):
    for bad in ("", "strict-x", "auto", "a b", "a,b", "order:x", "x.csv", "interleaved1f1b"):
        with pytest.raises(ValueError, match="expected a plain name|already registered"):
            register(bad, lambda **_: None)
    with pytest.raises(ValueError, match="already registered"):
        register("1f1b", lambda **_: None)
    with pytest.raises(ValueError, match="needs a policy factory, an order, or both"):
        HintEntry()
    with pytest.raises(ValueError, match="backward='half': expected 'full' or 'split'"):
        HintEntry(factory=lambda **_: None, backward="half")
    with pytest.raises(ValueError, match="strict='order': expected one of 'compile', None for an entry without"):
        HintEntry(factory=lambda **_: None, strict=ORDER)
    with pytest.raises(TypeError, match="expected a HintEntry or a policy factory"):
        register("x", 3)
    assert HintEntry(order=lambda spec: []).strict == ORDER and HintEntry(order=lambda s: [], backward=SPLIT)


# ------------------------------------------------------- a policy from outside the package
def test_the_doc_example_in_the_simulator_and_auto(plugin):
    tmp, log = plugin
    p = subprocess.run([sys.executable, "-m", "rrfp", "simulate", "--plugin", "oldest_hints", "--hints",
                        "oldest,bf,auto", "--ranks", "2", "-m", "4", "--jitter", "J2"],
                       capture_output=True, text=True, timeout=300, cwd=tmp)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = {ln.split()[0] for ln in p.stdout.splitlines() if ln.strip()}
    assert "oldest" in rows
    # oldest chose every task of its simulated step (2 ranks x 4 microbatches x F, B = 16);
    # oldest-auto allows auto, so auto simulated it among its candidates too.
    ran = chosen(log)
    assert len(ran) >= 16 and sorted(set(ran)) == sorted(f"{s}{k}{m}" for s in (0, 1) for k in "FB" for m in range(4))


def test_auto_ranks_a_registered_hint_that_allows_it(plugin, monkeypatch):
    from rrfp.sim.auto import simulate_auto
    from rrfp.sim.compare import SimConfig

    tmp, log = plugin
    monkeypatch.syspath_prepend(str(tmp))
    import oldest_hints  # noqa: F401  (registers oldest, and oldest-auto with auto=True)

    assert all_candidates()[-1] == "oldest-auto" and "oldest" not in all_candidates()
    run = simulate_auto(SimConfig(n_ranks=2, n_microbatches=4))
    assert "oldest-auto" in dict(run.ranking.order) and chosen(log)  # simulated: its policy chose


def test_a_plugin_that_cannot_be_imported_is_one_line(tmp_path):
    (tmp_path / "broken_hints.py").write_text("raise RuntimeError('no\\nway')\n")
    for argv, want in (
        (["train", "--plugin", "no_such_hints", "--hint", "bf"],
         "rrfp train: error: --plugin='no_such_hints': no module named 'no_such_hints' in the current folder"),
        (["simulate", "--plugin", "broken_hints", "--hints", "bf"],
         "rrfp simulate: error: --plugin='broken_hints': importing it failed: RuntimeError: no way"),
        (["train", "--plugin", "a/b.py"], "--plugin='a/b.py': expected a dotted module name"),
    ):
        p = subprocess.run([sys.executable, "-m", "rrfp", *argv], capture_output=True, text=True, timeout=120,
                           cwd=tmp_path)
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and want in p.stderr, (argv, p.stderr)


def test_the_doc_example_in_a_local_pipeline_equals_a_builtin_hint(plugin, monkeypatch):
    import torch
    from torch import nn
    from torch.nn import functional as F

    import rrfp

    tmp, log = plugin
    monkeypatch.syspath_prepend(str(tmp))
    import oldest_hints  # noqa: F401  (registers oldest)

    def losses(hint: str) -> list[float]:
        torch.manual_seed(0)
        mods = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)]
        opt = torch.optim.SGD([q for m in mods for q in m.parameters()], lr=0.1)
        x, y = torch.randn(12, 8), torch.randn(12, 8)
        out = []
        with rrfp.LocalPipeline(mods, 6, F.mse_loss, hint=hint, deterministic=True) as pipe:
            for _ in range(2):
                opt.zero_grad()
                out.append(pipe.step(x, target=y))
                opt.step()
                assert pipe.hint_name == hint
        return out

    assert losses("oldest") == losses("1f1b")  # the math does not depend on the order
    ran = chosen(log)
    assert len(ran) == 2 * 3 * 6 * 2  # 2 steps x 3 stages x 6 microbatches x (F, B): oldest chose each


@pytest.mark.slow
def test_the_doc_example_in_rrfp_train_equals_the_reference_run(plugin, pp2_run):
    """``rrfp train --plugin oldest_hints --hint oldest``: the launcher checks the hint, each
    rank imports the module and runs it in ``Pipeline(hint="oldest")``; the losses equal the
    reference run's (tests/runs.py's deterministic flags, the placement's strict schedule)."""
    from runs import losses, train

    tmp, log = plugin
    train("--stages", "2", "--steps", "2", "--plugin", "oldest_hints", "--hint", "oldest",
          "--loss-file", str(tmp / "losses"))
    ref, _ = pp2_run
    assert losses(tmp / "losses") == {k: ref[k] for k in (1, 2)}
    # One log per rank process (the launcher imported the module too, and chose nothing):
    # each rank's policy chose each of its tasks, 2 steps x 2 microbatches x (F, B).
    per_rank = sorted(sorted(f.read_text().split()) for f in log.iterdir())
    assert per_rank == [sorted([f"{s}{k}{m}" for k in "FB" for m in (0, 1)] * 2) for s in (0, 1)]
