"""``memfit calibrate RUN_DIR``: the per-card constants of a run measured on the user's own GPU.

A run's measured peak is compared with the plan it was started with, and two constants of its card
are kept (:mod:`memfit.planner.calibration`) for the plans made later for that card:

- the CUDA context: what the process held outside PyTorch's caching allocator (NVML's reading of the
  process minus ``torch.cuda.memory_reserved()``, the least over the run's steps: ``memory.jsonl``);
- the allocator's extra reserve: ``peak reserved - peak allocated`` measured, less the plan's
  ``reserved - allocated``, as a fraction of the allocated peak (0 when the plan reserved as much).

RUN_DIR is a run folder (``memfit train``'s output_dir or ``MemoryCallback``'s run_dir, whose
``memory.jsonl`` holds the plan in its start record), or a folder holding ``memory_stats.json`` (a
``torch.cuda.memory_stats()`` dump, after the run's steps) beside ``plan.json`` (``memfit plan
--json`` of the run); such a dump has no context reading, so only the allocator constant is taken.
The card is the plan's GPU (``--gpu`` of the plan), or ``--gpu`` here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.errors import UserError
from memfit.planner.calibration import Calibration
from memfit.run_files import MEMORY_FILE

STATS_FILE = "memory_stats.json"
PLAN_FILE = "plan.json"


class CalibrationError(UserError):
    """A run folder that cannot calibrate a card (exit code 2)."""


@dataclass(frozen=True)
class Measured:
    """What a run measured: its peaks, and its context where the run recorded one."""

    allocated_bytes: int
    reserved_bytes: int
    context_bytes: int | None


def calibrate(run_dir: str | Path, gpu: str | None = None) -> Calibration:
    """The calibration ``run_dir`` gives its card (not yet kept: :func:`memfit.planner.calibration.save`)."""
    folder = Path(run_dir)
    if not folder.is_dir():
        raise CalibrationError(
            f"RUN_DIR: {str(folder)!r} is not a folder; pass a run folder (memfit train's output_dir) "
            f"or a folder with {STATS_FILE} and {PLAN_FILE}"
        )
    if (folder / MEMORY_FILE).is_file():
        measured, plan = _from_timeline(folder / MEMORY_FILE)
    elif (folder / STATS_FILE).is_file():
        measured, plan = _from_stats(folder)
    else:
        raise CalibrationError(
            f"RUN_DIR: {str(folder)!r} has neither {MEMORY_FILE} nor {STATS_FILE}; pass a run folder "
            f"(memfit train's output_dir) or a folder with a torch.cuda.memory_stats() dump"
        )
    card = _card(plan, gpu, folder)
    planned = {name: int(plan["peak"][name]) for name in ("allocated_bytes", "reserved_bytes")}
    planned_reserve = planned["reserved_bytes"] - planned["allocated_bytes"]
    measured_reserve = measured.reserved_bytes - measured.allocated_bytes
    fraction = max(measured_reserve - planned_reserve, 0) / measured.allocated_bytes
    figures = {"allocated_bytes": measured.allocated_bytes, "reserved_bytes": measured.reserved_bytes}
    if measured.context_bytes is not None:
        figures["context_bytes"] = measured.context_bytes
    return Calibration(
        card=card,
        run=str(folder.resolve()),
        context_bytes=measured.context_bytes,
        allocator_extra_fraction=round(fraction, 6),
        measured=figures,
        planned=planned,
    )


def _from_timeline(path: Path) -> tuple[Measured, dict[str, Any]]:
    from memfit.watch.timeline import TimelineError, load_timeline

    try:
        timeline = load_timeline(path)
    except TimelineError as err:
        raise CalibrationError(str(err)) from None
    if not timeline.plan:
        raise CalibrationError(
            f"{path}: the run was started without a plan (nothing to compare its peak with); "
            "calibrate a run of memfit train, or one whose MemoryCallback was given its plan"
        )
    cuda = [d for d in timeline.expected_devices if d.startswith("cuda")]
    records = [r["devices"][cuda[0]] for r in timeline.steps if cuda and cuda[0] in r.get("devices", {})]
    peaks = [(e.get("peak_allocated_bytes", 0), e.get("peak_reserved_bytes", 0)) for e in records]
    if not peaks or not max(a for a, _ in peaks):
        raise CalibrationError(f"{path}: no step recorded a CUDA device's peak (a run on a CPU calibrates no card)")
    contexts = [
        e["process_bytes"] - e["reserved_bytes"] for e in records if "process_bytes" in e and "reserved_bytes" in e
    ]
    measured = Measured(
        allocated_bytes=max(a for a, _ in peaks),
        reserved_bytes=max(r for _, r in peaks),
        context_bytes=min(contexts) if contexts else None,
    )
    return measured, timeline.plan


def _from_stats(folder: Path) -> tuple[Measured, dict[str, Any]]:
    stats, plan = _json(folder / STATS_FILE), _json(folder / PLAN_FILE)
    try:
        measured = Measured(
            allocated_bytes=int(stats["allocated_bytes.all.peak"]),
            reserved_bytes=int(stats["reserved_bytes.all.peak"]),
            context_bytes=None,
        )
    except (KeyError, TypeError, ValueError):
        raise CalibrationError(
            f"{folder / STATS_FILE}: not a torch.cuda.memory_stats() dump (it has no "
            "allocated_bytes.all.peak and reserved_bytes.all.peak)"
        ) from None
    if measured.allocated_bytes <= 0:
        raise CalibrationError(
            f"{folder / STATS_FILE}: allocated_bytes.all.peak is {measured.allocated_bytes}: "
            "dump the stats after the run's steps"
        )
    if not isinstance(plan.get("peak"), dict):
        raise CalibrationError(f"{folder / PLAN_FILE}: not a plan (write it with memfit plan ... --json)")
    return measured, plan


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CalibrationError(
            f"{path} is missing: a memory_stats dump is calibrated against the run's plan "
            f"(memfit plan ... --json > {path.name})"
        ) from None
    except (OSError, ValueError) as err:
        raise CalibrationError(f"{path}: not readable JSON ({err})") from None
    if not isinstance(data, dict):
        raise CalibrationError(f"{path}: not a JSON object")
    return data


def _card(plan: dict[str, Any], gpu: str | None, folder: Path) -> str:
    from memfit.models.gpus import get_gpu

    name = gpu or ((plan.get("gpu") or {}).get("name"))
    if not name or name == "budget":
        raise CalibrationError(
            f"--gpu: the plan of {folder} names no GPU; say which card the run ran on "
            "(e.g. --gpu a100-80gb, see memfit models)"
        )
    try:
        return get_gpu(str(name).split(",")[0].strip()).name
    except ValueError as err:
        raise CalibrationError(f"--gpu: {err}") from None
