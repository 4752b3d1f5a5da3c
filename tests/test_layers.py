"""The packages stay in layers, with imports pointing one way: down.

cli, ui > infer > train > watch > planner > interop > step > models > (spec, units, files, run_files, options, errors,
json_form, console); merge stands apart: it uses the bottom layer and the Hub fetching of models. Every import counts: at module level and inside
functions (memfit imports heavy dependencies lazily, so an upward import hidden in a function is
as real as one at the top). docs/layout.md explains why the layers are in this order.
"""

from __future__ import annotations

import ast
from pathlib import Path

import memfit

SRC = Path(memfit.__file__).resolve().parent

#: Layer of each top-level part of the package, highest first. A module may import its own part
#: and any part of a lower layer; the bottom's modules may import each other.
LAYERS: dict[str, int] = {
    "__init__": 10, "__main__": 10, "cli": 10, "ui": 10,
    "infer": 9,
    "train": 8,
    "watch": 7,
    "planner": 6,
    "interop": 5,
    "step": 4,
    "models": 3,
    "spec": 1, "units": 1, "files": 1, "run_files": 1, "options": 1, "errors": 1, "json_form": 1, "console": 1,
}
#: merge uses the bottom layer, and of the models package only what fetches a model or adapter by
#: its Hub id (it builds no model); nothing but the CLI and the package's front door use merge.
MERGE = "merge"
MERGE_MAY_USE = ("memfit.models.hub", "memfit.models.catalog", "memfit.models.pickle_weights")
BOTTOM = LAYERS["spec"]


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] + (["__init__"] if len(parts) == 2 else [])
    return ".".join(parts)


def _imports(path: Path, module: str | None = None) -> list[tuple[int, str]]:
    """(line, imported memfit module) for every import in the file, wherever it is."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = module or _module_name(path)
    package = module.removesuffix(".__init__") if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "memfit"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "memfit":
                continue
            if target == "memfit":  # from memfit import spec / merge: the names are modules
                found += [(node.lineno, f"memfit.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, target))
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
    parts = {p.stem if p.is_file() else p.name for p in SRC.iterdir() if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))}
    assert parts - set(LAYERS) - {MERGE} == set(), "a new module or package needs its place in LAYERS (and docs/layout.md)"


def test_imports_point_down():
    upward = []
    for path in sorted(SRC.rglob("*.py")):
        importer = _module_name(path)
        for line, imported in _imports(path):
            if not _allowed(importer, imported):
                upward.append(f"{path.relative_to(SRC.parent)}:{line}: {importer} imports {imported}")
    assert not upward, "imports that point up or sideways:\n" + "\n".join(upward)


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
