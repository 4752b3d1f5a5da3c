"""Detectors: pure functions from a recorded :class:`~memfit.watch.timeline.Timeline` to findings.

Each detector looks for one way memory goes wrong in long runs, with the thresholds of
:class:`~memfit.watch.thresholds.Thresholds` (their reasons are in docs/watch.md):

- :func:`detect_leak`: a steady climb of memory after each step;
- :func:`detect_stray_device`: memory on a device the run was not asked to use;
- :func:`detect_other_processes`: other processes holding memory on the run's device;
- :func:`detect_fragmentation`: the allocator reserving far more than the step ever used;
- :func:`detect_longer_completions`: a grpo run's peak rising step after step with its longest
  completion, which is not a leak (said so, as information).

Plan-versus-measured checks are in :mod:`memfit.watch.compare`; checks that need the live model
(checkpointing switched off, frozen weights that train) are :func:`inspect_model`, the one function
here that touches torch (imported inside it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from memfit.units import MiB, format_bytes
from memfit.watch.thresholds import Thresholds
from memfit.watch.timeline import Finding, Timeline, merge_findings

HOST = "host"


# ------------------------------------------------------------------------------------------------
# Series and slopes


@dataclass(frozen=True)
class Point:
    step: int
    value: int


#: Host measures, in the order the leak detector trusts them: the malloc heap in use is exact
#: (RSS stays flat while freed-but-resident pages are reused); RSS also sees Python's own objects.
HOST_MEASURES = {"heap_bytes": "malloc heap in use", "rss_bytes": "process RSS"}


def series(timeline: Timeline, where: str, key: str = "rss_bytes") -> list[Point]:
    """Memory after each step: a host measure (``where="host"``, ``key`` one of
    :data:`HOST_MEASURES`), or a CUDA device's allocated bytes (falling back to NVML's bytes of
    this process when PyTorch's counters are absent)."""
    points = []
    for record in timeline.steps:
        step = record.get("step")
        if not isinstance(step, int):
            continue
        if where == HOST:
            value = record.get(key)
        else:
            entry = record.get("devices", {}).get(where, {})
            value = entry.get("allocated_bytes", entry.get("process_bytes"))
        if isinstance(value, (int, float)):
            points.append(Point(step, int(value)))
    return points


def theil_sen_slope(points: list[Point], max_points: int = 120) -> float:
    """Median of the slopes between every pair of points (Theil-Sen): bytes per step.

    Robust to outliers: up to ~29% of the points can be anything without moving it much, so an
    odd step (evaluation, a checkpoint save) does not fake or hide a climb. Long series are thinned
    evenly to ``max_points`` to keep the pair count small.
    """
    if len(points) > max_points:
        stride = (len(points) - 1) / (max_points - 1)
        points = [points[round(i * stride)] for i in range(max_points)]
    slopes = []
    for i, a in enumerate(points):
        for b in points[i + 1 :]:
            if b.step != a.step:
                slopes.append((b.value - a.value) / (b.step - a.step))
    if not slopes:
        return 0.0
    slopes.sort()
    mid = len(slopes) // 2
    return slopes[mid] if len(slopes) % 2 else (slopes[mid - 1] + slopes[mid]) / 2


def steps_until_full(free_bytes: int, slope_bytes_per_step: float) -> int | None:
    """Steps until ``free_bytes`` are used up at ``slope_bytes_per_step`` (None when not growing)."""
    if slope_bytes_per_step <= 0:
        return None
    return max(0, math.ceil(free_bytes / slope_bytes_per_step))


# ------------------------------------------------------------------------------------------------
# Leak


_LEAK_FIX = (
    "Something keeps tensors alive from one step to the next. Look for lists or dicts that collect "
    "tensors across steps (losses.append(loss) instead of loss.item(), metrics or outputs kept for "
    "logging, a cache that only grows) and store Python numbers (.item()) or detached CPU copies "
    "instead; clear such collections after logging. `memfit report` shows where the climb starts."
)


