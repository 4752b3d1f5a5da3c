"""``memfit.planner``: the peak GPU memory of a fine-tuning run, before it runs.

The steps, each in its own module:

1. resolve the model argument and validate every knob (:mod:`memfit.spec`), the GPU and the budget,
   all problems at once and without importing torch or transformers; then the checks that need the
   model's architecture;
2. simulate the real training step under fake tensors (:mod:`memfit.planner.simulate`) for a few
   whole periods of decoder layers, and extrapolate linearly to the full depth (memory per decoder
   layer is the same for every layer of a period, so this is exact up to rounding; a test checks
   it against the full simulation);
3. replay the recorded allocations through the CUDA caching-allocator model
   (:mod:`memfit.planner.allocator`) to get reserved memory;
4. add the runtime (CUDA context, cuBLAS workspaces: :mod:`memfit.planner.runtime`) and compare with
   the GPU or budget.
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

from memfit.models.catalog import (
    ModelSource,
    model_type_problem,
    resolve_model,
    seq_len_problem,
)
from memfit.planner import allocator
from memfit.planner.report import MemoryPlan, adapter_notes, category_help
from memfit.planner.runtime import runtime_overhead
from memfit.spec import RunSpec, SpecError, make_spec
from memfit.units import format_bytes, parse_bytes

_KERNEL_NOTES = {
    "flash": "flash kernel, no [seq x seq] attention matrix kept",
    "memory-efficient": "memory-efficient kernel, no [seq x seq] attention matrix kept (a padding mask is a [batch x 1 x seq x seq] bias)",
    "math": "math kernel: the [batch x heads x seq x seq] scores are materialised and their softmax kept for backward",
}


def _attention_note(estimate: dict[str, Any]) -> str:
    """How the plan's attention runs on CUDA, in one line (``attention:`` in the plan)."""
    implementation = estimate["attention"]
    if implementation == "memfit_documents":
        return ("memfit: each micro-batch's examples in one row, attention inside each example (CUDA's variable-length "
                "flash kernel; example by example with the memory-efficient kernel in fp32 or without flash), no padding, "
                "no [seq x seq] tensor")
    if implementation == "eager":
        return "eager: this architecture has no SDPA path, the [batch x heads x seq x seq] attention matrix is materialised"
    kernels = [k for k in ("math", "memory-efficient", "flash") if k in estimate["attention_kernels"]]
    return f"{implementation}: " + ("; ".join(_KERNEL_NOTES[k] for k in kernels) if kernels else "no attention in the step")


def _reference_note(spec: RunSpec, categories: dict[str, int], phase_peaks: dict[str, int]) -> str:
    """Where a preference plan's reference log-probs come from, and what that costs, in one line."""
    source = spec.reference
    if source == "none":
        return f"none: {spec.objective} needs no reference model"
    if source == "precomputed":
        return ("precomputed: one forward of every pair under no_grad before training (before the optimizer exists), "
                "kept in the run folder; the step reads them and runs no reference pass")
    where = ("the base model with its LoRA adapters disabled (PEFT disable_adapter()): no second copy"
             if source == "disabled-adapters" else
             f"a frozen copy of the starting weights, in weights ({format_bytes(categories.get('weights', 0))} with the buffers)")
    if spec.recipe == "hf":
        return f"{where}; its pass runs under no_grad after the policy's forward, on top of the activations the policy holds"
    top = phase_peaks.get("reference")
    shown = f" (live memory at most {format_bytes(top)} during it)" if top else ""
    return f"{where}; its pass runs under no_grad before the policy's forward{shown}, keeping nothing but the log-probs"


class PlanError(SpecError):
    """Bad input for a plan (model, knobs, GPU or budget); every problem is listed."""

    heading = "cannot plan this run"

    def __init__(self, problems: list[str], heading: str | None = None):
        if heading is not None:
            self.heading = heading
        super().__init__(problems)


@dataclass(frozen=True)
class _Target:
    """What the plan is compared against: a named GPU and/or a memory budget."""

    name: str | None
    memory_bytes: int | None
    arch: str | None
    supports_bf16: bool | None
    card: str | None = None  # the GPU catalog name, when a GPU was given


