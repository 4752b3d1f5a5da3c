"""The packages stay in layers, with imports pointing one way: down.

cli, ui > infer > train > watch > planner > interop > step > models > (spec, units, files, run_files, options, errors,
json_form, console); merge stands apart: it uses the bottom layer and the Hub fetching of models. Within the planner:
search > its top-level modules (api, inputs, report, layout, sharding, zero, target, throughput) > shortcuts > exact >
(categories, errors). Every import counts: at module level and inside
functions (memfit imports heavy dependencies lazily, so an upward import hidden in a function is
as real as one at the top). docs/layout.md explains why the layers are in this order.

Within a layer, and within a package, no two modules import each other, directly or around a
circle: each module's imports form a graph without cycles (its strongly connected components are
single modules), function-level imports included.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import memfit

SRC = Path(memfit.__file__).resolve().parent

#: Layer of each top-level part of the package, highest first. A module may import its own part
#: and any part of a lower layer; the bottom's modules may import each other.
LAYERS: dict[str, int] = {
    "__init__": 10,
    "__main__": 10,
    "cli": 10,
    "ui": 10,
    "infer": 9,
    "train": 8,
    "watch": 7,
    "planner": 6,
    "interop": 5,
    "step": 4,
    "models": 3,
    "spec": 1,
    "units": 1,
    "files": 1,
    "exits": 1,
    "collector": 1,
    "run_files": 1,
    "options": 1,
    "errors": 1,
    "json_form": 1,
    "console": 1,
}
#: merge uses the bottom layer, and of the models package only what fetches a model or adapter by
#: its Hub id (it builds no model); nothing but the CLI and the package's front door use merge.
MERGE = "merge"
MERGE_MAY_USE = ("memfit.models.hub", "memfit.models.catalog", "memfit.models.pickle_weights")
BOTTOM = LAYERS["spec"]


#: Within memfit.planner: the level of each subpackage and top-level module, highest first. A module
#: of the planner may import its own level and lower ones: the search plans with the API, the API
#: takes the shortcuts, the shortcuts run the exact simulation, and the exact simulation knows
#: nothing of what makes it fast (its caller hands it the step's seam runner).
PLANNER_LEVELS: dict[str, int] = {
    "search": 5,
    "__init__": 4,
    "api": 4,
    "experts": 4,
    "vision": 4,
    "grpo": 4,
    "inputs": 4,
    "report": 4,
    "layout": 4,
    "sharding": 4,
    "zero": 4,
    "target": 4,
    "throughput": 4,
    "shortcuts": 3,
    "exact": 2,
    "calibration": 1,
    "categories": 1,
    "errors": 1,
}


def _planner_part(module: str) -> str | None:
    """The planner subpackage or top-level module ``module`` belongs to (None outside the planner)."""
    parts = module.split(".")
    if parts[:2] != ["memfit", "planner"]:
        return None
    return parts[2] if len(parts) > 2 else "__init__"


def _planner_allowed(importer: str, imported: str) -> bool:
    src, dst = _planner_part(importer), _planner_part(imported)
    if src is None or dst is None:
        return True
    return src in PLANNER_LEVELS and dst in PLANNER_LEVELS and PLANNER_LEVELS[dst] <= PLANNER_LEVELS[src]


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] + (["__init__"] if len(parts) == 2 else [])
    return ".".join(parts)


def _statements(path: Path, module: str | None = None) -> list[tuple[int, str, list[str]]]:
    """(line, imported memfit module or package, the names a ``from`` import takes from it) for
    every import in the file, wherever it is; relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = module or _module_name(path)
    package = module.removesuffix(".__init__") if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names if alias.name.split(".")[0] == "memfit"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "memfit":
                found.append((node.lineno, target, [alias.name for alias in node.names]))
    return found


def _imports(path: Path, module: str | None = None) -> list[tuple[int, str]]:
    """(line, imported memfit module) for every import in the file, wherever it is."""
    found = []
    for line, target, names in _statements(path, module):
        if target == "memfit" and names:  # from memfit import spec / merge: the names are modules
            found += [(line, f"memfit.{name}") for name in names]
        else:
            found.append((line, target))
    return found


def _module_graph(paths: Iterable[Path]) -> dict[str, set[str]]:
    """Module -> the memfit modules it imports, wherever the import is. ``from package import name``
    is an import of the module ``package.name`` where there is one, else of the package."""
    modules = {_module_name(path): path for path in paths}

    def known(name: str) -> str | None:
        return next((m for m in (name, f"{name}.__init__") if m in modules), None)

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        imported: set[str | None] = set()
        for _, target, names in _statements(path, module):
            submodules = [known(f"{target}.{name}") for name in names]
            imported |= set(submodules) if submodules and all(submodules) else {known(target)}
        graph[module] = {m for m in imported if m is not None and m != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan's algorithm,
    iterative): each is a set of modules that import each other around a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _allowed(importer: str, imported: str) -> bool:
    src, dst = _part(importer), _part(imported)
    if src == dst:
        return True
    if dst == MERGE:
        return src in ("cli", "__init__")
    if src == MERGE:
        return LAYERS.get(dst) == BOTTOM or imported in MERGE_MAY_USE
    if src not in LAYERS or dst not in LAYERS:
        return False
    if src == "ui" and dst in ("cli", "__main__"):
        return False  # the CLI imports the page's command to register it: the page never imports the CLI
    # The same layer: the entry points (cli, __main__, the package's front door) use each other,
    # and so do the bottom's small modules.
    return LAYERS[dst] <= LAYERS[src]


