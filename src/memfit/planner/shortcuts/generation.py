"""grpo's generation phase at the planned completion length and the model's full depth, from a
few short simulations (:mod:`memfit.planner.exact.generation`).

Generating ``max_completion_length`` tokens under fake tensors takes a forward a token, so only a
few are generated and the rest is exact arithmetic (:func:`trace_at`): every decode step after the
first does the same operations in the same order, each storage's size affine in the step's number
(the cache, the ids and the mask grow by a token), and none outlives the step after its own. From
two generations (4 and 5 tokens) the sizes of the last two decode steps at any completion length
are written into the longer one's trace; its live bytes are then those of the full generation
wherever the peak can be (the prefill, or the last decode step, which holds the longest cache).
Where the decode steps differ from one another (a model's own cache), the whole generation is
simulated instead. Depth is extrapolated as the training step's is
(:mod:`memfit.planner.shortcuts.extrapolate`), phase by phase: ``prefill`` (the prompts' forward,
the first token), ``decode`` and ``old_logps``. Each depth's generation is kept in
:data:`~memfit.planner.shortcuts.memo.MEMO` (``generations``): a search plans one generation many
times.

An exact plan (:mod:`memfit.planner.shortcuts.switch`) takes none of this: the whole generation of
the whole model, every decode step simulated, nothing remembered. Tests check :func:`trace_at` and
the extrapolated depth against the whole.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from memfit.models.build import make_config
from memfit.planner.exact import allocator
from memfit.planner.exact.allocator import round_size
from memfit.planner.exact.generation import (
    SIMULATED_TOKENS,
    GenerationTrace,
    simulate_generation,
    whole_generation,
    with_peak,
)
from memfit.planner.exact.tracker import Allocation, TrackerResult
from memfit.planner.shortcuts.memo import MEMO, config_key
from memfit.spec import RunSpec


def trace_at(short: GenerationTrace, long: GenerationTrace, completion_tokens: int) -> TrackerResult:
    """The tracker's result of the generation of ``completion_tokens`` tokens, from the generations
    of ``short.new_tokens`` and ``long.new_tokens`` (one more) tokens: ``long``'s trace with the
    storages of its last two decode steps sized as in the last two of the longer generation.

    Raises ValueError where the decode steps do not share their structure (the model's generation
    is not one this arithmetic holds for)."""
    if long.new_tokens != short.new_tokens + 1 or short.new_tokens < 4:
        raise ValueError("trace_at needs generations of n and n + 1 tokens, n at least 4")
    if completion_tokens <= long.new_tokens:
        raise ValueError(
            f"completion_tokens {completion_tokens} is within the simulated {long.new_tokens}: simulate it"
        )
    inner = _allocs(long, len(long.forwards) - 3), _allocs(long, len(long.forwards) - 2)
    last = _allocs(short, len(short.forwards) - 1), _allocs(long, len(long.forwards) - 1)
    result = long.result
    allocations, events = list(result.allocations), list(result.events)
    for (before, after), step, at in (
        (inner, len(long.forwards) - 2, completion_tokens - 2),
        (last, len(long.forwards) - 1, completion_tokens - 1),
    ):
        for a, b in zip(before, after):
            requested = b.requested_bytes + (at - step) * (b.requested_bytes - a.requested_bytes)
            grown = dataclasses.replace(b, requested_bytes=requested, nbytes=round_size(requested))
            allocations[b.alloc_id] = grown
            if grown.place == "device":
                events[grown.alloc_event] = ("alloc", grown.alloc_id, grown.nbytes)
    grown_result = TrackerResult(
        allocations=allocations,
        events=events,
        peak=result.peak,
        outside_peaks=dict(result.outside_peaks),
        phase_marks=list(result.phase_marks),
        peak_from_event=result.peak_from_event,
    )
    return with_peak(grown_result)


def _allocs(trace: GenerationTrace, step: int) -> list[Allocation]:
    """The storages decode step ``step`` allocated, in order (the last step: through the end of ``generate``)."""
    first = trace.forwards[step]
    stop = trace.forwards[step + 1] if step + 1 < len(trace.forwards) else trace.end_event
    allocations = trace.result.allocations
    return [allocations[alloc_id] for kind, alloc_id, _ in trace.result.events[first + 1 : stop + 1] if kind == "alloc"]


def check_same_steps(short: GenerationTrace, long: GenerationTrace) -> None:
    """Raise ValueError unless the decode steps line up: the same operations, in the same order."""
    pairs = [
        (_allocs(long, len(long.forwards) - 3), _allocs(long, len(long.forwards) - 2)),
        (_allocs(short, len(short.forwards) - 1), _allocs(long, len(long.forwards) - 1)),
    ]
    for before, after in pairs:
        if [(a.op, a.role, a.place) for a in before] != [(b.op, b.role, b.place) for b in after]:
            raise ValueError("the decode steps of this model's generation differ from one another")


@dataclass(frozen=True)
class GenerationEstimate:
    """The generation phase of a grpo plan, at full depth: its peak (allocated, reserved), the
    categories then (the KV cache among ``activations``), the sub-phase it falls in, each
    sub-phase's peak, and the KV cache at the peak."""

    allocated_bytes: int
    reserved_bytes: int
    categories: dict[str, int]
    phase: str
    phase_peaks: dict[str, int]
    simulated_layers: list[int]
    kv_cache_bytes: int = 0  # the KV cache at its longest (the last decode step)