def plan(
    model: str | dict,
    *,
    revision: str | None = None,
    gpu: str | None = None,
    budget: str | int | None = None,
    context_bytes: int | None = None,
    cublas_workspace_bytes: int | None = None,
    extrapolate: bool = True,
    cache: bool = True,
    deepspeed: Any = None,
    **knobs: Any,
) -> MemoryPlan:
    """Predict the peak GPU memory of one training step of ``model`` configured by ``knobs``.

    Args:
        model: a catalog name (``memfit models``), a Hugging Face Hub id (``org/name``: its
            config.json alone is fetched), a path to a config.json, a model folder, or a config dict;
            or another tool's training config (an Axolotl or LLaMA-Factory YAML, a TRL /
            TrainingArguments YAML or JSON: :mod:`memfit.interop`), planned as that tool runs it,
            with ``knobs`` given here in place of the config's.
        revision: branch, tag or commit of a Hub id (default: main).
        gpu: a GPU catalog name (``rtx-4090``, ``a100-80gb``...) to check the plan against.
        budget: a memory budget instead of (or overriding the memory of) ``gpu``: ``"24GiB"``,
            ``"80GB"`` or a number of bytes.
        context_bytes, cublas_workspace_bytes: override the runtime estimates (see
            :mod:`memfit.planner.runtime`).
        extrapolate: simulate a few layers and extrapolate (fast); False simulates every layer.
        cache: read and keep the plan in the on-disk plan cache (:mod:`memfit.planner.cache`; also
            off with ``MEMFIT_PLAN_CACHE=0``). A plan from the cache is the plan this call would
            make, byte for byte, but for ``details.plan_seconds``.
        deepspeed: a DeepSpeed config's settings (:class:`memfit.interop.deepspeed.ZeroSettings`):
            with ``gpus`` > 1 and a ZeRO ``shard``, each rank is planned with DeepSpeed's buffers.
        **knobs: the :class:`~memfit.spec.RunSpec` fields: method, rank, alpha, dropout, targets,
            precision, optimizer, batch_size, seq_len, grad_accum, checkpointing, gpus, shard.

    Raises:
        PlanError: listing every problem with the input, before any simulation runs.
    """
    from memfit.interop import is_tool_config

    if is_tool_config(model):
        return _plan_tool_config(str(model), revision=revision, gpu=gpu, budget=budget, context_bytes=context_bytes,
                                 cublas_workspace_bytes=cublas_workspace_bytes, extrapolate=extrapolate, cache=cache, **knobs)
    started = time.perf_counter()
    resolved = _resolve(model, revision=revision, gpu=gpu, budget=budget, **knobs)
    key = None
    if cache and not resolved.has_problems:
        # Looked up before the checks that need transformers and torch: an entry exists only for
        # inputs that passed them (with the same code and libraries, which are in the key), so a
        # plan from the cache needs neither.
        key = _plan_key(resolved, context_bytes=context_bytes, cublas_workspace_bytes=cublas_workspace_bytes,
                        extrapolate=extrapolate, deepspeed=deepspeed.to_dict() if deepspeed is not None else None)
        cached = _cached_plan(key, resolved.spec, started)
        if cached is not None:
            return cached
    source, spec, target = _checked(resolved, cache=cache)
    runtime = runtime_overhead(target.arch, context_bytes=context_bytes, cublas_workspace_bytes=cublas_workspace_bytes)
    layout = reshape = zero = None
    if spec.gpus > 1:
        from functools import partial

        from memfit.planner import sharding

        # One simulation of one rank's step (the same for every N and mode: it is cached); the
        # sharding arithmetic then decides what each rank holds at every candidate moment.
        layout = param_layout(source.config, spec)
        zero = _zero_plan(deepspeed, source.config, spec, layout)
        reshape = partial(sharding.per_rank_categories, shard=spec.shard, gpus=spec.gpus, layout=layout, zero=zero)
    estimate = estimate_step(source.config, spec, runtime.cublas_workspace_allocs, extrapolate=extrapolate, reshape=reshape,
                             arch=target.arch)
    if layout is not None and estimate["paged_peak_bytes"]:
        from memfit.planner import sharding

        # Paged optimizer states are optimizer states: sharded as the mode shards those.
        ratio = sharding.state_ratios(spec.shard, spec.gpus, layout, zero)["optimizer"]
        estimate["paged_peak_bytes"] = int(math.ceil(estimate["paged_peak_bytes"] * ratio))

    categories = dict(estimate["categories"])
    tracked_runtime = categories.pop("runtime", 0)
    allocated = estimate["allocated_bytes"]
    reserved = max(estimate["reserved_bytes"], allocated)
    device_total = reserved + runtime.context_bytes
    categories["allocator"] = reserved - allocated
    categories["runtime"] = tracked_runtime + runtime.context_bytes

    gpu_json = fits = headroom = None
    if target.memory_bytes is not None:
        gpu_json = {"name": target.name or "budget", "memory_bytes": target.memory_bytes}
        headroom = target.memory_bytes - device_total
        fits = headroom >= 0
    notes = ([source.note] if source.note else []) + list(runtime.notes)
    paged = estimate["paged_peak_bytes"]
    if paged and headroom is not None and paged > headroom:
        notes.append(
            f"paged optimizer states ({format_bytes(paged)}) do not fit beside the peak ({format_bytes(max(headroom, 0))} free): "
            "bitsandbytes will page them to host memory and back every step (slow); memfit fit counts them against the headroom"
        )
    if "math" in estimate["attention_kernels"]:
        notes.append(_math_attention_note(source.config, spec))
    if target.supports_bf16 is False and spec.precision in ("bf16", "bf16-mixed"):
        notes.append(f"{target.card or target.name} has no bf16 support: use --precision fp16 (LoRA/QLoRA), fp16-mixed or fp32")
    details = {
        "total_params": estimate["total_params"],
        "trainable_params": estimate["trainable_params"],
        "host_peak_bytes": estimate["host_peak_bytes"],
        "paged_peak_bytes": estimate["paged_peak_bytes"],
        "phase_peaks_allocated_bytes": estimate["phase_peaks"],
        "simulated_layers": estimate["simulated_layers"],
        "num_layers": estimate["num_layers"],
        "context_bytes": runtime.context_bytes,
        "cublas_workspace_bytes": runtime.cublas_workspace_bytes,
        "attention": _attention_note(estimate),
        "attention_kernels": list(estimate["attention_kernels"]),
        "batch_layout": estimate["batch_layout"],
        "input_embeddings": "host" if estimate["embeddings_on_host"] else "device",
        "precision_regime": spec.precision_regime,
        "adapters": _adapter_details(spec, estimate["trained_copies"]) if spec.uses_adapters else None,
        "notes": notes,
    }
    if spec.is_preference:
        details["objective"] = spec.objective
        details["reference"] = _reference_note(spec, categories, estimate["phase_peaks"])
    details["category_help"] = category_help(spec.knobs(), details["adapters"])
    notes.extend(adapter_notes(spec.knobs(), details["adapters"]))
    if layout is not None:
        _add_per_rank_details(details, spec, layout, estimate, zero)
    if source.hub:
        details["hub"] = dict(source.hub)  # repo, revision and the commit whose config.json was planned
    details["plan_seconds"] = round(time.perf_counter() - started, 3)
    result = MemoryPlan(
        model=source.name,
        spec=spec.knobs(),
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        device_total_bytes=device_total,
        phase=estimate["phase"],
        categories=categories,
        gpu=gpu_json,
        fits=fits,
        headroom_bytes=headroom,
        details=details,
    )
    if key is not None:
        _keep_plan(key, result)
    return result


#: The fields of a MemoryPlan the cache keeps (``spec`` is rebuilt from the RunSpec: it holds tuples).
_CACHED_FIELDS = ("model", "allocated_bytes", "reserved_bytes", "device_total_bytes", "phase", "categories", "gpu", "fits",
                  "headroom_bytes", "details")


