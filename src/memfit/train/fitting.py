"""A run fitted to its card: before loading (``fit: auto``), and again when a step runs out of memory.

- :func:`planned_seq_len`: the longest micro-batch the data actually makes decides the peak, not
  the configured ``seq_len`` when every example is shorter.
- :func:`device_target`: what to fit: ``gpu`` / ``budget`` from the config, or the CUDA device
  itself (its free memory, what other processes hold).
- :func:`fit_configuration`: the search over the knobs the user left open
  (:func:`memfit.planner.fit_run.fit_run`); the chosen configuration, the runner-up and why.
- :func:`step_down`: after an out-of-memory error, the next configuration down at the same effective
  batch and data order (:func:`memfit.planner.fit_run.smaller_configuration`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.planner.fit_run import SEARCHED, describe
from memfit.run_files import RUN_FILE
from memfit.step.batch import DOCUMENTS
from memfit.train.config import TrainConfig
from memfit.train.errors import TrainError
from memfit.units import format_bytes


@dataclass(frozen=True)
class Target:
    """What a run's plans are checked against: a GPU catalog name and / or a budget in bytes."""

    gpu: str | None
    budget: str | None
    context_bytes: int | None  # None: the planner's estimate; 0: already spent (a CUDA device measured)
    description: str


def planned_seq_len(examples: list[dict[str, Any]], batch_size: int, seq_len: int, layout: str, packing: bool) -> int:
    """The ``seq_len`` to plan with: as long as the data's longest micro-batch, at most ``seq_len``.

    Padded rows are as long as the longest example of a micro-batch; one row of documents holds a
    micro-batch's tokens (at most the ``batch_size`` longest examples: planned as ``batch_size``
    examples of their mean length, rounded up); packed rows are full.
    """
    if not examples or packing:
        return seq_len
    lengths = sorted((len(e["input_ids"]) for e in examples), reverse=True)
    if layout == DOCUMENTS:
        top = lengths[:batch_size]
        longest = -(-sum(top) // batch_size)
    else:
        longest = lengths[0]
    return max(1, min(seq_len, longest))


def device_target(config: TrainConfig, device: Any) -> Target:
    """The target of a ``fit: auto`` search: the config's ``gpu`` / ``budget``, else the CUDA device:
    its free memory now (what other processes hold is not available), the CUDA context already
    spent (measured, so the plans add none)."""
    if config.gpu is not None or config.budget is not None:
        shown = ", ".join(x for x in (config.gpu, f"budget {config.budget}" if config.budget else None) if x)
        return Target(config.gpu, config.budget, None, shown)
    if getattr(device, "type", None) != "cuda":
        raise TrainError(
            "fit: auto needs a device to fit: train on a CUDA GPU, or give gpu: NAME or budget: SIZE to plan against "
            "(e.g. --gpu rtx-4090 or --budget 24GiB)."
        )
    import torch

    from memfit.models.gpus import get_gpu

    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    name = torch.cuda.get_device_name(device)
    try:
        catalog = get_gpu(name).name
    except ValueError:
        catalog = None
    others = total_bytes - free_bytes
    description = (f"{name}: {format_bytes(free_bytes)} free of {format_bytes(total_bytes)} "
                   f"({format_bytes(others)} held by this process's CUDA context and other processes)")
    # The free memory is the budget; catalog name only for the runtime figures (cuBLAS workspaces).
    return Target(None if catalog is None else catalog, str(free_bytes), 0, description)


def fit_configuration(config: TrainConfig, model_config: dict[str, Any], seq_len: int, target: Target,
                      console: Any) -> tuple[TrainConfig, dict[str, Any]]:
    """Search the knobs ``fit: auto`` may set; return the config with the chosen ones and the record."""
    from memfit.planner.fit_run import fit_run

    knobs = {**config.spec.knobs(), "seq_len": seq_len}
    console.print(f"fit: searching micro-batch x accumulation, checkpointing and tiling"
                  f"{' and the optimizer' if config.fit_optimizer else ''} on {target.description}", highlight=False)
    result = fit_run(model_config, knobs, gpu=target.gpu, budget=target.budget, context_bytes=target.context_bytes,
                     allow_optimizer=config.fit_optimizer)
    if result is None:
        from memfit.train.preflight import oom_advice

        raise TrainError(
            f"fit: nothing fits {target.description} at an effective batch of {config.batch_size * config.grad_accum} "
            f"and seq_len {seq_len} with method {config.method}. To use less memory: " + "; ".join(oom_advice(knobs))
        )
    chosen = result.knobs()
    console.print(f"fit: chose {describe(chosen)} (plan {format_bytes(result.chosen.device_total_bytes)}): {result.why}",
                  highlight=False)
    record = {**result.to_dict(), "target": target.description, "planned_seq_len": seq_len, "given": {k: config.spec.knobs()[k] for k in SEARCHED}}
    return config.model_copy(update=chosen), record


def step_down(config: TrainConfig, model_config: dict[str, Any], seq_len: int, failed: Any,
              target: Target) -> tuple[TrainConfig, Any, list[str]] | None:
    """The config one step down after an out-of-memory error (``failed``: the plan of the config that
    ran out; None: nothing smaller fits)."""
    from memfit.planner.fit_run import smaller_configuration

    knobs = {**config.spec.knobs(), "seq_len": seq_len}
    found = smaller_configuration(model_config, knobs, failed, gpu=target.gpu, budget=target.budget,
                                  context_bytes=target.context_bytes)
    if found is None:
        return None
    knobs, plan, moves = found
    return config.model_copy(update={k: knobs[k] for k in SEARCHED}), plan, moves


def recorded_knobs(run_dir: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the searched knobs a run in ``run_dir`` was training with, the ones its config gave at the
    start), from its run.json. A resumed run keeps the first (``fit: auto``'s choice and any step down
    since) as long as its config still gives the second, i.e. was not changed on purpose."""
    try:
        record = json.loads((Path(run_dir) / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, None
    if not isinstance(record, dict):
        return None, None

    def knobs(key: str) -> dict[str, Any] | None:
        value = record.get(key)
        return dict(value) if isinstance(value, dict) and set(value) == set(SEARCHED) else None

    return knobs("active_knobs"), knobs("given_knobs")