def test_every_part_of_the_package_has_a_layer():
    parts = {
        p.stem if p.is_file() else p.name
        for p in SRC.iterdir()
        if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))
    }
    assert parts - set(LAYERS) - {MERGE} == set(), (
        "a new module or package needs its place in LAYERS (and docs/layout.md)"
    )


def test_imports_point_down():
    upward = []
    for path in sorted(SRC.rglob("*.py")):
        importer = _module_name(path)
        for line, imported in _imports(path):
            if not _allowed(importer, imported):
                upward.append(f"{path.relative_to(SRC.parent)}:{line}: {importer} imports {imported}")
    assert not upward, "imports that point up or sideways:\n" + "\n".join(upward)


def test_every_part_of_the_planner_has_a_level():
    planner = SRC / "planner"
    parts = {
        p.stem if p.is_file() else p.name
        for p in planner.iterdir()
        if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))
    }
    assert parts - set(PLANNER_LEVELS) == set(), (
        "a new planner module or package needs its place in PLANNER_LEVELS (and docs/layout.md)"
    )


def test_imports_within_the_planner_point_down():
    upward = []
    for path in sorted((SRC / "planner").rglob("*.py")):
        importer = _module_name(path)
        for line, imported in _imports(path):
            if not _planner_allowed(importer, imported):
                upward.append(f"{path.relative_to(SRC.parent)}:{line}: {importer} imports {imported}")
    assert not upward, "planner imports that point up:\n" + "\n".join(upward)
    assert not _planner_allowed("memfit.planner.exact.simulate", "memfit.planner.shortcuts.replay")
    assert not _planner_allowed("memfit.planner.shortcuts.depths", "memfit.planner.layout")
    assert not _planner_allowed("memfit.planner.api", "memfit.planner.search.driver")
    assert _planner_allowed("memfit.planner.search.driver", "memfit.planner.shortcuts.workers")
    assert _planner_allowed("memfit.planner.exact.tracker", "memfit.planner.categories")


def test_no_module_imports_itself_around_a_circle():
    graph = _module_graph(sorted(SRC.rglob("*.py")))
    circles = [
        " -> ".join(c) + "; " + "; ".join(f"{m} imports {', '.join(sorted(graph[m] & set(c)))}" for m in c)
        for c in _cycles(graph)
    ]
    assert not circles, "modules that import each other around a circle:\n" + "\n".join(circles)


def test_the_circle_check_finds_circles_through_functions_and_packages(tmp_path):
    package = tmp_path / "memfit"
    (package / "part").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "part" / "__init__.py").write_text("")
    (package / "part" / "a.py").write_text("def f():\n    from memfit.part import b\n")
    (package / "part" / "b.py").write_text("from memfit.part.c import g\n")
    (package / "part" / "c.py").write_text("from . import a\n\n\ndef g():\n    pass\n")
    (package / "part" / "d.py").write_text("from memfit.part import a\n")
    global SRC
    real, SRC = SRC, package
    try:
        graph = _module_graph(sorted(package.rglob("*.py")))
    finally:
        SRC = real
    assert graph["memfit.part.a"] == {"memfit.part.b"} and graph["memfit.part.c"] == {"memfit.part.a"}
    assert _cycles(graph) == [["memfit.part.a", "memfit.part.b", "memfit.part.c"]]
    assert _cycles({"x": {"y"}, "y": set()}) == []


def test_the_check_sees_function_level_and_relative_imports(tmp_path):
    # The checker itself: an upward import inside a function, and a relative one, are both found.
    sample = SRC / "step" / "__init__.py"
    assert _module_name(sample) == "memfit.step"
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from memfit.train.recipe import train\n\n\nfrom .losses import IGNORE_INDEX\n")
    assert sorted(_imports(probe, "memfit.step.probe")) == [(2, "memfit.train.recipe"), (5, "memfit.step.losses")]
    assert not _allowed("memfit.step.losses", "memfit.train.recipe")
    assert not _allowed("memfit.models.build", "memfit.step.prepare")
    assert not _allowed("memfit.merge.api", "memfit.models.build")
    assert _allowed("memfit.merge.api", "memfit.models.hub")
    assert _allowed("memfit.train.recipe", "memfit.step.builder")
    assert _allowed("memfit.spec", "memfit.units")
    assert not _allowed("memfit.units", "memfit.models.gpus")
    assert _allowed("memfit.cli", "memfit.ui.command") and _allowed("memfit.ui.app", "memfit.train.config")
    assert not _allowed("memfit.ui.app", "memfit.cli")
    assert _allowed("memfit.planner.api", "memfit.interop.reading")
    assert _allowed("memfit.interop.reading", "memfit.spec")
    assert not _allowed("memfit.interop.reading", "memfit.planner.api")
