"""A grpo plan: two phases, the generation and the training, each planned, and the larger is the peak.

The training phase is the step (:mod:`memfit.planner.exact.simulate`: the policy's per-token
log-probs over prompt and completion, the reference pass where ``beta`` is above 0). The generation
phase is what the run holds while it samples the completions:

- with transformers (memfit's run, TRL's default): simulated, ``generate`` under fake tensors
  (:mod:`memfit.planner.exact.generation`, at the planned length and full depth by
  :mod:`memfit.planner.shortcuts.generation`): the policy and its optimizer states, the KV cache of
  the generation batch, the sampling logits;
- with vLLM (``use_vllm``, as TRL runs it; memfit's run does not): planned only, from vLLM's and
  TRL's rules, cited where they are used. Colocated, vLLM takes ``vllm_gpu_memory_utilization`` of
  the card's whole memory for its weights, KV cache and activations (vLLM's
  ``CacheConfig.gpu_memory_utilization``: "the fraction of GPU memory to be used for the model
  executor ... a per-instance limit", vllm/config/cache.py; its worker requests
  ``total_memory x gpu_memory_utilization`` and refuses to start with less free,
  vllm/v1/worker/gpu_worker.py). It keeps that through training unless sleep mode is on: TRL puts
  the engine to sleep at level 2 after each generation (trl/generation/vllm_generation.py,
  ``llm.sleep(level=2)``), which discards its weights and KV cache (vLLM's docs, Sleep Mode: "Level 2
  sleep will discard both the model weights and the KV cache"); what vLLM keeps while asleep
  (CUDA graphs, its buffers) is not planned. In server mode vLLM runs on GPUs of its own and the
  training GPU holds none of it.

:func:`with_phases` rewrites a plan made of the training step into the plan of both phases.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memfit.planner.report import MemoryPlan
from memfit.spec import RunSpec
from memfit.units import format_bytes

#: The knobs that drive each phase's memory, as the plan names them.
GENERATION_DRIVERS = (
    "num_generations x prompts (batch_size x grad_accum completions)",
    "max_completion_length (KV cache)",
    "seq_len - max_completion_length (prompt)",
    "top_p (sampling logits)",
)
TRAINING_DRIVERS = ("batch_size x seq_len (activations)", "checkpointing", "beta > 0 (reference pass)")
VLLM_DRIVERS = ("vllm_gpu_memory_utilization x the card's memory",)

#: Where each vLLM rule the plan uses comes from.
VLLM_SOURCES = (
    "vLLM CacheConfig.gpu_memory_utilization, vllm/config/cache.py: the fraction of the GPU's memory one vLLM instance uses",
    "vLLM Worker.init_device, vllm/v1/worker/gpu_worker.py: requests total memory x gpu_memory_utilization, refuses to start "
    "with less free",
    "vLLM docs, Sleep Mode (docs.vllm.ai/en/latest/features/sleep_mode/): level 2 discards the weights and the KV cache",
    "TRL trl/generation/vllm_generation.py: colocated with vllm_enable_sleep_mode, llm.sleep(level=2) after each generation",
)


def with_phases(
    plan: MemoryPlan, config: dict[str, Any], spec: RunSpec, target: Any, runtime: Any, *, exact: bool = False
) -> MemoryPlan:
    """``plan`` (the training step's) as a grpo plan: its generation phase planned too, each phase in
    ``details.phases``, and the plan's figures those of the larger (``exact``: the generation
    simulated whole, as the step of an exact plan is)."""
    training = _phase(
        "training",
        plan.allocated_bytes,
        plan.reserved_bytes,
        plan.device_total_bytes,
        plan.phase,
        plan.categories,
        "simulated",
        TRAINING_DRIVERS,
    )
    notes: list[str] = []
    if spec.use_vllm:
        generation, training = _vllm_phases(spec, target, training, notes)
    else:
        generation = _generation_phase(config, spec, target, runtime, exact)
    phases = [p for p in (generation, training) if p is not None]
    peak = max(phases, key=lambda p: p["device_total_bytes"])
    details = dict(plan.details)
    details["phases"] = phases
    helps = dict(details.get("category_help") or {})
    helps["activations"] = (
        helps.get("activations", "tensors forward keeps for backward") + "; while generating, the KV cache"
    )
    if any(p.get("vllm_bytes") for p in phases):
        helps["runtime"] = (
            helps.get("runtime", "CUDA context and cuBLAS workspaces") + "; vLLM's share of the card (planned only)"
        )
    details["category_help"] = helps
    details["objective"] = "grpo"
    details["notes"] = list(details.get("notes", [])) + notes
    result = dataclasses.replace(
        plan,
        allocated_bytes=peak["allocated_bytes"],
        reserved_bytes=peak["reserved_bytes"],
        device_total_bytes=peak["device_total_bytes"],
        categories=dict(peak["categories"]),
        phase=f"{peak['name']} ({peak['phase']})",
        details=details,
    )
    if plan.gpu is not None:
        result.headroom_bytes = plan.gpu["memory_bytes"] - result.device_total_bytes
        result.fits = result.headroom_bytes >= 0
    return result


def _phase(
    name: str,
    allocated: int,
    reserved: int,
    device_total: int,
    phase: str,
    categories: dict[str, int],
    planned: str,
    drivers: tuple[str, ...],
    **extra: Any,
) -> dict[str, Any]:
    return {
        "name": name,
        "allocated_bytes": int(allocated),
        "reserved_bytes": int(reserved),
        "device_total_bytes": int(device_total),
        "phase": phase,
        "categories": dict(categories),
        "planned": planned,
        "drivers": list(drivers),
        **extra,
    }


def _generation_phase(config: dict[str, Any], spec: RunSpec, target: Any, runtime: Any, exact: bool) -> dict[str, Any]:
    """The generation as memfit's run does it (transformers' ``generate``), simulated."""
    from memfit.planner.exact.generation import PHASES
    from memfit.planner.shortcuts.generation import estimate_generation

    estimate = estimate_generation(config, spec, runtime.cublas_workspace_allocs, exact=exact, arch=target.arch)
    categories = dict(estimate.categories)
    tracked_runtime = categories.pop("runtime", 0)
    categories["allocator"] = estimate.reserved_bytes - estimate.allocated_bytes
    categories["runtime"] = tracked_runtime + runtime.context_bytes
    return _phase(
        "generation",
        estimate.allocated_bytes,
        estimate.reserved_bytes,
        estimate.reserved_bytes + runtime.context_bytes,
        estimate.phase,
        categories,
        "simulated",
        GENERATION_DRIVERS,
        kv_cache_bytes=int(estimate.kv_cache_bytes),
        sub_phases={k: v for k, v in estimate.phase_peaks.items() if k in PHASES},
        simulated_layers=estimate.simulated_layers,
        engine="transformers generate",
    )


def _card_bytes(target: Any) -> int | None:
    """The whole memory of the card vLLM takes its share of (its catalog memory; a budget alone stands for it)."""
    if target.card:
        from memfit.models.gpus import get_gpu

        try:
            return get_gpu(target.card).memory_bytes
        except ValueError:
            pass
    return target.memory_bytes


def _vllm_phases(spec: RunSpec, target: Any, training: dict[str, Any], notes: list[str]):
    """(generation, training) with vLLM: planned from vLLM's and TRL's rules (see the module docstring)."""
    notes.append(
        "vLLM is planned from its rules, not simulated (memfit train generates with transformers): "
        + "; ".join(VLLM_SOURCES)
    )
    states = {k: training["categories"].get(k, 0) for k in ("weights", "trainable", "optimizer")}
    context = training["categories"].get("runtime", 0)
    if spec.vllm_mode == "server":
        notes.append(
            "vllm_mode server: vLLM runs on GPUs of its own (vllm serve --gpu-memory-utilization, 0.9 by default "
            "there); this GPU holds none of it"
        )
        return None, training
    card = _card_bytes(target)
    if card is None:
        notes.append(
            "vLLM colocated takes vllm_gpu_memory_utilization of the card's memory: give --gpu or --budget to plan it"
        )
        return None, training
    share = int(card * spec.vllm_gpu_memory_utilization)
    held = sum(states.values())
    generation = _phase(
        "generation",
        held,
        held,
        held + context + share,
        "vLLM",
        {**dict.fromkeys(training["categories"], 0), **states, "runtime": context + share},
        "planned only",
        VLLM_DRIVERS,
        vllm_bytes=share,
        engine="vLLM colocated",
    )
    if target.memory_bytes is not None and held + context + share > card:
        notes.append(
            f"vLLM colocated asks {format_bytes(share)} ({spec.vllm_gpu_memory_utilization:g} of "
            f"{format_bytes(card)}) beside the policy's {format_bytes(held)}: vLLM refuses to start with less free "
            "memory than its share; lower vllm_gpu_memory_utilization"
        )
    if spec.vllm_enable_sleep_mode:
        notes.append(
            "vLLM sleeps while the policy trains (level 2: its weights and KV cache freed); what it keeps asleep "
            "(CUDA graphs, buffers) is not planned"
        )
        return generation, training
    categories = dict(training["categories"])
    categories["runtime"] = categories.get("runtime", 0) + share
    kept = dict(
        training,
        device_total_bytes=training["device_total_bytes"] + share,
        categories=categories,
        planned="simulated, and vLLM's share planned only",
        drivers=list(TRAINING_DRIVERS) + list(VLLM_DRIVERS),
        vllm_bytes=share,
    )
    return generation, kept
