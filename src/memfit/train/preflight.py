"""Preflight, as the run says it: plan the exact run before loading a single weight, and refuse one that cannot fit.

The check is :meth:`memfit.planner.search.run.RunPlanner.preflight`: the run's model config (overrides
included) and knobs, planned against the run's Target (:func:`memfit.train.fitting.run_target`:
the config's ``budget`` / ``gpu``, else the free memory of the CUDA device). CPU runs without
``gpu`` or ``budget`` plan nothing: there is no device memory to check. A run that does not fit is
refused with the configurations of it that do (the search of ``fit: auto``), then what else to
change; ``force`` trains it anyway.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memfit.errors import EXIT_DOES_NOT_FIT, UserError
from memfit.planner.search.run import SEARCHED, Preflight, RunPlanner
from memfit.spec import default
from memfit.units import format_bytes


class PreflightError(UserError, RuntimeError):
    """The plan says the run does not fit; ``plan`` holds the MemoryPlan, ``reason`` the sentence,
    ``fitting`` the plans of the configurations that fit (fastest first, maybe none)."""

    exit_code = EXIT_DOES_NOT_FIT

    def __init__(self, reason: str, plan: Any, advice: list[str], fitting: list[Any] | None = None):
        self.reason = reason
        self.plan = plan
        self.advice = advice
        self.fitting = list(fitting or [])
        lines = [f"preflight: {reason}"] + [f"  - {line}" for line in fits_advice(self.fitting) + advice]
        super().__init__("\n".join(lines + ["  - or pass --force to train anyway"]))

    def explain(self, console: Any) -> None:
        self.plan.render(console)


def fits_advice(fitting: list[Any]) -> list[str]:
    """One line per configuration that fits, in the config's words, then how to take the fastest (pure)."""
    if not fitting:
        return []
    lines = [
        f"fits ({format_bytes(p.device_total_bytes)} at the peak): " + ", ".join(f"{k}: {p.spec[k]}" for k in SEARCHED)
        for p in fitting
    ]
    return lines + ["or let the run choose the fastest that fits: fit: auto (train --fit)"]


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
    seq_len = int(knobs.get("seq_len", default("seq_len")))
    if seq_len > 512:
        advice.append(f"shorter sequences (seq_len: {seq_len // 2})")
    from memfit.spec import ADAPTER_METHODS

    method = knobs.get("method")
    if method == "full":
        if knobs.get("optimizer") == "adamw":
            advice.append("8-bit optimizer states (optimizer: adamw8bit)")
        advice.append("train adapters instead of every weight (method: lora)")
    elif method in ("lora", "lora-8bit"):
        advice.append("4-bit base weights (method: qlora)")
    if knobs.get("dora"):
        advice.append("plain LoRA, without DoRA's weight norms in every forward (dora: false)")
    if knobs.get("modules_to_save"):
        advice.append(
            "fewer modules trained whole (modules_to_save): each is a full copy with its gradients and optimizer states"
        )
    if method in ADAPTER_METHODS and int(knobs.get("rank", 16)) > 16:
        advice.append("a smaller LoRA rank (rank: 16)")
    advice.append("check the options with `memfit plan` and its --budget")
    return advice


def refusal(preflight: Preflight, knobs: dict[str, Any]) -> PreflightError:
    """The error that stops a run whose plan does not fit (``preflight.refused``)."""
    plan = preflight.plan
    reason = (
        f"this run needs about {format_bytes(plan.device_total_bytes)} of device memory at its peak "
        f"({plan.phase}), more than the {format_bytes(preflight.target_bytes)} of {preflight.target_name}. To make it fit:"
    )
    return PreflightError(reason, plan, oom_advice(knobs), preflight.fitting)


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


def preflight_run(
    config, planner: RunPlanner, console, seq_len: int | None = None, fit_seq_len: int | None = None
) -> Preflight:
    """Preflight of a training config (:meth:`RunPlanner.preflight`), with the plan's one-line summary
    printed (per GPU for several GPUs) and a warning when ``force`` overrides a refusal; raise
    :class:`PreflightError` when the run does not fit and is not forced. The model is checked against
    the config first (:func:`check_model`). ``seq_len``: plan this length (the data's longest
    micro-batch, when shorter than the config's ``seq_len``); ``fit_seq_len``: the length the
    configurations that fit are searched at (the data's longest example)."""
    check_model(config, planner.model)
    knobs = config.knobs() if seq_len is None or seq_len == config.seq_len else {**config.knobs(), "seq_len": seq_len}
    fit_knobs = {**config.knobs(), "seq_len": fit_seq_len} if fit_seq_len is not None else None
    preflight = planner.preflight(knobs, force=config.force, fit_knobs=fit_knobs, allow_optimizer=config.fit_optimizer)
    if preflight.refused:
        raise refusal(preflight, knobs)
    if preflight.plan is not None:
        per = " per GPU" if config.gpus > 1 else ""
        longest = (
            f", the data's longest micro-batch: {seq_len} tokens a sequence"
            if seq_len is not None and seq_len < config.seq_len
            else ""
        )
        console.print(
            f"plan: {format_bytes(preflight.plan.device_total_bytes)} at the peak{per}{longest}, "
            f"{format_bytes(preflight.target_bytes)} available ({preflight.target_name})",
            highlight=False,
        )
    if preflight.forced:
        console.print(
            "[yellow]warning:[/] the plan says this run does not fit; training anyway (force)", highlight=False
        )
    return preflight
