"""``memfit.plan``: the peak GPU memory of a fine-tuning run, before it runs.

The steps, each in its own module:

1. resolve the model argument and validate every knob (:mod:`memfit.spec`) and the Target (a GPU, a
   budget or a live device: :mod:`memfit.planner.target`), all problems at once and without
   importing torch or transformers; then the checks that need the model's architecture
   (:mod:`memfit.planner.inputs`);
2. simulate the real training step under fake tensors (:mod:`memfit.planner.exact.simulate`) for a few
   whole periods of decoder layers, and extrapolate linearly to the full depth
   (:mod:`memfit.planner.shortcuts.extrapolate`; memory per decoder layer is the same for every layer of a
   period, so this is exact up to rounding; a test checks it against the full simulation);
3. replay the recorded allocations through the CUDA caching-allocator model
   (:mod:`memfit.planner.exact.allocator`) to get reserved memory;
4. add the runtime (CUDA context, cuBLAS workspaces: :mod:`memfit.planner.exact.runtime`) and compare with
   the Target.

Plans are kept on disk (:mod:`memfit.planner.shortcuts.cache`): a plan from the cache is the plan this call
would make, byte for byte. ``exact=True`` (or ``MEMFIT_EXACT=1``) takes none of the shortcuts
(:mod:`memfit.planner.shortcuts.switch`): every layer simulated, every chunk and micro-batch run,
nothing read from or kept in the plan cache.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

from memfit.models.catalog import ModelSource
from memfit.planner.errors import PlanError
from memfit.planner.exact.runtime import RuntimeOverhead, runtime_overhead
from memfit.planner.experts import checkpoint_note, expert_details
from memfit.planner.inputs import Resolved, checked, resolve
from memfit.planner.report import MemoryPlan, adapter_notes, category_help, with_vision_shares
from memfit.planner.shortcuts.extrapolate import Sampler, StepEstimate, estimate_step
from memfit.planner.shortcuts.switch import exact_wanted
from memfit.planner.target import Target
from memfit.spec import RunSpec
from memfit.units import format_bytes

__all__ = ["PlanError", "Target", "plan"]

_KERNEL_NOTES = {
    "flash": "flash kernel, no [seq x seq] attention matrix kept",
    "memory-efficient": "memory-efficient kernel, no [seq x seq] attention matrix kept (a padding mask is a [batch x 1 x seq x seq] bias)",
    "math": "math kernel: the [batch x heads x seq x seq] scores are materialised and their softmax kept for backward",
}


def _attention_note(estimate: StepEstimate) -> str:
    """How the plan's attention runs on CUDA, in one line (``attention:`` in the plan)."""
    implementation = estimate.attention
    if implementation == "memfit_documents":
        return (
            "memfit: each micro-batch's examples in one row, attention inside each example (CUDA's variable-length "
            "flash kernel; example by example with the memory-efficient kernel in fp32 or without flash), no padding, "
            "no [seq x seq] tensor"
        )
    if implementation == "eager":
        return "eager: this architecture has no SDPA path, the [batch x heads x seq x seq] attention matrix is materialised"
    kernels = [k for k in ("math", "memory-efficient", "flash") if k in estimate.attention_kernels]
    return f"{implementation}: " + (
        "; ".join(_KERNEL_NOTES[k] for k in kernels) if kernels else "no attention in the step"
    )