def _plan_key(resolved: _Resolved, **options: Any) -> str | None:
    """The plan cache's key for these inputs: everything a plan depends on (the environment is added
    by :func:`memfit.planner.cache.make_key`)."""
    from memfit.planner import cache as plan_cache

    if not plan_cache.enabled():
        return None
    source, target = resolved.source, resolved.target
    inputs = {
        "model": {"name": source.name, "config": source.config, "note": source.note, "hub": source.hub},
        "spec": resolved.spec.model_dump(mode="json"),
        "target": {"name": target.name, "memory_bytes": target.memory_bytes, "arch": target.arch,
                   "supports_bf16": target.supports_bf16, "card": target.card},
        **options,
    }
    return plan_cache.make_key("plan", inputs)


def _cached_plan(key: str | None, spec: RunSpec, started: float) -> MemoryPlan | None:
    """The plan stored under ``key``, with this call's ``plan_seconds``; None on a miss."""
    from memfit.planner import cache as plan_cache

    stored = plan_cache.load("plan", key)
    if not isinstance(stored, dict) or set(stored) != set(_CACHED_FIELDS):
        return None
    details = dict(stored["details"], plan_seconds=round(time.perf_counter() - started, 3))
    return MemoryPlan(spec=spec.knobs(), **dict(stored, details=details))


def _keep_plan(key: str, result: MemoryPlan) -> None:
    """Store ``result`` under ``key`` (the time it took left out: it is the new call's own)."""
    from memfit.planner import cache as plan_cache

    value = {name: getattr(result, name) for name in _CACHED_FIELDS}
    value["details"] = {k: v for k, v in result.details.items() if k != "plan_seconds"}
    plan_cache.store("plan", key, value)


@dataclass
class _Resolved:
    """The model, knobs and target resolved without transformers or torch, with the problems found so far."""

    knobs: dict[str, Any]
    source: ModelSource | None
    spec: RunSpec | None
    target: _Target
    source_problems: list[str]
    spec_problems: list[str]
    target_problems: list[str]

    @property
    def has_problems(self) -> bool:
        return bool(self.source_problems or self.spec_problems or self.target_problems)


def validate(model: str | dict, *, revision: str | None = None, gpu: str | None = None, budget: str | int | None = None,
             **knobs: Any) -> tuple[ModelSource, RunSpec, _Target]:
    """Check the model, every knob, the GPU and the budget; raise one PlanError listing all problems
    (those found without transformers first, on their own: see :func:`_checked`)."""
    return _checked(_resolve(model, revision=revision, gpu=gpu, budget=budget, **knobs))


def quick_problems(model: str | dict, *, revision: str | None = None, gpu: str | None = None,
                   budget: str | int | None = None, **knobs: Any) -> list[str]:
    """The problems :func:`validate` finds without importing transformers or torch: the model
    argument, each knob alone and together, the GPU, the budget (a fraction of a second)."""
    resolved = _resolve(model, revision=revision, gpu=gpu, budget=budget, **knobs)
    return resolved.source_problems + resolved.spec_problems + resolved.target_problems


def _resolve(model: str | dict, *, revision: str | None = None, gpu: str | None = None, budget: str | int | None = None,
             **knobs: Any) -> _Resolved:
    """The cheap half of :func:`validate`: resolve the model (its config), the knobs, the GPU and the
    budget, and collect what is wrong with each alone. Imports neither transformers nor torch."""
    source = spec = None
    source_problems: list[str] = []
    spec_problems: list[str] = []
    target_problems: list[str] = []
    try:
        source = resolve_model(model, revision=revision)
    except ValueError as err:
        source_problems.append(f"model: {err}")
    try:
        spec = make_spec(**knobs)
    except SpecError as err:
        spec_problems.extend(err.problems)

    target = _Target(None, None, None, None)
    if gpu is not None:
        from memfit.models.gpus import get_gpu

        try:
            card = get_gpu(gpu)
            target = _Target(card.name, card.memory_bytes, card.arch, card.supports_bf16, card.name)
        except ValueError as err:
            target_problems.append(f"--gpu: {err}")
    if budget is not None:
        try:
            budget_bytes = parse_bytes(budget)
            if budget_bytes <= 0:
                raise ValueError(f"{budget!r} must be more than 0 bytes (e.g. '24GiB')")
            if target.memory_bytes is not None and budget_bytes > target.memory_bytes:
                # A budget lowers what the card offers (room kept for something else); it cannot add memory.
                raise ValueError(
                    f"{budget} is more than {target.name}'s {format_bytes(target.memory_bytes)}: a budget can only be "
                    f"lower than the card's memory. Drop --budget, or use a larger --gpu."
                )
            name = f"{target.name}, budget {budget}" if target.name else f"budget {budget}"
            target = _Target(name, budget_bytes, target.arch, target.supports_bf16, target.card)
        except ValueError as err:
            target_problems.append(f"--budget: {err}")
    return _Resolved(knobs, source, spec, target, source_problems, spec_problems, target_problems)


def _checked(resolved: _Resolved, cache: bool = True) -> tuple[ModelSource, RunSpec, _Target]:
    """The other half of :func:`validate`: the checks that need the model's architecture (transformers)
    and the knobs together; raise one PlanError listing every problem.

    What the cheap half found (the model argument, a knob, the GPU, the budget) is raised first, on
    its own, before transformers or torch is imported: those mistakes are reported in a fraction of
    a second, and the checks that need the model's architecture run once they are fixed.

    Inputs that passed are remembered in the plan cache (``cache``): the checks depend on nothing but
    the model's config, the knobs and the code (all in the key), so the next time the same inputs
    pass without importing transformers.
    """
    if resolved.has_problems:
        raise PlanError(resolved.source_problems + resolved.spec_problems + resolved.target_problems)
    from memfit.planner import cache as plan_cache

    key = _validation_key(resolved) if cache else None
    if key is not None and plan_cache.load("validated", key) is True:
        return resolved.source, resolved.spec, resolved.target
    source, spec = resolved.source, resolved.spec
    problem = model_type_problem(source.config)
    # Nothing more can be checked against a model transformers cannot build.
    problems = [f"model: {problem}"] if problem else _model_problems(source, spec)
    if problems:
        raise PlanError(problems)
    if key is not None:
        plan_cache.store("validated", key, True)
    return source, spec, resolved.target


