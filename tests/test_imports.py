"""rrfp's import graph, read from the source (``ast``), deferred imports inside functions and
``TYPE_CHECKING`` blocks included: no import cycle, no arrow up the layers of
docs/architecture.md, and no import of the ``benchmarks/`` folder (it uses the package; the
package runs it as a child process)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rrfp

ROOT = Path(rrfp.__file__).resolve().parent

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # Lowest first; a module may import its own layer and the layers below it.
    ("leaves", ("rrfp.errors", "rrfp.lines", "rrfp._json", "rrfp._paths", "rrfp._pdeathsig", "rrfp.resources", "rrfp._net",
                "rrfp._launch_env", "rrfp._secret", "rrfp._inputs", "rrfp.plugins")),
    ("scheduler", ("rrfp.scheduler",)),
    ("model", ("rrfp.model",)),
    ("data", ("rrfp.data",)),
    ("obs", ("rrfp.obs",)),
    ("sim", ("rrfp.sim",)),
    ("transport", ("rrfp.transport",)),
    ("parallel", ("rrfp.parallel",)),
    # runtime/ in three rooms: the per-rank engine, the step features that join it through its
    # seams (observers, control handlers, the decider), and the front doors that build both.
    ("engine", ("rrfp.runtime", "rrfp.runtime.engine")),
    ("features", ("rrfp.runtime.features",)),
    ("doors", ("rrfp.runtime.doors",)),
    ("train", ("rrfp.train",)),
    ("package", ("rrfp",)),  # rrfp/__init__.py, the public names
    ("cli", ("rrfp.cli", "rrfp.__main__", "rrfp.bench_cli", "rrfp.gpu_check", "rrfp.node")),
]

KNOWN_CYCLES: dict[frozenset[str], str] = {}


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """``{dotted module name: file}`` for every ``.py`` file of the package at ``root``."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def imports_of(name: str, source: str, is_package: bool, known: set[str]) -> set[tuple[str, int]]:
    """``{(imported module, line)}`` for every import statement anywhere in ``source`` (module
    ``name``), resolved to the longest module in ``known`` (or kept as written when outside
    rrfp). The parent packages Python imports on the way are not arrows of their own."""
    package = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            resolved = t
            while resolved and resolved not in known:
                resolved = resolved.rpartition(".")[0]
            found.add((resolved or t, node.lineno))
    return found


def graph(root: Path = ROOT) -> dict[str, set[tuple[str, int]]]:
    files = module_files(root)
    known = set(files)
    return {m: {(t, ln) for t, ln in imports_of(m, f.read_text(), f.name == "__init__.py", known) if t != m}
            for m, f in files.items()}


def cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(frozenset(component))
    return out


def layer_of(module: str) -> int:
    """Index of ``module``'s layer in :data:`LAYERS` (the longest matching prefix).

    Raises:
        LookupError: a module no layer names (add it to one).
    """
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    if best is None:
        raise LookupError(f"{module}: in no layer of tests/test_imports.py's LAYERS")
    return best[0]


def upward_arrows(g: dict[str, set[tuple[str, int]]]) -> list[str]:
    return [f"{m}:{ln} imports {t} ({LAYERS[layer_of(t)][0]} is above {LAYERS[layer_of(m)][0]})"
            for m, targets in sorted(g.items()) for t, ln in sorted(targets)
            if t.startswith("rrfp") and layer_of(t) > layer_of(m)]


def test_no_import_cycle_in_rrfp():
    g = graph()
    found = cycles({m: {t for t, _ in ts if t in g} for m, ts in g.items()})
    unexpected = [sorted(c) for c in found if c not in KNOWN_CYCLES]
    assert not unexpected, f"import cycles: {unexpected}"


def test_no_layer_imports_a_layer_above_it():
    assert not upward_arrows(graph())


def test_every_module_is_in_a_layer():
    for m in module_files():
        layer_of(m)


def test_the_package_never_imports_benchmarks():
    found = [f"{m}:{ln}" for m, ts in graph().items() for t, ln in ts if t.split(".")[0] == "benchmarks"]
    assert not found, f"rrfp imports the benchmarks/ folder: {found}"


def test_the_walk_finds_deferred_imports_cycles_and_upward_arrows(tmp_path):
    """The checks above can fail: a package whose deferred imports make a cycle and go up."""
    pkg = tmp_path / "rrfp"
    (pkg / "scheduler").mkdir(parents=True)
    (pkg / "runtime").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scheduler" / "__init__.py").write_text("")
    (pkg / "runtime" / "__init__.py").write_text("")
    (pkg / "scheduler" / "a.py").write_text("def f():\n    from ..runtime import b\n")
    (pkg / "runtime" / "b.py").write_text("from ..scheduler.a import f\n")
    (pkg / "runtime" / "c.py").write_text("import benchmarks.micro\nfrom . import b\n")
    g = graph(pkg)
    assert g["rrfp.scheduler.a"] == {("rrfp.runtime.b", 2)}
    assert g["rrfp.runtime.c"] == {("benchmarks.micro", 1), ("rrfp.runtime.b", 2)}
    assert cycles({m: {t for t, _ in ts} for m, ts in g.items()}) == [frozenset({"rrfp.scheduler.a",
                                                                                 "rrfp.runtime.b"})]
    assert upward_arrows(g) == ["rrfp.scheduler.a:2 imports rrfp.runtime.b (engine is above scheduler)"]


def test_the_runtimes_three_rooms_are_layers(tmp_path):
    """The engine may not import a feature, nor a feature a front door; a door may use both."""
    pkg = tmp_path / "rrfp"
    for room in ("engine", "features", "doors"):
        (pkg / "runtime" / room).mkdir(parents=True)
        (pkg / "runtime" / room / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "runtime" / "__init__.py").write_text("")
    (pkg / "runtime" / "engine" / "loop.py").write_text("from ..features import notices\n")
    (pkg / "runtime" / "features" / "notices.py").write_text("from ..engine import loop\n")
    (pkg / "runtime" / "features" / "auto.py").write_text("def f():\n    from ..doors.config import plan\n")
    (pkg / "runtime" / "doors" / "config.py").write_text("from ..features import notices\nfrom ..engine import loop\n")
    assert upward_arrows(graph(pkg)) == [
        "rrfp.runtime.engine.loop:1 imports rrfp.runtime.features.notices (features is above engine)",
        "rrfp.runtime.features.auto:2 imports rrfp.runtime.doors.config (doors is above features)",
    ]


def test_the_packages_error_names_load_no_torch():
    """``rrfp.PeerLost`` (and the other errors) come from rrfp/errors.py, which imports nothing:
    a launcher or the simulator can catch them without loading torch (on main before this, the
    name was wired to rrfp.transport.base, which loads it)."""
    import subprocess
    import sys

    code = ("import sys, rrfp; [getattr(rrfp, n) for n in ('PeerLost', 'PipelineError', 'WatchdogTimeout')]; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
    from rrfp.errors import PeerLost

    assert rrfp.PeerLost is PeerLost


@pytest.mark.parametrize("cycle", sorted(KNOWN_CYCLES, key=sorted))
def test_each_known_cycle_still_exists(cycle):
    """An exception outlives its cycle only by mistake: delete the entry once the cycle is gone."""
    g = graph()
    assert cycle in cycles({m: {t for t, _ in ts if t in g} for m, ts in g.items()}), KNOWN_CYCLES[cycle]
