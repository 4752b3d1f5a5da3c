"""The shape of the planner's code, for a tree and one before it: what a newcomer has to hold.

Counts, from the source alone (Python's ``ast``): the planner's files and lines and its largest
file; the process-global mutable state of the planner and the step (module-level names that
functions change: ``global`` rebinding, item assignment, a mutating method such as ``append``,
``clear`` or ``keep``); the step's modules that ask about fake tensors; functions over 100 lines in
``src``; lines over 120 characters in src, tests, benchmarks and scripts.

    python benchmarks/code_shape.py --before ef7962d    # this tree and that commit's
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results" / "code_shape.json"
sys.path.insert(0, str(BENCH))
from _machine import write_results  # noqa: E402

#: Methods that change the object they are called on.
MUTATING = {
    "append",
    "extend",
    "add",
    "update",
    "clear",
    "pop",
    "setdefault",
    "insert",
    "remove",
    "discard",
    "popitem",
    "keep",
    "put",
}


def _module_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _changed_in_functions(tree: ast.Module, names: set[str]) -> set[str]:
    changed = set()
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Global):
                changed.update(node.names)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATING:
                if isinstance(node.func.value, ast.Name):
                    changed.add(node.func.value.id)
            elif isinstance(node, (ast.Assign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                        changed.add(target.value.id)
    return changed & names


def _global_state(root: Path, paths: list[Path]) -> list[str]:
    """``module:name`` of each module-level name that a function changes, in its own module or in
    one that imports it by name (``from memfit.planner.shortcuts.memo import MEMO``)."""
    trees = {
        ".".join(p.relative_to(root / "src").with_suffix("").parts).removesuffix(".__init__"): ast.parse(p.read_text())
        for p in paths
    }
    owned = {module: _module_names(tree) for module, tree in trees.items()}
    state = set()
    for module, tree in trees.items():
        imported = {
            alias.asname or alias.name: (node.module, alias.name)
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module in owned
            for alias in node.names
            if alias.name in owned[node.module]
        }
        for name in _changed_in_functions(tree, owned[module] | set(imported)):
            origin = imported.get(name, (module, name)) if name not in owned[module] else (module, name)
            state.add(f"{origin[0]}:{origin[1]}")
    return sorted(state)


def shape(root: Path) -> dict:
    """The counts of the tree at ``root``."""
    planner = sorted((root / "src/memfit/planner").rglob("*.py"))
    step = sorted((root / "src/memfit/step").rglob("*.py"))
    lines = {p: len(p.read_text().splitlines()) for p in planner}
    largest = max(lines, key=lines.__getitem__)
    state = _global_state(root, planner + step)
    long_functions = []
    for path in sorted((root / "src/memfit").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 100:
                long_functions.append(f"{path.relative_to(root / 'src')}:{node.name}")
    wide = sum(
        len(line) > 120
        for folder in ("src", "tests", "benchmarks", "scripts")
        if (root / folder).exists()
        for path in (root / folder).rglob("*.py")
        for line in path.read_text().splitlines()
    )
    return {
        "planner_files": len(planner),
        "planner_lines": sum(lines.values()),
        "largest_planner_file": str(largest.relative_to(root / "src")),
        "largest_planner_file_lines": lines[largest],
        "process_global_state": state,
        "step_modules_asking_about_fake_tensors": [
            str(p.relative_to(root / "src"))
            for p in step
            if "is_fake" in p.read_text() or "FakeTensor" in p.read_text()
        ],
        "functions_over_100_lines": long_functions,
        "lines_over_120_characters": wide,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a commit to compare with (git rev)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        archive = subprocess.run(["git", "archive", args.before], cwd=REPO, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
        before = shape(Path(folder))
    after = shape(REPO)
    for name in after:
        old, new = before[name], after[name]
        print(f"{name}: {len(old) if isinstance(old, list) else old} -> {len(new) if isinstance(new, list) else new}")
    write_results(
        RESULTS,
        {
            "benchmark": "code_shape",
            "command": f"python benchmarks/code_shape.py --before {args.before}",
            "before": {"commit": args.before, **before},
            "after": after,
        },
    )


if __name__ == "__main__":
    main()