def _validation_key(resolved: _Resolved) -> str | None:
    """The cache key of what :func:`_checked` checks (None when a cheap check failed already)."""
    from memfit.planner import cache as plan_cache

    if resolved.has_problems or not plan_cache.enabled():
        return None
    return plan_cache.make_key("validated", {"model": {"name": resolved.source.name, "config": resolved.source.config},
                                             "spec": resolved.spec.model_dump(mode="json")})


def validation_state(model: str | dict, *, revision: str | None = None, gpu: str | None = None,
                     budget: str | int | None = None, **knobs: Any) -> str:
    """What is known of these inputs without importing transformers: ``"problems"`` (a check that
    needs no model failed: :func:`validate` will say which), ``"validated"`` (they passed
    :func:`validate` before, with this code and these libraries: the plan cache remembers it, and
    the plans to come may be there too), or ``"unknown"``."""
    from pathlib import Path

    from memfit.planner import cache as plan_cache

    if isinstance(model, str) and "/" in model and not Path(model).expanduser().exists():
        return "unknown"  # a Hub id: resolving it asks the Hub, which validate() is about to do anyway
    resolved = _resolve(model, revision=revision, gpu=gpu, budget=budget, **knobs)
    if resolved.has_problems:
        return "problems"
    key = _validation_key(resolved)
    return "validated" if key is not None and plan_cache.load("validated", key) is True else "unknown"


def _model_problems(source: ModelSource, spec: RunSpec) -> list[str]:
    """Problems that need both the model and the knobs (cheap: the config only, no model build)."""
    from memfit.models.build import make_config
    from memfit.step.attention import batch_layout

    problems = []
    try:
        batch_layout(spec, make_config(source.config))  # packing needs attention kept inside each example
    except ValueError as err:
        problems.append(str(err))
    too_long = seq_len_problem(source.name, source.config, spec.seq_len)
    if too_long:
        problems.append(too_long)
    targets = targets_problem(source.config, spec)
    if targets:
        problems.append(targets)
    if spec.base_bits is not None or spec.optimizer in ("adamw8bit", "paged-adamw8bit"):
        import importlib.util

        if importlib.util.find_spec("bitsandbytes") is None:
            what = f"--method {spec.method}" if spec.base_bits is not None else f"--optimizer {spec.optimizer}"
            problems.append(f"{what} needs bitsandbytes, which is not installed: pip install 'memfit[qlora]'")
    if spec.gpus > 1:
        from memfit.planner.sharding import mode_problems

        problems.extend(mode_problems(spec.shard, spec.gpus, spec.optimizer))
    return problems


def targets_problem(config: dict[str, Any], spec: RunSpec, spelling: str = "flag") -> str | None:
    """Why LoRA ``targets`` or ``modules_to_save`` cannot apply to the model (a target that matches no
    linear layer of its decoder, a module to save that matches no module or that LoRA adapts), or
    None. One decoder layer is built on ``meta`` (no memory) and asked, as the trainer's
    :func:`memfit.step.prepare.check_targets` and :func:`~memfit.step.prepare.check_modules_to_save`
    ask the real model; ``spelling`` as for :func:`memfit.spec.make_spec`."""
    from memfit.spec import ALL_LINEAR

    if not spec.uses_adapters or (spec.targets == (ALL_LINEAR,) and not spec.modules_to_save):
        return None
    from memfit.models.build import DTYPES, build_meta_model, make_config
    from memfit.models.errors import ModelBuildError
    from memfit.planner.simulate import _quiet
    from memfit.step.prepare import check_modules_to_save, check_targets

    try:
        with _quiet():
            model = build_meta_model(make_config(config, num_layers=1), DTYPES[spec.weight_precision])
    except ModelBuildError as err:
        return str(err)
    problems = []
    for check in (check_targets, check_modules_to_save):
        try:
            check(model, spec, spelling)
        except ModelBuildError as err:
            problems.append(str(err))
    return "; ".join(problems) or None


def _adapter_details(spec: RunSpec, copies: list[dict]) -> dict[str, Any]:
    """What the adapters of a plan are (``details.adapters``): DoRA, rsLoRA and the scale it gives,
    the base they sit on, the modules trained whole and the copies PEFT makes of them (tied modules
    share one copy: they are listed together)."""
    groups = sorted({tuple(sorted(name.rsplit(".", 1)[-1] for name in copy["modules"])) for copy in copies})
    return {
        "dora": spec.dora,
        "rslora": spec.rslora,
        "scale": spec.lora_scale,
        "base": {4: "nf4", 8: "int8"}.get(spec.base_bits, spec.weight_precision),
        "modules_to_save": list(spec.modules_to_save),
        "trained_copies": [list(group) for group in groups],
    }


def _add_per_rank_details(details: dict[str, Any], spec: RunSpec, layout, estimate: dict[str, Any], zero=None) -> None:
    """What a multi-GPU plan adds: it is per rank, the mode planned, model states before and after,
    and DeepSpeed's buffers by name where a DeepSpeed config shards the run."""
    from memfit.planner import sharding

    shard = sharding.effective_shard(spec.shard, spec.gpus)
    states = sharding.model_state_bytes(estimate["single_gpu_categories"], shard=shard, gpus=spec.gpus, layout=layout, zero=zero)
    details["per_rank"] = True
    details["shard"] = shard
    details["model_state_bytes"] = states
    details["gathered_layer_bytes"] = layout.layer_param_bytes
    details["root_param_bytes"] = layout.root_param_bytes
    details["nccl_runtime_bytes"] = sharding.NCCL_RUNTIME_BYTES
    details["host_peak_bytes"] += states["per_rank_host_bytes"]
    if spec.shard == "none":
        details["notes"].append(f"--gpus {spec.gpus} with --shard none is plain data parallel: planned as ddp")
    if zero is not None:
        details["deepspeed"] = zero.to_dict()
        details["notes"].append(
            f"DeepSpeed ZeRO stage {zero.settings.stage} ({zero.settings.path}): its buffers per GPU are in the plan by name "
            "(details.deepspeed); weights gathered a decoder layer at a time (DeepSpeed fetches module by module)"
        )
    elif shard == "zero3":
        details["notes"].append("zero3 is planned as fsdp (FSDP2, one decoder layer gathered at a time, next one prefetched)")
    details["notes"].append(
        f"per GPU, each of {spec.gpus} ranks; NCCL buffers ({sharding.NCCL_RUNTIME_BYTES // 2**20} MiB in runtime) are an estimate"
    )