def detect_leak(timeline: Timeline, thresholds: Thresholds = Thresholds()) -> list[Finding]:
    """A sustained climb of memory after each step, past warm-up, on the host or any CUDA device.

    The slope is Theil-Sen over the latest ``leak_window`` post-warm-up steps; it must exceed the
    threshold overall, hold in both halves of the window, and add up to a minimum growth.
    """
    t = thresholds
    findings = []
    candidates = [(HOST, key) for key in HOST_MEASURES] + [(name, "") for name in timeline.device_names()]
    seen: set[str] = set()
    for where, key in candidates:
        if where in seen:
            continue  # the host's heap already showed the climb; RSS would repeat it
        points = series(timeline, where, key) if where == HOST else series(timeline, where)
        if not points:
            continue
        first = points[0].step
        window = [p for p in points if p.step >= first + t.leak_warmup_steps][-t.leak_window :]
        if len(window) < t.leak_min_points:
            continue
        threshold = t.host_leak_bytes_per_step if where == HOST else t.device_leak_bytes_per_step
        min_growth = t.host_leak_min_growth_bytes if where == HOST else t.device_leak_min_growth_bytes
        slope = theil_sen_slope(window)
        half = len(window) // 2
        halves = (theil_sen_slope(window[:half]), theil_sen_slope(window[half:]))
        growth = slope * (window[-1].step - window[0].step)
        if slope < threshold or min(halves) < t.leak_half_fraction * threshold or growth < min_growth:
            continue
        seen.add(where)
        findings.append(_leak_finding(timeline, where, key, window, slope, growth, t))
    return findings


def _leak_finding(
    timeline: Timeline, where: str, key: str, window: list[Point], slope: float, growth: float, t: Thresholds
) -> Finding:
    last = timeline.steps[-1]
    last_step = window[-1].step
    if where == HOST:
        free = last.get("host_available_bytes")
        capacity_text = "host RAM"
        label = f"host memory ({HOST_MEASURES[key]})"
    else:
        entry = last.get("devices", {}).get(where, {})
        capacity = (timeline.start.get("device_capacity_bytes") or {}).get(where) or entry.get("total_bytes")
        used = entry.get("nvml_used_bytes", entry.get("reserved_bytes", window[-1].value))
        free = capacity - used if capacity else None
        capacity_text = f"{where} ({format_bytes(capacity)})" if capacity else where
        label = f"{where} allocated memory"
    left = steps_until_full(free, slope) if free is not None else None
    full_at = last_step + left if left is not None else None
    total = timeline.total_steps
    rate_mib = slope / MiB
    message = (
        f"{label} grows by {rate_mib:.2f} MiB per step (steps {window[0].step}-{last_step}, "
        f"{format_bytes(int(growth))} in all)"
    )
    if full_at is not None:
        message += f"; at this rate {capacity_text} is full at step {full_at:,}"
        if total and full_at <= total:
            message += f", before the run ends (step {total:,})"
    message += "."
    if total and full_at is not None:
        severe = full_at <= total
    else:
        severe = left is not None and left <= t.leak_error_horizon_steps
    return Finding(
        severity="error" if severe else "warning",
        code="leak",
        message=message,
        fix=_LEAK_FIX,
        step=window[0].step,
        data={
            "device": where,
            "measure": key or "allocated_bytes",
            "bytes_per_step": round(slope, 1),
            "mib_per_step": round(rate_mib, 4),
            "first_step": window[0].step,
            "last_step": last_step,
            "growth_bytes": int(growth),
            "free_bytes": free,
            "full_at_step": full_at,
        },
    )


# ------------------------------------------------------------------------------------------------
# Devices


