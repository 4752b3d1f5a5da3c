"""Builders for synthetic memory timelines (the records memfit's recorder writes)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

MiB = 2**20
GiB = 2**30


def start_record(expected=("cpu",), total_steps=None, plan=None, capacity=None, **more) -> dict[str, Any]:
    return {
        "kind": "start",
        "schema": 1,
        "time": 0.0,
        "source": "test",
        "expected_devices": list(expected),
        "cuda_devices": list(capacity or {}),
        "device_capacity_bytes": dict(capacity or {}),
        "host_total_bytes": 16 * GiB,
        "rss_bytes": 400 * MiB,
        "total_steps": total_steps,
        "resumed_from_step": None,
        "spec": None,
        "plan": plan,
        **more,
    }


def step_records(
    n: int,
    rss: Callable[[int], int] | None = None,
    devices: Callable[[int], dict] | None = None,
    available: int = 8 * GiB,
    loss: Callable[[int], float] | None = None,
) -> list[dict[str, Any]]:
    """``n`` step records; ``rss(step)`` and ``devices(step)`` give the readings."""
    records = []
    for step in range(1, n + 1):
        record = {
            "kind": "step",
            "step": step,
            "time": float(step),
            "elapsed_s": float(step),
            "rss_bytes": rss(step) if rss else 400 * MiB,
            "host_available_bytes": available,
            "devices": devices(step) if devices else {},
            "phases": [],
        }
        if loss:
            record["extra"] = {"loss": loss(step)}
        records.append(record)
    return records


def write_run(run_dir: Path, records: list[dict[str, Any]], metrics: list[dict[str, Any]] | None = None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "memory.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if metrics is not None:
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    return run_dir


def tiny_plan(activations=20 * MiB, allocated=2 * GiB, checkpointing="on") -> dict[str, Any]:
    """A plan JSON shaped like MemoryPlan.to_dict() (figures chosen by the test)."""
    cats = {
        "weights": allocated // 2,
        "trainable": 64 * MiB,
        "gradients": 64 * MiB,
        "optimizer": 128 * MiB,
        "activations": activations,
        "temporaries": 32 * MiB,
        "allocator": 100 * MiB,
        "runtime": 500 * MiB,
    }
    return {
        "model": "tiny",
        "spec": {"method": "lora", "checkpointing": checkpointing, "batch_size": 1, "seq_len": 2048},
        "peak": {
            "allocated_bytes": allocated,
            "reserved_bytes": allocated + 100 * MiB,
            "device_total_bytes": allocated + 600 * MiB,
            "phase": "backward",
        },
        "categories": cats,
        "gpu": None,
        "fits": None,
        "headroom_bytes": None,
        "details": {},
    }


def checkpointing_off(inner):
    """Wrap ``inner`` in a module that "helpfully" turns its activation checkpointing off, as some
    wrappers do (transformers 5 name first, 4.x name otherwise)."""
    import torch

    class CheckpointingOff(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
            self.inner = model

        def forward(self, **kwargs):
            return self.inner(**kwargs)

    return CheckpointingOff(inner)