def _zero_plan(settings: Any, config: dict[str, Any], spec: RunSpec, layout):
    """DeepSpeed's buffers for one rank (:mod:`memfit.planner.zero`), or None where the run is not
    sharded by a DeepSpeed config."""
    from memfit.planner.sharding import effective_shard
    from memfit.planner.zero import ZeroPlan, uses_zero, zero_terms

    if not uses_zero(settings, effective_shard(spec.shard, spec.gpus)):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    hidden_size = int(config.get("hidden_size") or text.get("hidden_size") or 0)
    num_layers = int(config.get("num_hidden_layers") or text.get("num_hidden_layers") or 1)
    resolved = settings.resolved(hidden_size)
    sixteen = {True: True, False: False}.get(resolved.bf16 or resolved.fp16, spec.precision != "fp32")
    itemsize = 2 if sixteen else 4
    trainable_itemsize = 4 if spec.uses_adapters or spec.precision == "fp32" else 2
    terms = zero_terms(resolved, gpus=spec.gpus, layout=layout, num_layers=num_layers, itemsize=itemsize,
                       trainable_itemsize=trainable_itemsize)
    return ZeroPlan(resolved, tuple(terms))


def _plan_tool_config(path: str, *, revision: str | None = None, **options: Any) -> MemoryPlan:
    """:func:`plan` of another tool's config (:func:`memfit.interop.read_tool_config`): its model and
    knobs, the options given here in place of the config's, its DeepSpeed settings where they shard
    the run; the plan says what was read and what is not modelled (``details.config``)."""
    from memfit.interop import read_tool_config

    plan_options = {k: options.pop(k) for k in ("gpu", "budget", "context_bytes", "cublas_workspace_bytes", "extrapolate", "cache")}
    tool = read_tool_config(path)
    knobs, dropped = tool.knobs_for(options)
    deepspeed = tool.zero if tool.zero is not None and knobs.get("shard") == tool.shard else None
    result = plan(tool.model, revision=revision or tool.revision, deepspeed=deepspeed, **plan_options, **knobs)
    config = tool.to_dict(given=options)
    config["not_modelled"] += [f.to_dict() for f in dropped]
    result.details = dict(result.details, config=config)
    return result


def estimate_step(
    config: dict[str, Any],
    spec: RunSpec,
    workspace_allocs: tuple[int, ...] = (),
    *,
    extrapolate: bool = True,
    reshape: Reshape | None = None,
    arch: str | None = None,
) -> dict[str, Any]:
    """Simulate (and extrapolate) the step; return peaks, categories and counts for the full model.

    ``reshape`` maps the single-GPU categories at a moment of a phase to one rank's categories
    (:func:`memfit.planner.sharding.per_rank_categories`); the peak is then the highest moment after
    reshaping (sharding can move it, e.g. from the end of backward to its start), and
    ``single_gpu_categories`` holds the unreshaped categories at the single-GPU peak. The
    simulation itself is that of one GPU, whatever ``gpus`` and ``shard`` are: it is shared.
    """
    from memfit.models.build import layer_period, make_config

    if spec.gpus != 1 or spec.shard != "none":
        # One rank's step, the same for every count and mode (so it is simulated once). gpus stays
        # above 1 because placement differs there: under FSDP the input embeddings stay on the
        # device, in the root group, where one GPU keeps a frozen table in host memory.
        spec = spec.model_copy(update={"gpus": 2, "shard": "none"})
    full_config = make_config(config)
    num_layers = int(full_config.num_hidden_layers)
    period = layer_period(full_config)
    layers = sample_layer_counts(num_layers, period) if extrapolate else None
    points = [_sample(config, spec, k, workspace_allocs, arch) for k in (layers or (None,))]
    if layers is not None and len(points[0]["result"].segments()) != len(points[1]["result"].segments()):
        layers, points = None, [_sample(config, spec, None, workspace_allocs, arch)]  # no common structure
    if layers is None:
        values = dict(points[0])
        peak_phase = points[0]["phase"]
        phases = dict(points[0]["phase_peaks"])
        single = dict(values["categories"])
        if reshape is not None:
            overhead = values["reserved_bytes"] - values["allocated_bytes"]
            peak_phase, values["categories"], phases = _reshaped_peak(points[0]["result"], reshape)
            values["allocated_bytes"] = sum(values["categories"].values())
            values["reserved_bytes"] = values["allocated_bytes"] + overhead
    else:
        values = {key: extrapolate_linear(layers, [p[key] for p in points], num_layers) for key in _SCALARS}
        peak_phase, values["categories"] = _extrapolate_peak(layers, points, num_layers)
        single = dict(values["categories"])
        values["allocated_bytes"] = sum(values["categories"].values())
        # Fragmentation does not grow linearly with depth (it jumps with how blocks happen to fit in
        # segments), so the allocator's overhead is not extrapolated: the larger of the sampled
        # overheads is added to the extrapolated allocated peak.
        overhead = max(p["reserved_bytes"] - p["allocated_bytes"] for p in points)
        phases = {k: extrapolate_linear(layers, [p["phase_peaks"].get(k, 0) for p in points], num_layers)
                  for k in points[-1]["phase_peaks"]}
        if reshape is not None:
            # One rank's fragmentation is taken to be the single GPU's (an assumption: sharded
            # states are smaller blocks, so this errs high).
            peak_phase, values["categories"], phases = _extrapolate_peak(layers, points, num_layers, reshape)
            values["allocated_bytes"] = sum(values["categories"].values())
        values["reserved_bytes"] = values["allocated_bytes"] + overhead
    return {
        "allocated_bytes": values["allocated_bytes"],
        "reserved_bytes": values["reserved_bytes"],
        "host_peak_bytes": values["host_peak_bytes"],
        "paged_peak_bytes": values["paged_peak_bytes"],
        "categories": values["categories"],
        "phase": peak_phase,
        "phase_peaks": phases,
        "total_params": values["total_params"],
        "trainable_params": values["trainable_params"],
        "simulated_layers": list(layers) if layers else [num_layers],
        "attention": points[-1]["attention"],
        "attention_kernels": points[-1]["attention_kernels"],
        "batch_layout": points[-1]["batch_layout"],
        "embeddings_on_host": points[-1]["embeddings_on_host"],
        "trained_copies": points[-1]["trained_copies"],
        "num_layers": num_layers,
        "single_gpu_categories": single,
    }