def _reference_note(spec: RunSpec, categories: dict[str, int], phase_peaks: dict[str, int], placed: str = "") -> str:
    """Where a preference plan's reference log-probs come from, and what that costs, in one line
    (``placed``: where a multi-GPU plan keeps a frozen copy, :func:`_reference_placement`)."""
    source = spec.reference
    if source == "none" and spec.is_grpo:
        return "none: beta 0 (grpo's default: no KL term, no reference model)"
    if source == "none":
        return f"none: {spec.objective} needs no reference model"
    if source == "precomputed":
        share = f" (each of the {spec.gpus} GPUs its share of the pairs)" if spec.gpus > 1 else ""
        return (
            f"precomputed: one forward of every pair under no_grad before training{share} (before the optimizer exists), "
            "kept in the run folder; the step reads them and runs no reference pass"
        )
    where = (
        "the base model with its LoRA adapters disabled (PEFT disable_adapter()): no second copy"
        if source == "disabled-adapters"
        else f"a frozen copy of the starting weights, in weights ({format_bytes(categories.get('weights', 0))} with the buffers"
        f"{placed})"
    )
    if spec.recipe == "hf":
        return f"{where}; its pass runs under no_grad after the policy's forward, on top of the activations the policy holds"
    top = phase_peaks.get("reference")
    shown = f" (live memory at most {format_bytes(top)} during it)" if top else ""
    return f"{where}; its pass runs under no_grad before the policy's forward{shown}, keeping nothing but the log-probs"


def _reference_placement(spec: RunSpec, layout, zero) -> str:
    """Where the ranks of a multi-GPU plan keep DPO's frozen reference copy, in words ('' on one GPU)."""
    if layout is None or spec.reference != "frozen-copy":
        return ""
    from memfit.planner import sharding

    ratio = sharding.reference_ratio(spec.shard, spec.gpus, layout, zero.settings if zero is not None else None)
    if ratio == 1.0:
        return ", whole on each GPU"
    if ratio == 0.0:
        return ", its shards in host memory"
    return f", a shard on each of the {spec.gpus} GPUs, gathered a layer at a time for its pass"


def _adapter_details(spec: RunSpec, copies: list[dict], adapted: tuple[str, ...] = ()) -> dict[str, Any]:
    """What the adapters of a plan are (``details.adapters``): the modules they sit on, DoRA, rsLoRA
    and the scale it gives, the base they sit on, the modules trained whole and the copies PEFT
    makes of them (tied modules share one copy: they are listed together)."""
    groups = sorted({tuple(sorted(name.rsplit(".", 1)[-1] for name in copy["modules"])) for copy in copies})
    return {
        "modules": list(adapted),
        "dora": spec.dora,
        "rslora": spec.rslora,
        "scale": spec.lora_scale,
        "base": {4: "nf4", 8: "int8"}.get(spec.base_bits, spec.weight_precision),
        "modules_to_save": list(spec.modules_to_save),
        "trained_copies": [list(group) for group in groups],
    }


