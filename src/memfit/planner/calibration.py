"""Per-card constants measured on the user's own GPU, kept for the plans made for that card.

Two of the planner's figures are estimates that only a GPU can settle (:mod:`memfit.planner.exact.runtime`):
the CUDA context (what a process holds outside PyTorch's caching allocator: driver state, kernels,
library handles) and how much the caching allocator reserves beyond what it allocates on a real
run. ``memfit calibrate RUN_DIR`` (:mod:`memfit.watch.calibrate`) measures both on a run and keeps
them here, one entry a card; every later plan for that card (``--gpu NAME``) uses them and says so
("calibrated on <card> from <run>"). An explicit ``--context-bytes`` still wins.

- ``context_bytes``: the measured context, in place of the 512 MiB estimate;
- ``allocator_extra_fraction``: the reserve the run held beyond the plan's own allocator model, as a
  fraction of the allocated peak (0 when the model reserved as much or more): a later plan adds that
  fraction of its allocated peak to its reserved memory.

The store is ``<memfit cache>/calibration.json`` (``$MEMFIT_CACHE``, by default ``~/.cache/memfit``,
beside the plan cache), written whole through a temporary file.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from memfit.json_form import JsonForm

STORE_FILE = "calibration.json"
SCHEMA = 1


@dataclass(frozen=True)
class Calibration(JsonForm):
    """The constants of one card, and where they were measured."""

    card: str
    run: str
    context_bytes: int | None
    allocator_extra_fraction: float
    measured: dict[str, int]
    planned: dict[str, int]

    def describe(self) -> str:
        """The line a plan shows."""
        return f"calibrated on {self.card} from {self.run}"

    def to_dict(self) -> dict[str, Any]:
        """The calibration as the store keeps it (``to_json()`` its JSON text)."""
        return asdict(self)


def store_path() -> Path:
    """Where the calibrations live: ``<memfit cache>/calibration.json``."""
    from memfit.files import memfit_cache_dir

    return memfit_cache_dir() / STORE_FILE


def load_all() -> dict[str, Calibration]:
    """Every card's calibration (none when the store does not exist or is not memfit's)."""
    try:
        data = json.loads(store_path().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("cards"), dict):
        return {}
    out = {}
    for card, entry in data["cards"].items():
        try:
            out[card] = Calibration(**entry)
        except TypeError:
            continue
    return out


def for_card(card: str | None) -> Calibration | None:
    """The calibration of ``card`` (a GPU catalog name), or None."""
    return load_all().get(card) if card else None


def save(calibration: Calibration) -> Path:
    """Keep ``calibration`` as its card's (replacing the card's earlier one); the store's path."""
    from memfit.files import write_atomic

    cards = {card: c.to_dict() for card, c in load_all().items()}
    cards[calibration.card] = calibration.to_dict()
    path = store_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"schema": SCHEMA, "cards": cards}, indent=2, sort_keys=True) + "\n")
    return path


def extra_reserved_bytes(calibration: Calibration | None, allocated_bytes: int) -> int:
    """What a plan for a calibrated card reserves beyond its allocator model."""
    if calibration is None or calibration.allocator_extra_fraction <= 0:
        return 0
    return int(allocated_bytes * calibration.allocator_extra_fraction)