def _extrapolate_peak(layers: tuple[int, int], points: list[dict[str, Any]], num_layers: int, reshape: Reshape | None = None):
    """Peak phase and categories at the peak of the full-depth step, from two sampled depths.

    Where the peak lies can move with depth: in full fine-tuning the start of backward (logits,
    every layer's activations) is highest for a few layers, the end of backward (every gradient)
    for many. So the peak is not extrapolated as one number. Each phase of the deeper sample is
    the shallower one with a period of layers inserted: the events both share at the phase's start
    (the head) and at its end (the tail) are the same operations, shifted by memory that grows
    linearly with depth. Memory moves by the same amount from layer to layer, so within a phase
    the highest point is in its head or its tail; both are extrapolated, and the highest is the peak.

    With ``reshape`` (one rank of a multi-GPU run) the moments are weighed by one rank's bytes, and
    the return value also holds the highest reshaped total of each phase.
    """
    shallow, deep = (p["result"] for p in points)
    if reshape is not None:
        return _extrapolate_reshaped_peak(layers, shallow, deep, num_layers, reshape)
    live_deep = deep.live_bytes()
    best: tuple[int, str, dict[str, int]] | None = None
    for phase, first_a, first_b, length in _shared_regions(shallow, deep):
        # The same operations in both samples: the highest point is at the same offset.
        offset = max(range(length), key=lambda i: live_deep[first_b + i])
        cats_a = shallow.categories_at(first_a + offset)
        cats_b = deep.categories_at(first_b + offset)
        categories = {name: max(extrapolate_linear(layers, [cats_a[name], cats_b[name]], num_layers), 0) for name in cats_a}
        total = sum(categories.values())
        if best is None or total > best[0]:
            best = (total, phase, categories)
    if best is None:  # no shared structure at all: fall back to the deeper sample's own peak
        return points[1]["phase"], dict(points[1]["categories"])
    return best[1], best[2]


#: Maps single-GPU categories at a moment of a phase to one rank's categories.
Reshape = Callable[[dict[str, int], str], dict[str, int]]


def _extrapolate_reshaped_peak(layers, shallow, deep, num_layers: int, reshape: Reshape):
    """:func:`_extrapolate_peak` where each moment counts as one rank holds it after ``reshape``."""
    series_a, series_b = _category_series(shallow), _category_series(deep)
    best: tuple[int, str, dict[str, int]] | None = None
    phases: dict[str, int] = {}
    for phase, first_a, first_b, length in _shared_regions(shallow, deep):
        offset = max(range(length), key=lambda i: sum(reshape(series_b[first_b + i], phase).values()))
        cats_a, cats_b = series_a[first_a + offset], series_b[first_b + offset]
        single = {name: max(extrapolate_linear(layers, [cats_a[name], cats_b[name]], num_layers), 0) for name in cats_a}
        categories = reshape(single, phase)
        total = sum(categories.values())
        phases[phase] = max(phases.get(phase, 0), total)
        if best is None or total > best[0]:
            best = (total, phase, categories)
    if best is None:  # no shared structure: the deeper sample's own moments
        return _reshaped_peak(deep, reshape)
    return best[1], best[2], phases


def _reshaped_peak(result, reshape: Reshape) -> tuple[str, dict[str, int], dict[str, int]]:
    """The highest moment of a whole simulation after ``reshape``: phase, categories, per-phase peaks."""
    series = _category_series(result)
    best: tuple[int, str, dict[str, int]] | None = None
    phases: dict[str, int] = {}
    for seg in result.segments():
        for event in range(seg.start_event + 1, seg.end_event + 1):
            categories = reshape(series[event], seg.phase)
            total = sum(categories.values())
            phases[seg.phase] = max(phases.get(seg.phase, 0), total)
            if best is None or total > best[0]:
                best = (total, seg.phase, categories)
    if best is None:
        return result.peak.phase, reshape(dict(result.peak.categories), result.peak.phase), phases
    return best[1], best[2], phases


#: Live bytes by category after every event, by result (kept alongside the simulation cache).
_SERIES_CACHE: dict[int, tuple[Any, list[dict[str, int]]]] = {}


def _category_series(result) -> list[dict[str, int]]:
    """Live device bytes by category just after each event (``categories_at`` for every event, in one pass)."""
    cached = _SERIES_CACHE.get(id(result))
    if cached is not None and cached[0] is result:
        return cached[1]
    from memfit.planner.categories import TRACKED_CATEGORIES

    info = {a.alloc_id: (a.category, a.nbytes) for a in result.allocations if a.place == "device"}
    live = dict.fromkeys(TRACKED_CATEGORIES, 0)
    series = []
    for kind, alloc_id, _ in result.events:
        category, nbytes = info[alloc_id]
        live[category] += nbytes if kind == "alloc" else -nbytes
        series.append(dict(live))
    if len(_SERIES_CACHE) >= _SAMPLE_CACHE_SIZE:
        _SERIES_CACHE.pop(next(iter(_SERIES_CACHE)))
    _SERIES_CACHE[id(result)] = (result, series)
    return series