def detect_stray_device(timeline: Timeline, thresholds: Thresholds = Thresholds()) -> list[Finding]:
    """Memory on a CUDA device the run was not asked to use (tensors, or a CUDA context)."""
    expected = set(timeline.expected_devices)
    if not expected:
        return []  # without knowing where the run should be, nothing is stray
    run_on = ", ".join(sorted(expected))
    findings = []
    for name in timeline.device_names():
        if name in expected:
            continue
        first_tensor = first_context = None
        max_allocated = max_process = 0
        for record in timeline.steps:
            entry = record.get("devices", {}).get(name, {})
            allocated = int(entry.get("allocated_bytes") or 0)
            process = int(entry.get("process_bytes") or 0)
            if allocated > 0 and first_tensor is None:
                first_tensor = record.get("step")
            if process >= thresholds.stray_context_bytes and first_context is None:
                first_context = record.get("step")
            max_allocated = max(max_allocated, allocated)
            max_process = max(max_process, process)
        fix = (
            f"Make the run's device current before anything touches CUDA (torch.cuda.set_device('{sorted(expected)[0]}')), "
            "create tensors with device=<the run's device> rather than 'cuda' (which means the current device, cuda:0 by default), "
            f"or hide the other GPUs (CUDA_VISIBLE_DEVICES) so the process cannot reach {name}."
        )
        if first_tensor is not None:
            findings.append(
                Finding(
                    severity="error" if max_allocated >= thresholds.stray_error_bytes else "warning",
                    code="stray_device",
                    message=(
                        f"PyTorch holds tensors on {name} (up to {format_bytes(max_allocated)}, from step {first_tensor}), "
                        f"but the run is on {run_on}: some tensors or a library put memory on the wrong GPU."
                    ),
                    fix=fix,
                    step=first_tensor,
                    data={
                        "device": name,
                        "max_allocated_bytes": max_allocated,
                        "max_process_bytes": max_process,
                        "expected": sorted(expected),
                    },
                )
            )
        elif first_context is not None:
            findings.append(
                Finding(
                    severity="warning",
                    code="stray_device",
                    message=(
                        f"this process holds {format_bytes(max_process)} on {name} (a CUDA context: no tensors), "
                        f"but the run is on {run_on}: something initialised CUDA on {name}."
                    ),
                    fix=fix,
                    step=first_context,
                    data={
                        "device": name,
                        "max_allocated_bytes": 0,
                        "max_process_bytes": max_process,
                        "expected": sorted(expected),
                    },
                )
            )
    return findings


def detect_other_processes(timeline: Timeline, thresholds: Thresholds = Thresholds()) -> list[Finding]:
    """Other processes holding memory on the run's own device: the run has that much less room."""
    findings = []
    for name in timeline.device_names():
        if timeline.expected_devices and name not in timeline.expected_devices:
            continue
        held = [
            (r.get("step"), int(r.get("devices", {}).get(name, {}).get("other_processes_bytes") or 0))
            for r in timeline.steps
        ]
        worst_step, worst = max(held, key=lambda x: x[1], default=(None, 0))
        if worst < thresholds.other_processes_bytes:
            continue
        findings.append(
            Finding(
                severity="warning",
                code="other_processes",
                message=f"other processes hold up to {format_bytes(worst)} on {name} (step {worst_step}); the plan's headroom is smaller by that much.",
                fix="Stop the other jobs on this GPU (nvidia-smi lists them), or plan against a --budget that leaves their memory out.",
                step=worst_step,
                data={"device": name, "other_processes_bytes": worst},
            )
        )
    return findings


def detect_fragmentation(timeline: Timeline, thresholds: Thresholds = Thresholds()) -> list[Finding]:
    """The caching allocator reserving far more than the run ever had allocated at once, for long.

    Reserved minus the peak allocated so far is memory the allocator keeps but could not reuse for
    a request: blocks split into sizes later requests do not fit (varying sequence lengths make
    every step ask for new sizes).
    """
    t = thresholds
    findings = []
    for name in timeline.device_names():
        best_run: list[tuple[int, int, int]] = []
        run: list[tuple[int, int, int]] = []
        for record in timeline.steps:
            entry = record.get("devices", {}).get(name, {})
            reserved, peak = entry.get("reserved_bytes"), entry.get("peak_allocated_bytes")
            if reserved is None or peak is None:
                continue
            excess = int(reserved) - int(peak)
            if excess >= max(t.fragmentation_min_bytes, t.fragmentation_fraction * reserved):
                run.append((record.get("step"), int(reserved), excess))
                if len(run) > len(best_run):
                    best_run = list(run)
            else:
                run = []
        if len(best_run) < t.fragmentation_min_steps:
            continue
        worst = max(best_run, key=lambda x: x[2])
        findings.append(
            Finding(
                severity="warning",
                code="fragmentation",
                message=(
                    f"{name}: the allocator reserved up to {format_bytes(worst[2])} more than the peak ever allocated "
                    f"({format_bytes(worst[1])} reserved at step {worst[0]}) for {len(best_run)} steps in a row "
                    f"(steps {best_run[0][0]}-{best_run[-1][0]}): memory lost to fragmentation."
                ),
                fix=(
                    "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (segments grow instead of splitting); "
                    "make batch shapes repeat (pack sequences, or pad to a few fixed lengths); do not call "
                    "torch.cuda.empty_cache() inside the loop."
                ),
                step=best_run[0][0],
                data={"device": name, "steps": len(best_run), "max_excess_bytes": worst[2], "reserved_bytes": worst[1]},
            )
        )
    return findings


