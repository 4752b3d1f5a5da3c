"""The step at full depth from a few simulated depths: the layer-extrapolation arithmetic.

A model's decoder layers repeat with a period (one layer for most models, two for Gemma 2's local
and global attention): memory per period is the same for every period, so the step is simulated
(:mod:`memfit.planner.simulate`) at two and three periods and every figure is extrapolated
linearly to the full depth. The peak is not one number to extrapolate: where it lies can move with
depth, so each phase's shared head and tail of events are extrapolated and the highest moment
taken (:func:`_extrapolate_peak`). A test checks the result against the full simulation.

:func:`estimate_step` returns a :class:`StepEstimate`, the figures a plan is made of.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Callable

from memfit.planner import allocator
from memfit.spec import RunSpec

#: Maps single-GPU categories at a moment of a phase to one rank's categories.
Reshape = Callable[[dict[str, int], str], dict[str, int]]


@dataclass(frozen=True)
class StepFigures:
    """What a simulated step and the full-depth estimate made from it both report: how attention
    runs and the batches are laid out, the peaks, the categories at the allocated peak (``phase``)
    and the parameter counts."""

    attention: str
    attention_kernels: Any
    batch_layout: str
    embeddings_on_host: bool
    trained_copies: list[dict]
    allocated_bytes: int
    reserved_bytes: int
    host_peak_bytes: int
    paged_peak_bytes: int
    categories: dict[str, int]
    phase: str
    phase_peaks: dict[str, int]
    total_params: int
    trainable_params: int


@dataclass(frozen=True)
class SampledStep(StepFigures):
    """One simulation of the step at one depth, summarised: its figures and the tracker's result
    (its events)."""

    result: Any  # memfit.planner.tracker's result: the events and allocations
    chunk_loops: frozenset = frozenset()  # (rows, chunk) of the step's chunked loops


#: Simulates (or predicts) the step at one depth: (config, spec, depth, workspace_allocs, arch).
Sampler = Callable[[dict[str, Any], RunSpec, "int | None", tuple[int, ...], "str | None"], SampledStep]


@dataclass(frozen=True)
class StepEstimate(StepFigures):
    """The step of the full model, as the plan reports it (one rank's, for several GPUs).

    ``categories`` are the live device bytes by category at the peak (``phase``), which sum to
    ``allocated_bytes``; ``reserved_bytes`` adds the caching allocator's overhead (replayed, not
    extrapolated); ``single_gpu_categories`` are the categories at the single-GPU peak, before a
    multi-GPU reshape.
    """

    simulated_layers: list[int]
    num_layers: int
    single_gpu_categories: dict[str, int]


def estimate_step(
    config: dict[str, Any],
    spec: RunSpec,
    workspace_allocs: tuple[int, ...] = (),
    *,
    extrapolate: bool = True,
    reshape: Reshape | None = None,
    arch: str | None = None,
    sampler: Sampler | None = None,
) -> StepEstimate:
    """Simulate (and extrapolate) the step; return peaks, categories and counts for the full model.

    ``reshape`` maps the single-GPU categories at a moment of a phase to one rank's categories
    (:func:`memfit.planner.sharding.per_rank_categories`); the peak is then the highest moment after
    reshaping (sharding can move it, e.g. from the end of backward to its start), and
    ``single_gpu_categories`` holds the unreshaped categories at the single-GPU peak. The
    simulation itself is that of one GPU, whatever ``gpus`` and ``shard`` are: it is shared.
    ``sampler`` gives the step at one depth in place of a simulation (:mod:`memfit.planner.lengths`).
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
    sample = sampler or sample_step
    many = getattr(sampler, "sample_many", None)  # a sampler that simulates the depths side by side
    depths = list(layers or (None,))
    points = many(config, spec, depths, workspace_allocs, arch) if many else [sample(config, spec, k, workspace_allocs, arch)
                                                                                for k in depths]
    if layers is not None and len(points[0].result.segments()) != len(points[1].result.segments()):
        layers, points = None, [sample(config, spec, None, workspace_allocs, arch)]  # no common structure
    last = points[-1]
    shared = dict(simulated_layers=list(layers) if layers else [num_layers], attention=last.attention,
                  attention_kernels=last.attention_kernels, batch_layout=last.batch_layout,
                  embeddings_on_host=last.embeddings_on_host, trained_copies=last.trained_copies)
    if layers is None:
        return _whole(points[0], reshape, num_layers, **shared)
    return _extrapolated(layers, points, num_layers, reshape, **shared)


def _whole(point: SampledStep, reshape: Reshape | None, num_layers: int, **shared: Any) -> StepEstimate:
    """The step simulated at full depth (reshaped for one rank, with ``reshape``)."""
    phase, categories, phase_peaks = point.phase, point.categories, dict(point.phase_peaks)
    allocated, reserved = point.allocated_bytes, point.reserved_bytes
    if reshape is not None:
        overhead = reserved - allocated
        phase, categories, phase_peaks = _reshaped_peak(point.result, reshape)
        allocated = sum(categories.values())
        reserved = allocated + overhead
    return StepEstimate(allocated_bytes=allocated, reserved_bytes=reserved, host_peak_bytes=point.host_peak_bytes,
                        paged_peak_bytes=point.paged_peak_bytes, categories=categories, phase=phase, phase_peaks=phase_peaks,
                        total_params=point.total_params, trainable_params=point.trainable_params,
                        single_gpu_categories=dict(point.categories), num_layers=num_layers, **shared)


