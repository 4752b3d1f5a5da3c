"""The results files under benchmarks/results/, as benchmarks/figures.py and the generated blocks'
renderers (benchmarks/_figure_blocks.py) read them: :class:`Results` loads each file once and
answers the number at a dotted key, in a unit; :class:`FigureError` is a reference that cannot be
followed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"

UNITS: dict[str, Callable[[float], float]] = {
    "GiB": lambda v: v / 2**30,
    "MiB": lambda v: v / 2**20,
    "KiB": lambda v: v / 2**10,
    "GB": lambda v: v / 1e9,
    "MB": lambda v: v / 1e6,
    "%": lambda v: v * 100,
}
_KEY_PART = re.compile(r"\.?(?:(?P<name>[^.\[\]]+)|\[(?P<field>[^=\]]+)=(?P<value>[^\]]*)\])")


class FigureError(ValueError):
    """A reference that cannot be followed: no such results file, key or unit."""


@dataclass
class Results:
    """The results files figures are read from, each loaded once. ``gpu_root`` is where the GPU
    campaign's folders are (benchmarks/results/gpu/ unless a test points elsewhere);
    ``include_tiny`` lets the GPU blocks show a dry run (tests only)."""

    root: Path = RESULTS
    gpu_root: Path | None = None
    include_tiny: bool = False
    _cache: dict[str, Any] = field(default_factory=dict)

    def load(self, name: str) -> Any:
        if name not in self._cache:
            path = self.root / f"{name}.json"
            if not path.is_file():
                raise FigureError(f"no results file {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
            self._cache[name] = json.loads(path.read_text())
        return self._cache[name]

    def value(self, name: str, key: str, unit: str | None = None) -> float:
        """The number at ``key`` in results file ``name``, converted to ``unit``."""
        found = lookup(self.load(name), key, where=name)
        if isinstance(found, bool) or not isinstance(found, (int, float)):
            raise FigureError(f"{name} {key} is {found!r}, not a number")
        if unit is None:
            return found
        if unit not in UNITS:
            raise FigureError(f"unit {unit!r} is not one of {', '.join(UNITS)}")
        return UNITS[unit](found)


def lookup(data: Any, key: str, where: str = "results") -> Any:
    """The value at dotted ``key`` in ``data`` (``name``, ``0`` for a list index, ``[field=value]``,
    ``#`` for the number of items)."""
    position, node = 0, data
    while position < len(key):
        match = _KEY_PART.match(key, position)
        if not match or match.end() == position:
            raise FigureError(f"{where}: cannot read key {key!r} at {key[position:]!r}")
        position = match.end()
        if match.group("field") is not None:
            wanted = (match.group("field"), match.group("value"))
            items = (
                [item for item in node if isinstance(item, dict) and str(item.get(wanted[0])) == wanted[1]]
                if isinstance(node, list)
                else []
            )
            if len(items) != 1:
                raise FigureError(f"{where}: {len(items)} items with {wanted[0]}={wanted[1]} in {key!r}, not one")
            node = items[0]
            continue
        name = match.group("name")
        if name == "#" and isinstance(node, (list, dict)):
            node = len(node)
        elif isinstance(node, list) and name.isdigit() and int(name) < len(node):
            node = node[int(name)]
        elif isinstance(node, dict) and name in node:
            node = node[name]
        else:
            raise FigureError(f"{where} has no {key!r} (no {name!r})")
    return node