# ------------------------------------------------------------------------------------------------
# grpo: the peak follows the completions


def detect_longer_completions(timeline: Timeline, thresholds: Thresholds = Thresholds()) -> list[Finding]:
    """A grpo run's device peak rising after its first step, each time at a step whose prompt and completion
    (``longest_sequence``) is longer than any before it: the step's memory follows its longest
    sequence, up to ``seq_len``, which the plan holds; memory that is not a leak, said so (info).
    A rise at a step without a longer sequence is left to :func:`detect_leak`."""
    lengths = {
        r["step"]: r["extra"]["longest_sequence"]
        for r in timeline.steps
        if isinstance(r.get("extra"), dict) and isinstance(r["extra"].get("longest_sequence"), int)
    }
    if not lengths:
        return []
    findings = []
    for where in timeline.device_names():
        rises, peak, longest, first = [], None, 0, None
        for record in timeline.steps:
            step = record.get("step")
            value = (record.get("devices", {}).get(where) or {}).get("peak_allocated_bytes")
            length = lengths.get(step)
            if not isinstance(value, int) or length is None:
                continue
            if peak is not None and value > peak:
                if length <= longest:
                    rises = []  # a rise no longer sequence explains: not this finding
                    break
                rises.append((step, value, length))
                first = first if first is not None else (step, peak, longest)
            peak, longest = value if peak is None else max(peak, value), max(longest, length)
        if rises:
            findings.append(_longer_completions_finding(where, first, rises))
    return findings


def _longer_completions_finding(where: str, first: tuple[int, int, int], rises: list[tuple[int, int, int]]) -> Finding:
    step, value, length = rises[-1]
    return Finding(
        severity="info",
        code="longer_completions",
        message=(
            f"{where}'s peak memory rose at {len(rises)} steps, from {format_bytes(first[1])} to {format_bytes(value)} "
            f"(steps {rises[0][0]}-{step}), each time with a longer prompt and completion than before ({first[2]} to "
            f"{length} tokens): this is not a leak, the step's memory follows its longest completion"
        ),
        fix="Nothing to fix: the plan's training phase is for the longest, seq_len (prompt budget + max_completion_length). "
        "To keep the peak lower, lower max_completion_length (memfit plan shows the generation and the training at it).",
        step=rises[0][0],
        data={
            "device": where,
            "rises": len(rises),
            "from_bytes": first[1],
            "to_bytes": value,
            "from_tokens": first[2],
            "to_tokens": length,
        },
    )


def detect_all(
    timeline: Timeline, plan: dict[str, Any] | None = None, thresholds: Thresholds = Thresholds()
) -> list[Finding]:
    """Every timeline detector, plus plan-versus-measured when a plan is known; most important first."""
    from memfit.watch.compare import detect_above_plan

    plan = plan if plan is not None else timeline.plan
    found = (
        detect_leak(timeline, thresholds)
        + detect_stray_device(timeline, thresholds)
        + detect_other_processes(timeline, thresholds)
        + detect_fragmentation(timeline, thresholds)
        + detect_longer_completions(timeline, thresholds)
        + detect_above_plan(timeline, plan, thresholds)
    )
    return merge_findings(found)