def _extrapolated(layers: tuple[int, int], points: list[SampledStep], num_layers: int, reshape: Reshape | None,
                  **shared: Any) -> StepEstimate:
    """The step at ``num_layers`` from the steps simulated at the two depths ``layers``."""

    def line(values: list[int]) -> int:
        return extrapolate_linear(layers, values, num_layers)

    phase, categories = _extrapolate_peak(layers, points, num_layers)
    single = dict(categories)
    # Fragmentation does not grow linearly with depth (it jumps with how blocks happen to fit in
    # segments), so the allocator's overhead is not extrapolated: the larger of the sampled
    # overheads is added to the extrapolated allocated peak.
    overhead = max(p.reserved_bytes - p.allocated_bytes for p in points)
    phase_peaks = {k: line([p.phase_peaks.get(k, 0) for p in points]) for k in points[-1].phase_peaks}
    if reshape is not None:
        # One rank's fragmentation is taken to be the single GPU's (an assumption: sharded
        # states are smaller blocks, so this errs high).
        phase, categories, phase_peaks = _extrapolate_peak(layers, points, num_layers, reshape)
    allocated = sum(categories.values())
    return StepEstimate(allocated_bytes=allocated, reserved_bytes=allocated + overhead,
                        host_peak_bytes=line([p.host_peak_bytes for p in points]),
                        paged_peak_bytes=line([p.paged_peak_bytes for p in points]), categories=categories, phase=phase,
                        phase_peaks=phase_peaks, total_params=line([p.total_params for p in points]),
                        trainable_params=line([p.trainable_params for p in points]), single_gpu_categories=single,
                        num_layers=num_layers, **shared)


def _extrapolate_peak(layers: tuple[int, int], points: list[SampledStep], num_layers: int, reshape: Reshape | None = None):
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
    shallow, deep = (p.result for p in points)
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
        return points[1].phase, dict(points[1].categories)
    return best[1], best[2]


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
    allocations = result.allocations
    if not all(allocations[i].alloc_id == i for i in (0, len(allocations) - 1) if allocations):
        allocations = {a.alloc_id: a for a in allocations}  # not listed by id (the tracker lists them so)
    out = []
    for kind, alloc_id, _ in result.events[first:stop]:
        a = allocations[alloc_id]
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


#: Simulation summaries by (config, spec, depth, workspaces): searches plan the same step many times.
_SAMPLE_CACHE: dict[tuple, SampledStep] = {}
_SAMPLE_CACHE_SIZE = 128


def sample_step(config: dict[str, Any], spec: RunSpec, num_layers: int | None, workspace_allocs: tuple[int, ...],
                arch: str | None = None) -> SampledStep:
    """Simulate (or recall) the step at one depth and summarise it: peaks, categories, counts."""
    from memfit.planner.simulate import simulate

    key = _sample_key(config, spec, num_layers, workspace_allocs, arch)
    cached = _SAMPLE_CACHE.get(key)
    if cached is None:
        cached = _summarise(simulate(config, spec, num_layers=num_layers, workspace_allocs=workspace_allocs, arch=arch))
        if len(_SAMPLE_CACHE) >= _SAMPLE_CACHE_SIZE:
            _SAMPLE_CACHE.pop(next(iter(_SAMPLE_CACHE)))
        _SAMPLE_CACHE[key] = cached
    # Callers must not change the tracker result; the dicts around it they may.
    return dataclasses.replace(cached, **{f.name: copy.deepcopy(getattr(cached, f.name))
                                          for f in dataclasses.fields(cached) if f.name != "result"})


def cached_sample(config: dict[str, Any], spec: RunSpec, num_layers: int | None, workspace_allocs: tuple[int, ...],
                  arch: str | None = None) -> SampledStep | None:
    """The step :func:`sample_step` simulated already in this process for these inputs, or None (nothing is simulated)."""
    return _SAMPLE_CACHE.get(_sample_key(config, spec, num_layers, workspace_allocs, arch))


def _sample_key(config: dict[str, Any], spec: RunSpec, num_layers: int | None, workspace_allocs: tuple[int, ...],
                arch: str | None) -> tuple:
    return (json.dumps(config, sort_keys=True, default=str), spec.model_dump_json(), num_layers, tuple(workspace_allocs), arch)


def _summarise(sim) -> SampledStep:
    result = sim.tracker
    replay = allocator.simulate(result.events)
    return SampledStep(
        result=result,
        attention=sim.attention,
        attention_kernels=sim.attention_kernels,
        batch_layout=sim.batch_layout,
        embeddings_on_host=sim.embeddings_on_host,
        trained_copies=[dict(entry) for entry in sim.trained_copies],
        allocated_bytes=result.peak.allocated_bytes,
        reserved_bytes=replay.peak_reserved_bytes,
        host_peak_bytes=result.outside_peaks.get("host", 0),
        paged_peak_bytes=result.outside_peaks.get("paged", 0),
        categories=dict(result.peak.categories),
        phase=result.peak.phase,
        phase_peaks=dict(result.phase_peaks),
        total_params=sim.total_params,
        trainable_params=sim.trainable_params,
        chunk_loops=sim.chunk_loops,
    )
