"""No function in src/ is longer than a screenful and a half: a longer one does more than one job.

Read with ast (decorators and docstrings count, nested functions count within their parent and
again on their own). There are no exceptions: a hot loop keeps its work in one frame by moving
what is rare out of it (see planner/exact/allocator.py's _replay), not by growing past the limit.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "memfit"
MOST_LINES = 100


def function_lengths(root: Path) -> dict[str, int]:
    """``{"package/module.py:function": lines}`` of every function and method under ``root``."""
    lengths = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                name = f"{path.relative_to(root).as_posix()}:{node.name}"
                lengths[name] = max(lengths.get(name, 0), node.end_lineno - first + 1)
    return lengths


def test_no_function_is_over_the_limit():
    too_long = {name: lines for name, lines in function_lengths(SRC).items() if lines > MOST_LINES}
    assert too_long == {}, f"split these by job (at most {MOST_LINES} lines each): {too_long}"


def test_the_count_sees_decorators_methods_and_nested_functions(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(5))
    (package / "mod.py").write_text(
        "import functools\n\n"
        "@functools.cache\n"
        f"def outer():\n{body}\n"
        "    def inner():\n        return 1\n"
        "    return inner\n\n"
        f"class C:\n    def method(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n"
    )
    lengths = function_lengths(tmp_path)
    assert lengths["pkg/mod.py:outer"] == 1 + 1 + 5 + 2 + 1  # decorator, def, body, inner, return
    assert lengths["pkg/mod.py:inner"] == 2
    assert lengths["pkg/mod.py:method"] == 6
