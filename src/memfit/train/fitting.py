"""A run fitted to its card, as the run says it: the target, the data's length, ``fit: auto``.

The planning itself is :class:`memfit.planner.search.run.RunPlanner`'s (one model, one Target); this
module holds what only the trainer knows:

- :func:`run_target`: what the run plans against: ``gpu`` / ``budget`` from the config, else the
  CUDA device itself, read once by the policy of :mod:`memfit.planner.target` (the free memory is
  the budget, the CUDA context is spent); a CPU run without either has nothing to plan against.
- :func:`planned_seq_len`: the longest micro-batch the data actually makes decides the peak, not
  the configured ``seq_len`` when every example is shorter.
- :func:`fit_configuration`: ``fit: auto``'s search (:meth:`RunPlanner.fit`), said on the console
  and recorded: the chosen configuration, the runner-up and why.
- :func:`recorded_knobs`: the configuration a resumed run keeps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memfit.planner.search.run import SEARCHED, RunPlanner, describe
from memfit.planner.target import NO_TARGET, Probe, Target, live_target, read_cuda_device, target_from_options
from memfit.run_files import RUN_FILE
from memfit.step.batch import DOCUMENTS
from memfit.step.preference import example_lengths
from memfit.train.config import TrainConfig
from memfit.train.errors import TrainError
from memfit.units import format_bytes


def run_target(config: TrainConfig, device: Any, probe: Probe = read_cuda_device) -> Target:
    """What the run's plans are compared against: the config's ``gpu`` / ``budget`` (on any device:
    this is how a CPU run checks a GPU budget), else a CUDA ``device`` read through ``probe``
    (:func:`memfit.planner.target.live_target`), else nothing (a CPU run: no device memory to check)."""
    if config.gpu is not None or config.budget is not None:
        return target_from_options(config.gpu, config.budget)
    if getattr(device, "type", None) == "cuda":
        return live_target(device.index, probe)
    return NO_TARGET


def planned_seq_len(examples: list[dict[str, Any]], batch_size: int, seq_len: int, layout: str, packing: bool) -> int:
    """The ``seq_len`` to plan with: as long as the data's longest micro-batch, at most ``seq_len``.

    Padded rows are as long as the longest example of a micro-batch; one row of documents holds a
    micro-batch's tokens (at most the ``batch_size`` longest examples: planned as ``batch_size``
    examples of their mean length, rounded up); packed rows are full.
    """
    if not examples or packing:
        return seq_len
    # A preference pair puts two sequences in a micro-batch (its chosen and rejected answers).
    per_example = [example_lengths(e) for e in examples]
    if layout == DOCUMENTS:
        top = sorted((sum(lengths) for lengths in per_example), reverse=True)[:batch_size]
        longest = -(-sum(top) // (batch_size * len(per_example[0])))
    else:
        longest = max(max(lengths) for lengths in per_example)
    return max(1, min(seq_len, longest))


def fit_configuration(
    config: TrainConfig, planner: RunPlanner, seq_len: int, console: Any
) -> tuple[TrainConfig, dict[str, Any]]:
    """Search the knobs ``fit: auto`` may set; return the config with the chosen ones and the record."""
    target = planner.target
    if not target.has_memory:
        raise TrainError(
            "fit: auto needs a device to fit: train on a CUDA GPU, or give gpu: NAME or budget: SIZE to plan against "
            "(e.g. --gpu rtx-4090 or --budget 24GiB)."
        )
    knobs = {**config.spec.knobs(), "seq_len": seq_len}
    console.print(
        f"fit: searching micro-batch x accumulation, checkpointing and tiling"
        f"{' and the optimizer' if config.fit_optimizer else ''} on {target.description}",
        highlight=False,
    )
    result = planner.fit(knobs, allow_optimizer=config.fit_optimizer)
    if result is None:
        from memfit.train.preflight import oom_advice

        raise TrainError(
            f"fit: nothing fits {target.description} at an effective batch of {config.batch_size * config.grad_accum} "
            f"and seq_len {seq_len} with method {config.method}. To use less memory: " + "; ".join(oom_advice(knobs))
        )
    chosen = result.knobs()
    console.print(
        f"fit: chose {describe(chosen)} (plan {format_bytes(result.chosen.device_total_bytes)}): {result.why}",
        highlight=False,
    )
    record = {
        **result.to_dict(),
        "target": target.description,
        "planned_seq_len": seq_len,
        "given": {k: config.spec.knobs()[k] for k in SEARCHED},
    }
    return config.model_copy(update=chosen), record


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
