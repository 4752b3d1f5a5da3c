"""``memfit.watch``: record a run's memory, warn while it runs, explain afterwards.

- :class:`MemoryRecorder`: the recorder any training loop can drive (memfit's trainer does);
- :class:`MemoryCallback`: the same for a Hugging Face ``Trainer`` (imports transformers on use);
- :func:`diagnose` (``memfit doctor``) and :func:`write_report` (``memfit report``) for a run folder;
- :class:`Finding`, :class:`Thresholds`, :func:`inspect_model`, :func:`detect_all`.

Nothing heavy is imported with the package: each name loads its module when first used.

May import: :mod:`memfit.planner` (the tracker that attributes memory to categories),
:mod:`memfit.step`, :mod:`memfit.models` and the bottom layer. Never train or the CLI: a Hugging Face
``Trainer`` user of :class:`MemoryCallback` does not load memfit's trainer.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "MemoryRecorder": "memfit.watch.recorder",
    "MemoryCallback": "memfit.watch.hf",
    "Finding": "memfit.watch.timeline",
    "Timeline": "memfit.watch.timeline",
    "load_run": "memfit.watch.timeline",
    "Thresholds": "memfit.watch.thresholds",
    "detect_all": "memfit.watch.detectors",
    "inspect_model": "memfit.watch.detectors",
    "compare_categories": "memfit.watch.compare",
    "diagnose": "memfit.watch.doctor",
    "write_report": "memfit.watch.report",
}

__all__ = sorted(_EXPORTS)  # noqa: PLE0605 - the lazy names, listed once in _EXPORTS


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'memfit.watch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