def _shared_regions(shallow, deep):
    """(phase, first event in ``shallow``, first event in ``deep``, length) of the runs of events
    both samples share at the start (head) and at the end (tail) of each phase."""
    for seg_a, seg_b in zip(shallow.segments(), deep.segments()):
        sig_a = _signatures(shallow, seg_a.start_event + 1, seg_a.end_event + 1)
        sig_b = _signatures(deep, seg_b.start_event + 1, seg_b.end_event + 1)
        head = _common_prefix(sig_a, sig_b)
        tail = _common_prefix(sig_a[::-1], sig_b[::-1])
        if head:
            yield seg_b.phase, seg_a.start_event + 1, seg_b.start_event + 1, head
        if tail:
            yield seg_b.phase, seg_a.end_event + 1 - tail, seg_b.end_event + 1 - tail, tail


def _signatures(result, first: int, stop: int) -> list[tuple[str, int, str]]:
    """(event kind, bytes, op) of events ``first`` to ``stop - 1``: what an event does, without ids."""
    by_id = {a.alloc_id: a for a in result.allocations}
    out = []
    for kind, alloc_id, _ in result.events[first:stop]:
        a = by_id[alloc_id]
        out.append((kind, a.nbytes, a.op))
    return out


def _common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def sample_layer_counts(num_layers: int, period: int) -> tuple[int, int] | None:
    """The two depths to simulate for extrapolation, or None when the model is simulated whole.

    Two and three whole periods of the layer pattern. The first decoder layer differs from the
    others (its input, the embedding output, needs no gradient), so each sample has at least one
    ordinary layer after it and before it in every phase, and the third period is what every
    further period adds.
    """
    if period <= 0 or num_layers <= 3 * period:
        return None
    return 2 * period, 3 * period


def extrapolate_linear(xs: tuple[int, int], ys: list[int], x: int) -> int:
    """The value at ``x`` of the line through (xs[0], ys[0]) and (xs[1], ys[1]), rounded to bytes."""
    (x0, x1), (y0, y1) = xs, ys
    return int(round(y0 + (y1 - y0) * (x - x0) / (x1 - x0)))


#: Summary numbers that grow linearly with depth (the peak and reserved memory are handled apart).
_SCALARS = ("host_peak_bytes", "paged_peak_bytes", "total_params", "trainable_params")


#: Simulation summaries by (config, spec, depth, workspaces): searches plan the same step many times.
_SAMPLE_CACHE: dict[tuple, dict[str, Any]] = {}
_SAMPLE_CACHE_SIZE = 128


def _sample(config: dict[str, Any], spec: RunSpec, num_layers: int | None, workspace_allocs: tuple[int, ...],
            arch: str | None = None) -> dict[str, Any]:
    """Simulate (or recall) the step at one depth and summarise it: peaks, categories, counts."""
    from memfit.planner.simulate import simulate

    key = (json.dumps(config, sort_keys=True, default=str), spec.model_dump_json(), num_layers, tuple(workspace_allocs), arch)
    cached = _SAMPLE_CACHE.get(key)
    if cached is None:
        cached = _summarise(simulate(config, spec, num_layers=num_layers, workspace_allocs=workspace_allocs, arch=arch))
        if len(_SAMPLE_CACHE) >= _SAMPLE_CACHE_SIZE:
            _SAMPLE_CACHE.pop(next(iter(_SAMPLE_CACHE)))
        _SAMPLE_CACHE[key] = cached
    # Callers must not change the tracker result; the dicts around it they may.
    return {key: (value if key == "result" else copy.deepcopy(value)) for key, value in cached.items()}


def _summarise(sim) -> dict[str, Any]:
    result = sim.tracker
    replay = allocator.simulate(result.events)
    return {
        "result": result,
        "attention": sim.attention,
        "attention_kernels": sim.attention_kernels,
        "batch_layout": sim.batch_layout,
        "embeddings_on_host": sim.embeddings_on_host,
        "trained_copies": [dict(copy) for copy in sim.trained_copies],
        "allocated_bytes": result.peak.allocated_bytes,
        "reserved_bytes": replay.peak_reserved_bytes,
        "host_peak_bytes": result.outside_peaks.get("host", 0),
        "paged_peak_bytes": result.outside_peaks.get("paged", 0),
        "categories": dict(result.peak.categories),
        "phase": result.peak.phase,
        "phase_peaks": dict(result.phase_peaks),
        "total_params": sim.total_params,
        "trainable_params": sim.trainable_params,
    }


#: Parameter layouts by (config, method knobs): the same for every N, shard mode, batch and length.
_LAYOUT_CACHE: dict[tuple, Any] = {}