# ------------------------------------------------------------------------------------------------
# The live model


def inspect_model(model: Any, spec: Any = None) -> list[Finding]:
    """Check a model about to train for settings that silently cost memory.

    ``spec`` is a :class:`~memfit.spec.RunSpec`, a dict with some of its keys (``method``,
    ``checkpointing``), or None (the method is then inferred: a PEFT model trains adapters, and
    checkpointing is expected where the model says it enabled it). Finds:

    - a custom module wrapped around the transformers / PEFT model (``wrapped_model``);
    - activation checkpointing asked for but off in decoder layers, or the model in eval mode
      (``checkpointing_inactive``);
    - frozen base weights that train (``frozen_trainable``) or hold gradients (``frozen_gradients``);
    - a trainable parameter count other than the method implies (``trainable_count``).
    """
    knobs = _spec_dict(spec)
    inner = _inner_model(model)
    method = knobs.get("method") or ("lora" if _contains_peft(model) else None)
    params = list(model.named_parameters())
    found = [
        _wrapped_model_finding(model, inner),
        _inactive_checkpointing_finding(model, inner, knobs.get("checkpointing")),
        _frozen_gradients_finding(params),
        _trainable_finding(model, params, method),
    ]
    return [finding for finding in found if finding is not None]


def _wrapped_model_finding(model: Any, inner: Any) -> Finding | None:
    """``wrapped_model``: ``model`` is a custom module around the transformers / PEFT model ``inner``."""
    if inner is None or inner is model or _is_known_model(model):
        return None
    return Finding(
        severity="warning",
        code="wrapped_model",
        message=(
            f"the model is a {type(model).__name__} wrapped around a {type(inner).__name__}: "
            "gradient_checkpointing_enable, PEFT and Trainer features act on the outer object and can silently miss the inner model."
        ),
        fix="Pass the transformers / PEFT model itself to the trainer; put custom logic in a loss function (compute_loss) instead of a wrapper.",
        data={"outer": type(model).__name__, "inner": type(inner).__name__},
    )


def _inactive_checkpointing_finding(model: Any, inner: Any, want: Any) -> Finding | None:
    """``checkpointing_inactive``: checkpointing is wanted (``want``, the spec's ``checkpointing``;
    None: as the model says) but some decoder layers have it off or are in eval mode."""
    from memfit.models.layers import decoder_layers

    try:
        layers = list(decoder_layers(model))
    except Exception:  # noqa: BLE001 - a model whose layers cannot be found is checked without them
        layers = []
    wants_checkpointing = (want not in (None, "off")) if want is not None else _says_checkpointing(inner)
    if not (layers and wants_checkpointing):
        return None
    on = [layer for layer in layers if getattr(layer, "gradient_checkpointing", False)]
    off_count = len(layers) - len(on)
    not_training = [layer for layer in on if not layer.training]
    if not (off_count or not_training):
        return None
    why = (
        f"off in {off_count} of {len(layers)} decoder layers"
        if off_count
        else f"flagged on, but {len(not_training)} of {len(layers)} decoder layers are in eval mode (checkpointing only runs in training mode)"
    )
    return Finding(
        severity="error",
        code="checkpointing_inactive",
        message=f"activation checkpointing was asked for but is {why}: activations will take far more memory than planned.",
        fix=(
            "Enable it on the model that trains (model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})) "
            "after any wrapping, do not call gradient_checkpointing_disable() in wrappers, and call model.train() before training."
        ),
        data={"layers": len(layers), "layers_off": off_count, "layers_in_eval": len(not_training)},
    )


def _frozen_gradients_finding(params: list[tuple[str, Any]]) -> Finding | None:
    """``frozen_gradients``: parameters that do not train but still hold a gradient."""
    frozen_with_grad = [(n, p) for n, p in params if not p.requires_grad and p.grad is not None]
    if not frozen_with_grad:
        return None
    first = frozen_with_grad[0][0]
    nbytes = sum(p.grad.numel() * p.grad.element_size() for _, p in frozen_with_grad)
    return Finding(
        severity="warning",
        code="frozen_gradients",
        message=f"{len(frozen_with_grad)} frozen parameters still hold gradients ({format_bytes(nbytes)}; first: {first}).",
        fix="Set their .grad to None (optimizer.zero_grad(set_to_none=True) only clears parameters it optimizes).",
        data={"count": len(frozen_with_grad), "bytes": nbytes, "first": first},
    )


