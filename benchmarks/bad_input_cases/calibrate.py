"""memfit calibrate's bad inputs: folders that are not runs, runs that cannot calibrate a card."""

from __future__ import annotations

import json
from pathlib import Path

from ._case import Case

_GIB = 2**30
_PLAN = {
    "model": "tiny",
    "spec": {},
    "peak": {"allocated_bytes": 2 * _GIB, "reserved_bytes": 2 * _GIB + 2**26, "device_total_bytes": 3 * _GIB},
    "categories": {},
    "gpu": None,
    "details": {},
}

CASES: list[Case] = [
    Case(
        "calibrate {d}/calibrate-nothing-here",
        2,
        fast=True,
        says=("RUN_DIR", "calibrate-nothing-here", "is not a folder"),
    ),
    Case("calibrate {d}/calibrate-empty", 2, says=("RUN_DIR", "has neither memory.jsonl nor memory_stats.json")),
    Case(
        "calibrate {d}/calibrate-cpu-run",
        2,
        says=("a run on a CPU calibrates no card",),
        keeps=("calibrate-cpu-run/memory.jsonl",),
    ),
    Case("calibrate {d}/calibrate-no-plan", 2, says=("without a plan",), keeps=("calibrate-no-plan/memory.jsonl",)),
    Case("calibrate {d}/calibrate-stats-no-plan", 2, says=("plan.json is missing",)),
    Case(
        "calibrate {d}/calibrate-stats-not-stats",
        2,
        says=("not a torch.cuda.memory_stats() dump",),
        keeps=("calibrate-stats-not-stats/memory_stats.json",),
    ),
    Case("calibrate {d}/calibrate-stats --gpu a100-81gb", 2, fast=True, says=("--gpu", "a100-81gb")),
    Case("calibrate {d}/calibrate-stats", 2, says=("--gpu", "names no GPU")),
]


def _run(folder: Path, records: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "memory.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def make_inputs(root: Path) -> None:
    """The folders the cases name."""
    (root / "calibrate-empty").mkdir(parents=True, exist_ok=True)
    start = {
        "kind": "start",
        "schema": 1,
        "time": 0.0,
        "source": "test",
        "expected_devices": ["cpu"],
        "cuda_devices": [],
        "device_capacity_bytes": {},
        "host_total_bytes": 16 * _GIB,
        "rss_bytes": 2**28,
        "total_steps": 1,
        "resumed_from_step": None,
        "spec": None,
        "plan": _PLAN,
    }
    step = {
        "kind": "step",
        "step": 1,
        "time": 1.0,
        "elapsed_s": 1.0,
        "rss_bytes": 2**28,
        "host_available_bytes": 8 * _GIB,
        "devices": {},
        "phases": [],
    }
    _run(root / "calibrate-cpu-run", [start, step])
    _run(root / "calibrate-no-plan", [dict(start, plan=None), step])
    stats = {"allocated_bytes.all.peak": 2 * _GIB, "reserved_bytes.all.peak": 3 * _GIB}
    for name, files in (
        ("calibrate-stats-no-plan", {"memory_stats.json": stats}),
        ("calibrate-stats-not-stats", {"memory_stats.json": {"num_alloc_retries": 0}, "plan.json": _PLAN}),
        ("calibrate-stats", {"memory_stats.json": stats, "plan.json": _PLAN}),
    ):
        (root / name).mkdir(parents=True, exist_ok=True)
        for file, data in files.items():
            (root / name / file).write_text(json.dumps(data))
