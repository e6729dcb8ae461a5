"""The house rules a machine can check: no function in ``rrfp/`` longer than
:data:`MAX_LINES` lines, no module longer than :data:`MAX_MODULE_LINES`."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "rrfp"
MAX_LINES = 80
MAX_MODULE_LINES = 620  # "about 600"

# Functions allowed over the limit for now (none).
NOT_YET: set[str] = set()


def _functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")
        else:
            yield from _functions(node, prefix)


def long_functions(limit: int = MAX_LINES) -> dict[str, int]:
    """``"path:Qualified.name" -> lines`` for every function in the package over ``limit``."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for name, node in _functions(ast.parse(path.read_text(), str(path))):
            n = node.end_lineno - node.lineno + 1
            if n > limit:
                found[f"{rel}:{name}"] = n
    return found


def test_the_long_function_finder_finds_a_long_function():
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_LINES))
    tree = ast.parse(f"class C:\n    def f(self):\n{body}\n")
    names = {name: node.end_lineno - node.lineno + 1 for name, node in _functions(tree)}
    assert names == {"C.f": MAX_LINES + 1}


def test_no_function_over_the_limit():
    over = {name: n for name, n in long_functions().items() if name not in NOT_YET}
    assert over == {}, f"functions over {MAX_LINES} lines: {over}"


def test_no_module_over_the_limit():
    over = {p.relative_to(PACKAGE).as_posix(): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert over == {}, f"modules over {MAX_MODULE_LINES} lines: {over}"
