"""Where the benchmarks and the guides are: the source tree's ``benchmarks/`` and ``docs/``
next to the package, or their copies inside an installed package (``rrfp/_bench/benchmarks``,
``rrfp/_docs``; see setup.py). No torch."""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def bench_root() -> Path | None:
    """The folder holding the ``benchmarks`` package (put it on ``sys.path`` and
    ``PYTHONPATH`` to import it), or None if this installation has none."""
    for root in (_PKG.parent, _PKG / "_bench"):
        if (root / "benchmarks" / "run_all.py").is_file():
            return root
    return None


def doc_path(name: str) -> str:
    """The path of guide ``name`` (``simulator.md``) to show users: the source tree's
    ``docs/NAME``, else the installed copy, else ``docs/NAME`` as written in the repository."""
    for folder in (_PKG.parent / "docs", _PKG / "_docs"):
        if (folder / name).is_file():
            return str(folder / name)
    return f"docs/{name} in the rrfp repository"