def _trainable_finding(model: Any, params: list[tuple[str, Any]], method: str | None) -> Finding | None:
    """What trains against what ``method`` trains: base weights that train under an adapter method
    (``frozen_trainable``), else a trainable count other than the method implies (``trainable_count``)."""
    from memfit.spec import ADAPTER_METHODS
    from memfit.step.prepare import expected_adapter_parameters

    trainable = sum(p.numel() for _, p in params if p.requires_grad)
    if method in ADAPTER_METHODS:
        # Copies PEFT trains for modules_to_save are the adapter's own, not base weights.
        base_trainable = [
            (n, p) for n, p in params if p.requires_grad and "lora_" not in n and ".modules_to_save." not in n
        ]
        if base_trainable:
            return _frozen_trainable_finding(method, base_trainable)
        expected = expected_adapter_parameters(model)
        if expected and trainable != expected:
            return _trainable_count_finding(method, trainable, expected)
        return None
    total = sum(p.numel() for _, p in params)
    if method == "full" and trainable != total:
        return _trainable_count_finding(method, trainable, total)
    return None


def _frozen_trainable_finding(method: str, base_trainable: list[tuple[str, Any]]) -> Finding:
    count = sum(p.numel() for _, p in base_trainable)
    nbytes = sum(p.numel() * p.element_size() for _, p in base_trainable)
    return Finding(
        severity="error",
        code="frozen_trainable",
        message=(
            f"{len(base_trainable)} base weights that {method} keeps frozen have requires_grad=True "
            f"({count:,} parameters, {format_bytes(nbytes)}; first: {base_trainable[0][0]}): each also gets a gradient "
            "and optimizer states, several times its own size."
        ),
        fix=(
            "Freeze them (p.requires_grad_(False)) before creating the optimizer, or list them in LoRA's "
            "modules_to_save if they are meant to train (then plan with --method full for those)."
        ),
        data={"count": len(base_trainable), "parameters": count, "bytes": nbytes, "first": base_trainable[0][0]},
    )


def _trainable_count_finding(method: str, trainable: int, expected: int) -> Finding:
    return Finding(
        severity="warning",
        code="trainable_count",
        message=f"{trainable:,} parameters train, but {method} implies {expected:,}: the plan counted gradients and optimizer states for {expected:,}.",
        fix=f"Check which parameters have requires_grad=True (print [n for n, p in model.named_parameters() if p.requires_grad]) against --method {method}.",
        data={"trainable": trainable, "expected": expected, "method": method},
    )


def _says_checkpointing(model: Any) -> bool:
    """Whether the model reports checkpointing enabled (transformers 5 renamed the property)."""
    from transformers import PreTrainedModel

    # A PeftModel forwards attributes to the model inside; ask the transformers model directly.
    base = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None) if model is not None else None
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if base is not None and hasattr(type(base), name):
            return bool(getattr(base, name))
    return False


def _spec_dict(spec: Any) -> dict[str, Any]:
    if spec is None:
        return {}
    if isinstance(spec, dict):
        return dict(spec)
    if hasattr(spec, "knobs"):
        return spec.knobs()
    raise TypeError(f"inspect_model: spec must be a RunSpec, a dict or None, not {type(spec).__name__}")


def _is_known_model(module: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover
        PeftModel = ()
    from transformers import PreTrainedModel

    return isinstance(module, (PreTrainedModel, PeftModel) if PeftModel else PreTrainedModel)


def _inner_model(model: Any):
    """The outermost transformers / PEFT model inside ``model`` (``model`` itself if it is one)."""
    for module in model.modules():
        if _is_known_model(module):
            return module
    return None


def _contains_peft(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(m, PeftModel) for m in model.modules())
