"""Preflight: plan the exact run before loading a single weight, and refuse one that cannot fit.

The plan comes from :func:`memfit.planner.api.plan` with the run's model config (overrides
included) and knobs. What it is compared against:

- ``budget`` from the config, when set (on any device: this is how a CPU run checks a GPU budget);
- else ``gpu`` from the config (a catalog name);
- else, on CUDA, the device itself: its name (for the runtime estimates, when the GPU catalog knows
  it) and its total memory as reported by the driver.

CPU runs without ``gpu`` or ``budget`` skip preflight: there is no device memory to check.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.errors import EXIT_DOES_NOT_FIT, UserError
from memfit.json_form import JsonForm
from memfit.units import format_bytes


class PreflightError(UserError, RuntimeError):
    """The plan says the run does not fit; ``plan`` holds the MemoryPlan, ``reason`` the sentence."""

    exit_code = EXIT_DOES_NOT_FIT

    def __init__(self, reason: str, plan: Any, advice: list[str]):
        self.reason = reason
        self.plan = plan
        self.advice = advice
        lines = [f"preflight: {reason}"] + [f"  - {a}" for a in advice] + ["  - or pass --force to train anyway"]
        super().__init__("\n".join(lines))

    def explain(self, console: Any) -> None:
        self.plan.render(console)


@dataclass
class PreflightResult(JsonForm):
    """The plan of the run and what it was checked against (``target`` None: nothing to check)."""

    plan: Any
    target: str | None
    target_bytes: int | None
    fits: bool | None
    forced: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "target_bytes": self.target_bytes,
            "fits": self.fits,
            "forced": self.forced,
            "plan": self.plan.to_dict() if self.plan is not None else None,
        }


def detect_target(device_type: str, device_index: int | None, gpu: str | None, budget: str | None) -> tuple[str | None, str | None]:
    """The (gpu, budget) to plan against: the config's, or the CUDA device's name and memory."""
    if gpu is not None or budget is not None or device_type != "cuda":
        return gpu, budget
    import torch

    from memfit.models.gpus import get_gpu

    name = torch.cuda.get_device_name(device_index)
    total_bytes = torch.cuda.get_device_properties(device_index).total_memory
    try:
        card = get_gpu(name)
    except ValueError:
        return None, str(total_bytes)  # unknown card: plan against its memory, with default runtime estimates
    # A known card: its catalog memory, or what the driver reports when that is less (a budget can
    # only lower what the card has).
    return card.name, (str(total_bytes) if total_bytes < card.memory_bytes else None)


def oom_advice(knobs: dict[str, Any]) -> list[str]:
    """What to change so that a run uses less device memory, most effective first (pure)."""
    advice = []
    if knobs.get("checkpointing") == "off":
        advice.append("turn activation checkpointing on (checkpointing: on)")
    batch_size = int(knobs.get("batch_size", 1))
    grad_accum = int(knobs.get("grad_accum", 1))
    if batch_size > 1:
        half = batch_size // 2
        advice.append(
            f"halve the micro-batch and double accumulation, same effective batch "
            f"(batch_size: {half}, grad_accum: {grad_accum * batch_size // half})"
        )
    seq_len = int(knobs.get("seq_len", 2048))
    if seq_len > 512:
        advice.append(f"shorter sequences (seq_len: {seq_len // 2})")
    method = knobs.get("method")
    if method == "full":
        if knobs.get("optimizer") == "adamw":
            advice.append("8-bit optimizer states (optimizer: adamw8bit)")
        advice.append("train adapters instead of every weight (method: lora)")
    elif method == "lora":
        advice.append("4-bit base weights (method: qlora)")
    if method in ("lora", "qlora") and int(knobs.get("rank", 16)) > 16:
        advice.append("a smaller LoRA rank (rank: 16)")
    advice.append("check the options with `memfit plan` and its --budget")
    return advice


def run_preflight(
    model_config: dict[str, Any],
    knobs: dict[str, Any],
    *,
    device_type: str,
    device_index: int | None = None,
    gpu: str | None = None,
    budget: str | None = None,
    force: bool = False,
) -> PreflightResult:
    """Plan the run and check it against the target; raise :class:`PreflightError` when it does not
    fit (unless ``force``). On CPU without ``gpu``/``budget`` nothing is planned."""
    gpu, budget = detect_target(device_type, device_index, gpu, budget)
    if gpu is None and budget is None:
        return PreflightResult(plan=None, target=None, target_bytes=None, fits=None)
    from memfit.planner.api import plan

    result = plan(model_config, gpu=gpu, budget=budget, **knobs)
    target_bytes = result.gpu["memory_bytes"] if result.gpu else None
    target = result.gpu["name"] if result.gpu else None
    if result.fits is False and not force:
        reason = (
            f"this run needs about {format_bytes(result.device_total_bytes)} of device memory at its peak "
            f"({result.phase}), more than the {format_bytes(target_bytes)} of {target}. To make it fit:"
        )
        raise PreflightError(reason, result, oom_advice(knobs))
    return PreflightResult(plan=result, target=target, target_bytes=target_bytes, fits=result.fits, forced=bool(force and result.fits is False))


def check_model(config, model_config: dict[str, Any]) -> None:
    """Raise :class:`~memfit.train.config.ConfigError` when the model rules out the config: an
    architecture transformers cannot build, a ``seq_len`` beyond its positions, LoRA ``targets``
    that name none of its layers. Cheap (one decoder layer on ``meta``), so it runs before the data
    is read and any weight is loaded; a Hub model's config is first known here."""
    from memfit.planner.inputs import targets_problem
    from memfit.train.config import ConfigError, model_problems

    problems = model_problems(Path(config.model).name, model_config, config.seq_len)
    if not problems:
        targets = targets_problem(model_config, config.spec, spelling="field")
        problems = [targets] if targets else []
    if problems:
        raise ConfigError(problems)


def preflight_run(config, model_config: dict[str, Any], device, console, seq_len: int | None = None) -> PreflightResult:
    """:func:`run_preflight` for a training config on ``device``, with the plan's one-line summary
    printed (per GPU for several GPUs) and a warning when ``force`` overrides a refusal. The model is
    checked against the config first (:func:`check_model`). ``seq_len``: plan this length (the data's
    longest micro-batch, when shorter than the config's ``seq_len``)."""
    check_model(config, model_config)
    knobs = config.knobs() if seq_len is None or seq_len == config.seq_len else {**config.knobs(), "seq_len": seq_len}
    preflight = run_preflight(
        model_config, knobs, device_type=device.type, device_index=device.index,
        gpu=config.gpu, budget=config.budget, force=config.force,
    )
    if preflight.plan is not None:
        per = " per GPU" if config.gpus > 1 else ""
        longest = f", the data's longest micro-batch: {seq_len} tokens a sequence" if seq_len is not None and seq_len < config.seq_len else ""
        console.print(
            f"plan: {format_bytes(preflight.plan.device_total_bytes)} at the peak{per}{longest}, "
            f"{format_bytes(preflight.target_bytes)} available ({preflight.target})", highlight=False,
        )
    if preflight.forced:
        console.print("[yellow]warning:[/] the plan says this run does not fit; training anyway (force)", highlight=False)
    return preflight