def plan(
    model: str | dict,
    *,
    revision: str | None = None,
    gpu: str | None = None,
    budget: str | int | None = None,
    target: Target | None = None,
    context_bytes: int | str | None = None,
    cublas_workspace_bytes: int | None = None,
    exact: bool = False,
    cache: bool = True,
    deepspeed: Any = None,
    sampler: Sampler | None = None,
    model_override: str | None = None,
    progress: Callable[[str], None] | None = None,
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
        target: what to check the plan against, made already (:class:`~memfit.planner.target.Target`:
            from options, or a live device), instead of ``gpu`` / ``budget``.
        context_bytes, cublas_workspace_bytes: override the runtime estimates (see
            :mod:`memfit.planner.exact.runtime`); ``context_bytes`` defaults to the target's (0 for a live
            device, whose context is spent already), and may be the command line's text (checked:
            0 to :data:`~memfit.planner.exact.runtime.MAX_CONTEXT_BYTES`).
        exact: take none of the planner's shortcuts (:mod:`memfit.planner.shortcuts.switch`; also on
            with ``MEMFIT_EXACT=1``): every decoder layer simulated (no extrapolation over depth),
            every chunk and micro-batch run (no replay), no plan cache, no ``sampler``. Slower; each
            shortcut gives the exact plan's figures (``details.exact`` says the plan was made so).
        cache: read and keep the plan in the on-disk plan cache (:mod:`memfit.planner.shortcuts.cache`; also
            off with ``MEMFIT_PLAN_CACHE=0``, and for an exact plan). A plan from the cache is the plan
            this call would make, byte for byte, but for ``details.plan_seconds``.
        deepspeed: a DeepSpeed config's settings (:class:`memfit.interop.deepspeed.ZeroSettings`):
            with ``gpus`` > 1 and a ZeRO ``shard``, each rank is planned with DeepSpeed's buffers.
        sampler: how the step is simulated at each sampled depth (default: here, one after the
            other; :class:`memfit.planner.shortcuts.workers.DepthPool`: side by side in worker processes). The
            plan is the same either way.
        model_override: with another tool's config as ``model``, the model to plan in place of the
            config's (``--model``: a path, a catalog name or a Hub id).
        progress: called with what the plan is doing as it goes (``"building the model from its
            config and simulating one training step"``), for a status line; a plan from the cache
            says nothing.
        **knobs: the :class:`~memfit.spec.RunSpec` fields: method, rank, alpha, dropout, targets,
            precision, optimizer, batch_size, seq_len, grad_accum, checkpointing, gpus, shard.

    Raises:
        PlanError: listing every problem with the input, before any simulation runs.
    """
    from memfit.interop import is_tool_config

    given = dict(
        revision=revision,
        gpu=gpu,
        budget=budget,
        target=target,
        context_bytes=context_bytes,
        cublas_workspace_bytes=cublas_workspace_bytes,
        exact=exact,
        cache=cache,
        sampler=sampler,
        model_override=model_override,
        progress=progress,
    )
    if is_tool_config(model):
        return _plan_tool_config(str(model), **given, **knobs)
    return _plan_model(model, deepspeed=deepspeed, **given, **knobs)


def _plan_model(
    model: str | dict,
    *,
    revision: str | None,
    gpu: str | None,
    budget: str | int | None,
    target: Target | None,
    context_bytes: int | str | None,
    cublas_workspace_bytes: int | None,
    exact: bool,
    cache: bool,
    deepspeed: Any,
    sampler: Sampler | None,
    model_override: str | None,
    progress: Callable[[str], None] | None,
    **knobs: Any,
) -> MemoryPlan:
    """:func:`plan` of a model (not another tool's config)."""
    check_no_override(model, model_override)
    started = time.perf_counter()
    exact = exact_wanted(exact)
    if exact:
        cache, sampler = False, None  # nothing remembered, no worker processes
    resolved = resolve(
        model, revision=revision, gpu=gpu, budget=budget, target=target, context_bytes=context_bytes, **knobs
    )
    calibration = _calibration(resolved.target)
    if context_bytes is None:
        context_bytes = resolved.target.context_bytes
        if context_bytes is None and calibration is not None and calibration.context_bytes is not None:
            context_bytes = calibration.context_bytes  # measured on this card (memfit calibrate)
    elif not resolved.has_problems:
        context_bytes = int(context_bytes)  # the command line's text, checked
    key = _cache_key(resolved, context_bytes, cublas_workspace_bytes, deepspeed, calibration) if cache else None
    cached = _cached_plan(key, resolved.spec, started) if key is not None else None
    if cached is not None:
        return cached
    result = _made_plan(
        resolved,
        cache=cache,
        context_bytes=context_bytes,
        cublas_workspace_bytes=cublas_workspace_bytes,
        exact=exact,
        deepspeed=deepspeed,
        sampler=sampler,
        progress=progress,
    )
    if calibration is not None:
        _apply_calibration(result, calibration)
    result.details["plan_seconds"] = round(time.perf_counter() - started, 3)
    if key is not None:
        _keep_plan(key, result)
    return result


def _cache_key(
    resolved: Resolved,
    context_bytes: int | None,
    cublas_workspace_bytes: int | None,
    deepspeed: Any,
    calibration: Any = None,
) -> str | None:
    """The plan cache's key of these inputs; None for inputs with problems. Looked up before the
    checks that need transformers and torch: an entry exists only for inputs that passed them (with
    the same code and libraries, which are in the key), so a plan from the cache needs neither."""
    if resolved.has_problems:
        return None
    return _plan_key(
        resolved,
        context_bytes=context_bytes,
        cublas_workspace_bytes=cublas_workspace_bytes,
        deepspeed=deepspeed.to_dict() if deepspeed is not None else None,
        calibration=calibration.to_dict() if calibration is not None else None,
    )


def predicted_plan(
    model: str | dict,
    sampler: Sampler,
    *,
    revision: str | None = None,
    target: Target | None = None,
    deepspeed: Any = None,
    **knobs: Any,
) -> MemoryPlan:
    """The plan :func:`plan` makes of these inputs, its step given by ``sampler`` instead of simulated
    (:class:`memfit.planner.shortcuts.lengths.LengthSampler`: the step at any length from two simulated ones).

    Its device figures are the plan's; its host figures are not (the sampler models device memory
    only), so a predicted plan only steers a search and is never reported. The plan cache keeps it
    under a kind of its own (:data:`_PREDICTED`), with the lengths the sampler learnt from. A model
    of the step over lengths is a shortcut: an exact plan (:mod:`memfit.planner.shortcuts.switch`)
    is never predicted.
    """
    if exact_wanted():
        raise ValueError("an exact plan is simulated, never predicted: plan it (memfit.planner.api.plan)")
    started = time.perf_counter()
    resolved = resolve(model, revision=revision, target=target, **knobs)
    options = dict(context_bytes=resolved.target.context_bytes, cublas_workspace_bytes=None)
    # A search asks the same questions again: its predictions are kept like plans, under their own
    # kind and with the lengths they were learnt from, so that a repeated search learns nothing anew.
    key = (
        None
        if resolved.has_problems
        else _plan_key(
            resolved,
            **options,
            deepspeed=deepspeed.to_dict() if deepspeed is not None else None,
            learnt_from=list(sampler.lengths),
            steering=bool(getattr(sampler, "steers_only", False)),
        )
    )
    cached = _cached_plan(key, resolved.spec, started, kind=_PREDICTED)
    if cached is not None:
        return cached
    result = _made_plan(resolved, cache=True, **options, deepspeed=deepspeed, sampler=sampler)
    result.details["predicted"] = True
    if key is not None:
        _keep_plan(key, result, kind=_PREDICTED)
    return result


def _calibration(target: Target):
    """The constants ``memfit calibrate`` measured on the target's card, or None (a live device
    measures its own free memory: nothing to calibrate)."""
    if target.source == "device" or not target.card:
        return None
    from memfit.planner.calibration import for_card

    return for_card(target.card)


def _apply_calibration(result: MemoryPlan, calibration) -> None:
    """The calibrated allocator reserve added to ``result``, and the plan saying where its constants come from."""
    from memfit.planner.calibration import extra_reserved_bytes

    extra = extra_reserved_bytes(calibration, result.allocated_bytes)
    result.reserved_bytes += extra
    result.device_total_bytes += extra
    result.categories["allocator"] = result.categories.get("allocator", 0) + extra
    if result.headroom_bytes is not None:
        result.headroom_bytes -= extra
        result.fits = result.headroom_bytes >= 0
    result.details["calibration"] = calibration.to_dict()
    result.details["notes"].insert(0, calibration.describe())


#: The plan cache's kind for :func:`predicted_plan`'s plans (never mistaken for simulated ones).
_PREDICTED = "predicted-plan"


def _made_plan(
    resolved: Resolved,
    *,
    cache: bool,
    context_bytes: int,
    cublas_workspace_bytes: int | None,
    exact: bool = False,
    deepspeed: Any,
    sampler: Sampler | None = None,
    progress: Callable[[str], None] | None = None,
) -> MemoryPlan:
    """The plan of checked inputs: the step estimated (simulated, or given by ``sampler``), the runtime
    added; ``exact``: with no shortcut."""
    say = progress or (lambda what: None)
    say("checking the model's architecture")
    source, spec, target = checked(resolved, cache=cache)
    say(
        "building the model from its config and simulating "
        + ("every layer of one training step, exactly" if exact else "one training step")
    )
    runtime = runtime_overhead(target.arch, context_bytes=context_bytes, cublas_workspace_bytes=cublas_workspace_bytes)
    layout = zero = None
    if spec.gpus > 1:
        from memfit.planner.layout import param_layout

        layout = param_layout(source.config, spec, remember=not exact)
        zero = _zero_plan(deepspeed, source.config, spec, layout)
    estimate = _estimate(source.config, spec, runtime, target, exact=exact, layout=layout, zero=zero, sampler=sampler)
    made = _memory_plan(source, spec, target, runtime, estimate, layout=layout, zero=zero, remember=not exact)
    if spec.is_grpo:
        from memfit.planner.grpo import with_phases

        say(
            "simulating the generation (transformers generate under fake tensors)"
            if not spec.use_vllm
            else "planning vLLM"
        )
        made = with_phases(made, source.config, spec, target, runtime, exact=exact)
    if exact:
        made.details["exact"] = True
    vision = made.details.get("vision")
    if vision and resolved.knobs.get("seq_len") is None:
        image_tokens = vision["images"] * vision["sequence_tokens_per_image"]
        made.details["notes"].append(
            f"seq_len {spec.seq_len:,}: the images' {image_tokens:,} tokens beside {spec.seq_len - image_tokens:,} "
            "of text (--seq-len sets it)"
        )
    return made


def _estimate(
    config: dict[str, Any],
    spec: RunSpec,
    runtime: RuntimeOverhead,
    target: Target,
    *,
    exact: bool,
    layout,
    zero,
    sampler: Sampler | None = None,
) -> StepEstimate:
    """The step as one GPU (or one rank of ``layout``'s sharding) holds it at its peak."""
    reshape = None
    if layout is not None:
        from functools import partial

        from memfit.planner import sharding

        # One simulation of one rank's step (the same for every N and mode: it is cached); the
        # sharding arithmetic then decides what each rank holds at every candidate moment.
        reshape = partial(
            sharding.per_rank_categories,
            shard=spec.shard,
            gpus=spec.gpus,
            layout=layout,
            zero=zero,
            reference=spec.reference,
        )
    estimate = estimate_step(
        config, spec, runtime.cublas_workspace_allocs, exact=exact, reshape=reshape, arch=target.arch, sampler=sampler
    )
    if layout is not None and estimate.paged_peak_bytes:
        from memfit.planner import sharding

        # Paged optimizer states are optimizer states: sharded as the mode shards those.
        ratio = sharding.state_ratios(spec.shard, spec.gpus, layout, zero)["optimizer"]
        estimate = dataclasses.replace(estimate, paged_peak_bytes=math.ceil(estimate.paged_peak_bytes * ratio))
    return estimate


def _memory_plan(
    source: ModelSource,
    spec: RunSpec,
    target: Target,
    runtime: RuntimeOverhead,
    estimate: StepEstimate,
    *,
    layout,
    zero,
    remember: bool = True,
) -> MemoryPlan:
    """The plan of ``estimate``: reserved memory, the runtime added, compared with ``target``
    (``remember``: what it works out of the model's config kept in the memo)."""
    categories = dict(estimate.categories)
    tracked_runtime = categories.pop("runtime", 0)
    allocated = estimate.allocated_bytes
    reserved = max(estimate.reserved_bytes, allocated)
    device_total = reserved + runtime.context_bytes
    categories["allocator"] = reserved - allocated
    categories["runtime"] = tracked_runtime + runtime.context_bytes

    gpu_json = fits = headroom = None
    if target.memory_bytes is not None:
        gpu_json = {"name": target.name or "budget", "memory_bytes": target.memory_bytes}
        headroom = target.memory_bytes - device_total
        fits = headroom >= 0
    details = {
        "total_params": estimate.total_params,
        "trainable_params": estimate.trainable_params,
        "host_peak_bytes": estimate.host_peak_bytes,
        "paged_peak_bytes": estimate.paged_peak_bytes,
        "phase_peaks_allocated_bytes": estimate.phase_peaks,
        "simulated_layers": estimate.simulated_layers,
        "num_layers": estimate.num_layers,
        "layer_kinds": estimate.layer_kinds,
        "context_bytes": runtime.context_bytes,
        "cublas_workspace_bytes": runtime.cublas_workspace_bytes,
        "attention": _attention_note(estimate),
        "sequence_mixers": _mixers(source),
        "attention_kernels": list(estimate.attention_kernels),
        "batch_layout": estimate.batch_layout,
        "input_embeddings": "host" if estimate.embeddings_on_host else "device",
        "precision_regime": spec.precision_regime,
        "adapters": _adapter_details(spec, estimate.trained_copies, estimate.adapted) if spec.uses_adapters else None,
        "experts": expert_details(source.config, spec, estimate.adapter_bytes, remember=remember),
        "vision": _vision_details(source, spec, estimate),
        "notes": _notes(source, spec, target, runtime, estimate, headroom),
    }
    if spec.reentrant_checkpointing:
        details["reentrant_checkpointing"] = True  # torch's reentrant variant (the hf recipe's use_reentrant)
    if spec.is_preference or spec.is_grpo:
        details["objective"] = spec.objective
        details["reference"] = _reference_note(
            spec, categories, estimate.phase_peaks, _reference_placement(spec, layout, zero)
        )
    details["category_help"] = with_vision_shares(
        category_help(spec.knobs(), details["adapters"], reentrant=spec.reentrant_checkpointing), details["vision"]
    )
    details["notes"].extend(adapter_notes(spec.knobs(), details["adapters"]))
    if layout is not None:
        _add_per_rank_details(details, spec, layout, estimate, zero)
    if source.hub:
        details["hub"] = dict(source.hub)  # repo, revision and the commit whose config.json was planned
    return MemoryPlan(
        model=source.name,
        spec=spec.knobs(),
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        device_total_bytes=device_total,
        phase=estimate.phase,
        categories=categories,
        gpu=gpu_json,
        fits=fits,
        headroom_bytes=headroom,
        details=details,
    )


def _notes(
    source: ModelSource,
    spec: RunSpec,
    target: Target,
    runtime: RuntimeOverhead,
    estimate: StepEstimate,
    headroom: int | None,
) -> list[str]:
    """What a plan says beside its figures: how the config was obtained, the runtime's estimates,
    paged states that do not fit, the math attention kernel, a card without bf16."""
    notes = ([source.note] if source.note else []) + list(runtime.notes)
    paged = estimate.paged_peak_bytes
    if paged and headroom is not None and paged > headroom:
        notes.append(
            f"paged optimizer states ({format_bytes(paged)}) do not fit beside the peak ({format_bytes(max(headroom, 0))} free): "
            "bitsandbytes will page them to host memory and back every step (slow); memfit fit counts them against the headroom"
        )
    if "math" in estimate.attention_kernels:
        notes.append(_math_attention_note(source.config, spec))
    if target.supports_bf16 is False and spec.precision in ("bf16", "bf16-mixed"):
        notes.append(
            f"{target.card or target.name} has no bf16 support: use --precision fp16 (LoRA/QLoRA), fp16-mixed or fp32"
        )
    stored = checkpoint_note(source.config)
    if stored:
        notes.append(stored)
    mixers = _mixers(source)
    if mixers and mixers["installed"]:
        notes.append(
            f"{', '.join(mixers['installed'])} installed: the run's Mamba / linear-attention mixers call their fused "
            "kernels, and this plan simulated transformers' PyTorch path for them (the kernels do not run on fake "
            "tensors), so the mixers' activations are those of the PyTorch path"
        )
    return notes


def _vision_details(source: ModelSource, spec: RunSpec, estimate: StepEstimate) -> dict[str, Any] | None:
    """A vision-language plan's images, their tokens, the tower's and projector's weights
    (:func:`memfit.models.vision.vision_details`) and what they keep for backward; None for a text model."""
    from memfit.planner.vision import vision_details

    weight_bytes = 4 if spec.weight_precision == "fp32" else 2  # the tower is never quantized
    details = vision_details(source.config, spec.images, spec.image_max_pixels, weight_bytes)
    if details is not None:
        details["tower_activation_bytes"] = estimate.vision_activation_bytes
    return details


def _mixers(source: ModelSource) -> dict[str, Any] | None:
    """The path of the model's sequence mixers (:func:`memfit.models.mixer_kernels.describe`), or None."""
    from memfit.models.build import make_config
    from memfit.models.mixer_kernels import describe, mixer_kernels

    return describe(mixer_kernels(make_config(source.config)))


#: The fields of a MemoryPlan the cache keeps (``spec`` is rebuilt from the RunSpec: it holds tuples).
_CACHED_FIELDS = (
    "model",
    "allocated_bytes",
    "reserved_bytes",
    "device_total_bytes",
    "phase",
    "categories",
    "gpu",
    "fits",
    "headroom_bytes",
    "details",
)


def _plan_key(resolved: Resolved, **options: Any) -> str | None:
    """The plan cache's key for these inputs: everything a plan depends on (the environment is added
    by :func:`memfit.planner.shortcuts.cache.make_key`)."""
    from memfit.planner.shortcuts import cache as plan_cache

    if not plan_cache.enabled():
        return None
    source = resolved.source
    inputs = {
        "model": {"name": source.name, "config": source.config, "note": source.note, "hub": source.hub},
        "spec": resolved.spec.model_dump(mode="json"),
        "target": resolved.target.key(),
        **options,
    }
    return plan_cache.make_key("plan", inputs)


def _cached_plan(key: str | None, spec: RunSpec, started: float, kind: str = "plan") -> MemoryPlan | None:
    """The plan stored under ``key``, with this call's ``plan_seconds``; None on a miss."""
    from memfit.planner.shortcuts import cache as plan_cache

    stored = plan_cache.load(kind, key)
    if not isinstance(stored, dict) or set(stored) != set(_CACHED_FIELDS):
        return None
    details = dict(stored["details"], plan_seconds=round(time.perf_counter() - started, 3))
    return MemoryPlan(spec=spec.knobs(), **dict(stored, details=details))


def _keep_plan(key: str, result: MemoryPlan, kind: str = "plan") -> None:
    """Store ``result`` under ``key`` (the time it took left out: it is the new call's own)."""
    from memfit.planner.shortcuts import cache as plan_cache

    value = {name: getattr(result, name) for name in _CACHED_FIELDS}
    value["details"] = {k: v for k, v in result.details.items() if k != "plan_seconds"}
    plan_cache.store(kind, key, value)


def _add_per_rank_details(details: dict[str, Any], spec: RunSpec, layout, estimate: StepEstimate, zero=None) -> None:
    """What a multi-GPU plan adds: it is per rank, the mode planned, model states before and after,
    and DeepSpeed's buffers by name where a DeepSpeed config shards the run."""
    from memfit.planner import sharding

    shard = sharding.effective_shard(spec.shard, spec.gpus)
    states = sharding.model_state_bytes(
        estimate.single_gpu_categories, shard=shard, gpus=spec.gpus, layout=layout, zero=zero, reference=spec.reference
    )
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
        details["notes"].append(
            "zero3 is planned as fsdp (FSDP2, one decoder layer gathered at a time, next one prefetched)"
        )
    if spec.sequence_parallel > 1:
        details["notes"].append(
            f"sequence parallel {spec.sequence_parallel}: each rank's step simulated on its {spec.seq_len // spec.sequence_parallel:,} "
            f"tokens of every row, attention on the whole row for its share of the heads; the all-to-alls' buffers are "
            f"simulated as copies of their size; {spec.gpus // spec.sequence_parallel} data-parallel group(s)"
        )
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
    terms = zero_terms(
        resolved,
        gpus=spec.gpus,
        layout=layout,
        num_layers=num_layers,
        itemsize=itemsize,
        trainable_itemsize=trainable_itemsize,
        reference_pass=_has_reference_pass(spec),
    )
    return ZeroPlan(resolved, tuple(terms))


def _has_reference_pass(spec: RunSpec) -> bool:
    """Whether the step of ``spec`` runs DPO's reference pass as a phase of its own, before the policy's forward."""
    if not spec.is_preference:
        return False
    from memfit.step.preference import choose_preference_loss

    return choose_preference_loss(spec).reference_pass is not None


def check_no_override(model: Any, model_override: str | None) -> None:
    """``--model`` replaces a config's model: refuse it beside a model."""
    if model_override is not None:
        raise PlanError(
            [
                f"--model: replaces the model of a training config (Axolotl, LLaMA-Factory, TRL, or memfit's own "
                f"YAML), and {str(model)!r} is a model itself: plan it alone, or pass the config"
            ]
        )


def _plan_tool_config(
    path: str, *, revision: str | None = None, model_override: str | None = None, **options: Any
) -> MemoryPlan:
    """:func:`plan` of another tool's config (:func:`memfit.interop.read_tool_config`): its model (or
    ``model_override``) and knobs, the options given here in place of the config's, its DeepSpeed
    settings where they shard the run; the plan says what was read and what is not modelled
    (``details.config``)."""
    from memfit.interop import read_tool_config

    plan_options = {
        k: options.pop(k)
        for k in (
            "gpu",
            "budget",
            "target",
            "context_bytes",
            "cublas_workspace_bytes",
            "exact",
            "cache",
            "sampler",
            "progress",
        )
    }
    tool = read_tool_config(path, model=model_override)
    knobs, dropped = tool.knobs_for(options)
    _check_tool_modes(tool, knobs, given={k for k, v in options.items() if v is not None})
    deepspeed = tool.zero if tool.zero is not None and knobs.get("shard") == tool.shard else None
    model, revision = _with_model_config(tool.model, revision or tool.revision, tool.model_config)
    result = plan(model, revision=revision, deepspeed=deepspeed, **plan_options, **knobs)
    config = tool.to_dict(given=options)
    config["not_modelled"] += [f.to_dict() for f in dropped]
    result.details = dict(result.details, config=config)
    return result


def _with_model_config(model: str, revision: str | None, fields: dict[str, Any]) -> tuple[str | dict, str | None]:
    """The model a tool's config trains: ``model`` itself, or its config with the fields the tool sets
    as it loads it (the routing loss of a mixture-of-experts model: ``details.config.model_config``)."""
    if not fields:
        return model, revision
    from memfit.models.catalog import resolve_model

    try:
        source = resolve_model(model, revision=revision)
    except ValueError as err:
        raise PlanError([f"model: {err}"]) from None
    return {**source.config, **fields, "_name_or_path": source.name}, None


def _check_tool_modes(tool, knobs: dict[str, Any], given: set[str]) -> None:
    """Refuse a shard mode and optimizer that cannot run together, each named as the user set it: a
    config's keys (``deepspeed (memfit shard: fsdp-offload)``), or the command line's flag."""
    from memfit.planner.sharding import mode_problems

    def spell(knob: str, value: Any) -> str:
        if knob in given or knob not in tool.sources:
            return f"--{knob} {value}"
        return f"{', '.join(tool.sources[knob])} (memfit {knob}: {value})"

    from memfit.spec import whole_number_value

    gpus = whole_number_value(knobs.get("gpus") or 1)  # not a whole number: the plan's checks name it
    if isinstance(gpus, int) and gpus > 1:
        problems = mode_problems(knobs.get("shard", "none"), gpus, knobs.get("optimizer", "adamw"), spell)
        if problems:
            raise PlanError([f"{tool.path}: {line}" for line in problems])


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
        fixes.append(
            "memfit's step (--recipe memfit: its attention expands grouped-query heads for the memory-efficient kernel)"
        )
    else:
        fixes.append(
            "--padding-free auto (memfit's attention, which expands grouped-query heads for the memory-efficient kernel)"
        )
    return (
        f"attention falls to CUDA's math kernel ({why}, and the memory-efficient one does not take grouped-query heads): "
        f"{format_bytes(scores)} of [batch x heads x seq x seq] scores a layer, twice that in backward; use "
        + " or ".join(fixes)
    )