@dataclass(frozen=True)
class _Point:
    """One depth's generation at the planned length, as the depth extrapolation takes it."""

    result: TrackerResult
    phase: str
    categories: dict[str, int]
    phase_peaks: dict[str, int]
    overhead: int
    kv_cache: int = 0


def estimate_generation(
    config: dict[str, Any],
    spec: RunSpec,
    workspace_allocs: tuple[int, ...] = (),
    *,
    exact: bool = False,
    arch: str | None = None,
) -> GenerationEstimate:
    """The generation phase of ``spec``'s run on the model of ``config``, at full depth (``exact``:
    the whole model's whole generation simulated, nothing remembered)."""
    from memfit.planner.shortcuts.depths import plan_depths
    from memfit.planner.shortcuts.extrapolate import extrapolate_peak

    workspace_allocs = tuple(workspace_allocs)
    depths = None if exact else plan_depths(config)
    if depths is None:  # the model simulated whole
        point = (
            _simulated_point(config, spec, None, workspace_allocs, arch, whole=True)
            if exact
            else _point(config, spec, None, workspace_allocs, arch)
        )
        return GenerationEstimate(
            allocated_bytes=point.result.peak.allocated_bytes,
            reserved_bytes=point.result.peak.allocated_bytes + point.overhead,
            categories=dict(point.categories),
            phase=point.phase,
            phase_peaks=dict(point.phase_peaks),
            simulated_layers=[make_config(config).num_hidden_layers],
            kv_cache_bytes=point.kv_cache,
        )
    points = [_point(config, spec, cut, workspace_allocs, arch) for cut in depths.samples]
    phase, categories = extrapolate_peak(depths, points)
    phase_peaks = {k: depths.combine([p.phase_peaks.get(k, 0) for p in points]) for k in points[-1].phase_peaks}
    allocated = sum(categories.values())
    return GenerationEstimate(
        allocated_bytes=allocated,
        reserved_bytes=allocated + max(p.overhead for p in points),
        categories=categories,
        phase=phase,
        phase_peaks=phase_peaks,
        simulated_layers=[len(c) for c in depths.samples],
        kv_cache_bytes=depths.combine([p.kv_cache for p in points]),
    )


def _point(
    config: dict[str, Any],
    spec: RunSpec,
    cut: tuple[int, ...] | None,
    workspace_allocs: tuple[int, ...],
    arch: str | None,
) -> _Point:
    """One depth's generation, from the memo when it was planned before."""
    key = (config_key(config), spec.model_dump_json(), cut, workspace_allocs, arch)
    kept = MEMO.generations.get(key)
    if kept is None:
        kept = MEMO.keep("generations", key, _simulated_point(config, spec, cut, workspace_allocs, arch))
    return kept


def _simulated_point(
    config: dict[str, Any],
    spec: RunSpec,
    cut: tuple[int, ...] | None,
    workspace_allocs: tuple[int, ...],
    arch: str | None,
    *,
    whole: bool = False,
) -> _Point:
    """The generation of ``max_completion_length`` tokens at one depth: written from two short ones
    (:func:`trace_at`), or simulated whole where it is short, where its decode steps differ, or
    where asked (``whole``)."""
    tokens = spec.max_completion_length
    options = dict(layers=cut, workspace_allocs=workspace_allocs, arch=arch)
    result = None
    if tokens > SIMULATED_TOKENS[1] and not whole:
        short, long = (simulate_generation(config, spec, new_tokens=n, **options) for n in SIMULATED_TOKENS)
        try:
            check_same_steps(short, long)
            result = trace_at(short, long, tokens)
        except ValueError:
            result = None  # decode steps unlike each other (a model's own cache): the whole generation, simulated
    if result is None:
        result = whole_generation(config, spec, new_tokens=tokens, **options)
    reserved = allocator.simulate(result.events).peak_reserved_bytes
    decode = [s for s in result.segments() if s.phase == "decode"]
    kv_cache = result.categories_at(decode[-1].top_event)["activations"] if decode else 0
    return _Point(
        result=result,
        phase=result.peak.phase,
        categories=dict(result.peak.categories),
        phase_peaks=dict(result.phase_peaks),
        overhead=max(reserved - result.peak.allocated_bytes, 0),
        kv_cache=kv_cache,
    )