def param_layout(config: dict[str, Any], spec: RunSpec):
    """The model's parameter shapes and per-layer bytes (:class:`memfit.planner.sharding.ParamLayout`).

    One period of decoder layers is built on ``meta`` and prepared as the trainer prepares it
    (4-bit packing for QLoRA, LoRA adapters), so the bytes are those of the real parameters; the
    decoder layers are then counted as often as the full depth repeats them.
    """
    key = (json.dumps(config, sort_keys=True, default=str), spec.method, spec.rank, tuple(spec.targets), spec.weight_precision,
           spec.dora, tuple(spec.modules_to_save))
    cached = _LAYOUT_CACHE.get(key)
    if cached is not None:
        return cached
    from memfit.models.build import DTYPES, build_meta_model, layer_period, make_config
    from memfit.models.layers import decoder_layers
    from memfit.planner.sharding import ParamGroup, ParamLayout
    from memfit.planner.simulate import _quiet, bitsandbytes_only_if_used
    from memfit.step.prepare import prepare_for_method

    full = make_config(config)
    num_layers = int(full.num_hidden_layers)
    period = max(layer_period(full), 1)
    sampled = min(period, num_layers)
    layer_spec = spec.model_copy(update={"checkpointing": "off", "gpus": 1, "shard": "none"})
    with _quiet(), bitsandbytes_only_if_used(layer_spec):
        model = prepare_for_method(build_meta_model(make_config(config, num_layers=sampled), DTYPES[spec.weight_precision]), layer_spec)
    layers = decoder_layers(model)
    in_layer = {}
    for index, layer in enumerate(layers):
        for p in layer.parameters():
            in_layer[id(p)] = index
    # How many decoder layers of the full depth each sampled layer stands for.
    repeats = [len(range(i, num_layers, sampled)) for i in range(sampled)]
    groups, layer_bytes, layer_grads = [], [0] * sampled, [0] * sampled
    root_bytes = root_grads = 0
    for p in model.parameters():
        nbytes = p.numel() * p.element_size()
        dim0 = int(p.shape[0]) if p.dim() > 0 else 1
        index = in_layer.get(id(p))
        count = repeats[index] if index is not None else 1
        # The trainer keeps quantized weights (packed 4-bit, int8) whole on every rank, outside FSDP (never gathered).
        whole = type(p).__name__ in ("Params4bit", "Int8Params")
        groups.append(ParamGroup(dim0=dim0, row_bytes=nbytes // max(dim0, 1), trainable=p.requires_grad, count=count, sharded=not whole))
        if whole:
            continue
        if index is None:
            root_bytes += nbytes
            root_grads += nbytes if p.requires_grad else 0
        else:
            layer_bytes[index] += nbytes
            layer_grads[index] += nbytes if p.requires_grad else 0
    largest = max(range(sampled), key=layer_bytes.__getitem__)
    layout = ParamLayout(groups=tuple(groups), layer_param_bytes=layer_bytes[largest], layer_grad_bytes=layer_grads[largest],
                         root_param_bytes=root_bytes, root_grad_bytes=root_grads)
    _LAYOUT_CACHE[key] = layout
    return layout


#: Bytes an optimizer keeps per trainable element at least: AdamW two states in the parameter's
#: dtype (counted from the bytes, see memory_lower_bound); bitsandbytes' 8-bit AdamW two uint8
#: states (plus block absmax), or two fp32 states for tensors too small to quantize: 2 at least.
_STATE_BYTES_PER_ELEMENT_AT_LEAST = {"adamw8bit": 2, "paged-adamw8bit": 2, "sgd": 0}


def memory_lower_bound(config: dict[str, Any], spec: RunSpec, context_bytes: int) -> int | None:
    """A floor under what any plan of ``spec`` needs: device total plus paged optimizer states.

    Worked out only where it is easy to prove, full fine-tuning on one GPU: every parameter is on
    the device and trained. When the second simulated step's optimizer step starts, every weight,
    every gradient (unless the step runs in backward, which frees each at once) and every optimizer
    state exist together, so the allocated peak is at least their sum, whatever the activations; the
    device total adds the CUDA context to reserved memory, which is at least allocated. Paged states
    are outside the device total but the search counts them beside it, so the sum covers them too.
    Bytes are counted from the parameter layout (:func:`param_layout`, one period of layers on
    ``meta``: cheap), without the 512-byte rounding of allocations, so the floor stays below.
    None where no floor is worked out (LoRA, QLoRA, several GPUs).
    """
    if spec.method != "full" or spec.gpus != 1 or spec.shard != "none":
        return None
    layout = param_layout(config, spec)
    weights = layout.total_bytes(trainable=True) + layout.total_bytes(trainable=False)
    gradients = 0 if spec.step_in_backward else layout.total_bytes(trainable=True)
    if spec.optimizer == "adamw":
        states = 2 * layout.total_bytes(trainable=True)  # exp_avg and exp_avg_sq, in the parameter's dtype
    else:
        itemsize = {"fp32": 4}.get(spec.weight_precision, 2)
        states = _STATE_BYTES_PER_ELEMENT_AT_LEAST[spec.optimizer] * (layout.total_bytes(trainable=True) // itemsize)
    return weights + gradients + states + context_bytes


def proven_over_budget(model: str | dict, *, revision: str | None = None, gpu: str | None = None,
                       budget: str | int | None = None, context_bytes: int | None = None, deepspeed: Any = None,
                       **knobs: Any) -> bool:
    """True when the plan of these arguments (:func:`plan`'s) cannot fit its GPU or budget, proven by
    :func:`memory_lower_bound` without a simulation; False when it may fit, or nothing is proven
    (the floor is worked out for one GPU, where ``deepspeed`` never applies)."""
    from memfit.planner import cache as plan_cache

    resolved = _resolve(model, revision=revision, gpu=gpu, budget=budget, **knobs)
    if resolved.has_problems or resolved.target.memory_bytes is None:
        return False
    context = runtime_overhead(resolved.target.arch, context_bytes=context_bytes).context_bytes
    # The floor is kept in the plan cache: working it out builds a layer on meta (torch, transformers),
    # which a search answered from the cache would otherwise import for this alone.
    key = plan_cache.make_key("floor", {"config": resolved.source.config, "spec": resolved.spec.model_dump(mode="json"),
                                        "context_bytes": context}) if plan_cache.enabled() else None
    stored = plan_cache.load("floor", key)
    if isinstance(stored, dict) and set(stored) == {"bytes"}:
        floor = stored["bytes"]
    else:
        floor = memory_lower_bound(resolved.source.config, resolved.spec, context)
        plan_cache.store("floor", key, {"bytes": floor})
    return floor is not None and floor > resolved.target.memory_bytes


def _math_attention_note(config: dict[str, Any], spec: RunSpec) -> str:
    """The cost of CUDA's math attention kernel at this length, and how to avoid it."""
    heads = int(config.get("num_attention_heads") or 1)
    # Attention runs in the autocast format under a mixed precision, else in the weights' format.
    compute = spec.autocast_precision or spec.weight_precision
    itemsize = {"fp32": 4}.get(compute, 2)
    scores = spec.batch_size * heads * spec.seq_len * spec.seq_len * itemsize
    why = "fp32 has no flash kernel" if compute == "fp32" else "this GPU has no flash kernel"
    fixes = ["--precision bf16 or bf16-mixed (flash kernel)"] if compute == "fp32" else []
    if spec.recipe == "hf":
        fixes.append("memfit's step (--recipe memfit: its attention expands grouped-query heads for the memory-efficient kernel)")
    else:
        fixes.append("--padding-free auto (memfit's attention, which expands grouped-query heads for the memory-efficient kernel)")
    return (
        f"attention falls to CUDA's math kernel ({why}, and the memory-efficient one does not take grouped-query heads): "
        f"{format_bytes(scores)} of [batch x heads x seq x seq] scores a layer, twice that in backward; use "
        + " or ".join(fixes)
    )
