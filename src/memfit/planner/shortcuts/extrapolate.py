"""The step at full depth from a few simulated depths: the layer-extrapolation arithmetic.

Memory per decoder layer is the same for every layer of a kind, so the step is simulated
(:mod:`memfit.planner.exact.simulate`) on a few cut-down models: two and three layers of a model of one
kind; for a hybrid (Mamba or linear attention beside attention, experts beside dense MLPs) a base
that holds every kind and, for each kind, the base with one more layer of it
(:mod:`memfit.planner.shortcuts.depths`). Every figure is extrapolated to the full depth, counting each
kind by its number in the full model. The peak is not one number to extrapolate: where it lies can move with
depth, so every moment of the full step is extrapolated and the highest taken
(:mod:`memfit.planner.shortcuts.peaks`). Tests check the result against the exact plan.

:func:`estimate_step` returns a :class:`StepEstimate`, the figures a plan is made of.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memfit.planner.shortcuts.depths import DepthPlan
from memfit.planner.shortcuts.memo import MEMO, config_key
from memfit.planner.shortcuts.peaks import Reshape, highest_moment, phase_tops, reshaped_peak
from memfit.spec import RunSpec


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

    result: Any  # memfit.planner.exact.tracker's result: the events and allocations
    chunk_loops: frozenset = frozenset()  # (rows, chunk) of the step's chunked loops
    adapted: tuple[str, ...] = ()  # short names of the modules carrying LoRA adapters
    adapter_bytes: dict = dataclasses.field(default_factory=dict)  # the simulation's (SimulationResult.adapter_bytes)

    @property
    def reserved_bytes(self) -> int:
        """What the caching allocator's model reserves at its highest over this depth's events
        (replayed when first asked, once per result)."""
        return self.result.reserved_bytes()


#: Simulates (or predicts) the step of one cut (the full model's layer indices it copies, None for
#: all): (config, spec, cut, workspace_allocs, arch).
Sampler = Callable[[dict[str, Any], RunSpec, "tuple[int, ...] | None", tuple[int, ...], "str | None"], SampledStep]


@dataclass(frozen=True)
class StepEstimate(StepFigures):
    """The step of the full model, as the plan reports it (one rank's, for several GPUs).

    ``categories`` are the live device bytes by category at the peak (``phase``), which sum to
    ``allocated_bytes``; ``reserved_bytes`` adds the caching allocator's overhead (replayed, not
    extrapolated); ``single_gpu_categories`` are the categories at the single-GPU peak, before a
    multi-GPU reshape.
    """

    reserved_bytes: int
    simulated_layers: list[int]
    num_layers: int
    single_gpu_categories: dict[str, int]
    layer_kinds: list[dict] = dataclasses.field(
        default_factory=list
    )  # {"kind", "layers"} of each kind of decoder layer
    adapted: tuple[str, ...] = ()  # short names of the modules carrying LoRA adapters
    #: With adapters: the trainable parameters on the experts and off them, their elements and bytes
    #: (weights, gradients, optimizer states) in the full model: the simulations' counts, extrapolated.
    adapter_bytes: dict = dataclasses.field(default_factory=dict)
    #: What a vision-language model's tower and projector keep for backward from one forward (within
    #: ``categories["activations"]``; the same at every depth of the language model).
    vision_activation_bytes: int = 0


def estimate_step(
    config: dict[str, Any],
    spec: RunSpec,
    workspace_allocs: tuple[int, ...] = (),
    *,
    reshape: Reshape | None = None,
    arch: str | None = None,
    sampler: Sampler | None = None,
    exact: bool = False,
) -> StepEstimate:
    """Simulate (and extrapolate) the step; return peaks, categories and counts for the full model.

    ``reshape`` maps the single-GPU categories at a moment of a phase to one rank's categories
    (:func:`memfit.planner.sharding.per_rank_categories`); the peak is then the highest moment after
    reshaping (sharding can move it, e.g. from the end of backward to its start), and
    ``single_gpu_categories`` holds the unreshaped categories at the single-GPU peak. The
    simulation itself is that of one GPU, whatever ``gpus`` and ``shard`` are: it is shared.
    ``sampler`` gives the step at one depth in place of a simulation (:mod:`memfit.planner.shortcuts.lengths`).
    ``exact``: the whole depth simulated with no shortcut (:func:`exact_step`), nothing remembered
    (``sampler`` is then not used).
    """
    from memfit.models.layer_kinds import layer_pattern
    from memfit.planner.shortcuts.depths import plan_depths

    if spec.gpus != 1 or spec.shard != "none":
        # One rank's step, the same for every count and mode (so it is simulated once). gpus stays
        # above 1 because placement differs there: under FSDP the input embeddings stay on the
        # device, in the root group, where one GPU keeps a frozen table in host memory.
        spec = spec.model_copy(update={"gpus": 2, "shard": "none"})
    pattern = layer_pattern(config)
    num_layers = pattern.num_layers
    depths = None if exact else plan_depths(config)
    sample = exact_step if exact else sampler or sample_step
    many = getattr(sample, "sample_many", None)  # a sampler that simulates the depths side by side
    cuts = list(depths.samples) if depths else [None]
    points = (
        many(config, spec, cuts, workspace_allocs, arch)
        if many
        else [sample(config, spec, cut, workspace_allocs, arch) for cut in cuts]
    )
    if depths is not None and len({len(p.result.segments()) for p in points}) > 1:
        depths, points = None, [sample(config, spec, None, workspace_allocs, arch)]  # no common structure
    last = points[-1]
    shared = dict(
        simulated_layers=depths.sizes if depths else [num_layers],
        attention=last.attention,
        attention_kernels=last.attention_kernels,
        batch_layout=last.batch_layout,
        embeddings_on_host=last.embeddings_on_host,
        trained_copies=last.trained_copies,
        layer_kinds=_kind_counts(pattern),
        adapted=last.adapted,
        vision_activation_bytes=last.result.vision_activation_bytes(),
    )
    if depths is None:
        return _whole(points[0], reshape, num_layers, remember=not exact, **shared)
    # A sampler that only steers a search (LengthSampler.steering) spares the full depth's replay.
    replayed = not getattr(sampler, "steers_only", False)
    return _extrapolated(depths, points, num_layers, reshape, replayed=replayed, **shared)


def _kind_counts(pattern) -> list[dict[str, Any]]:
    """The model's kinds of decoder layer and how many of each it stacks (one entry for most models)."""
    return [{"kind": pattern.names[kind], "layers": count} for kind, count in pattern.counts().items()]


def _whole(
    point: SampledStep, reshape: Reshape | None, num_layers: int, *, remember: bool = True, **shared: Any
) -> StepEstimate:
    """The step simulated at full depth (reshaped for one rank, with ``reshape``; ``remember``: its
    category series kept in the memo)."""
    phase, categories, phase_peaks = point.phase, point.categories, dict(point.phase_peaks)
    allocated, reserved = point.allocated_bytes, point.reserved_bytes
    if reshape is not None:
        overhead = reserved - allocated
        phase, categories, phase_peaks = reshaped_peak(point.result, reshape, remember)
        allocated = sum(categories.values())
        reserved = allocated + overhead
    return StepEstimate(
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        host_peak_bytes=point.host_peak_bytes,
        paged_peak_bytes=point.paged_peak_bytes,
        categories=categories,
        phase=phase,
        phase_peaks=phase_peaks,
        total_params=point.total_params,
        trainable_params=point.trainable_params,
        adapter_bytes=copy.deepcopy(point.adapter_bytes),
        single_gpu_categories=dict(point.categories),
        num_layers=num_layers,
        **shared,
    )


def _extrapolated(
    depths: DepthPlan,
    points: list[SampledStep],
    num_layers: int,
    reshape: Reshape | None,
    *,
    replayed: bool = True,
    **shared: Any,
) -> StepEstimate:
    """The step at ``num_layers`` from the steps simulated at the cuts of ``depths``; without
    ``replayed``, the allocator's overhead is the samples' largest (a search's steering estimate)."""

    def line(values: list[int]) -> int:
        return depths.combine(values)

    phase, categories, moments, _ = _highest_moment(depths, points)
    single = dict(categories)
    # Fragmentation does not grow linearly with depth (it jumps with how blocks happen to fit in
    # segments), so the allocator's overhead is not extrapolated: the allocator's model replays the
    # full depth's events, made from the samples'.
    single_allocated = sum(categories.values())
    reserved, full_phase_peaks = (
        _full_depth(depths, points, single_allocated) if replayed else _overhead(points, single_allocated)
    )
    overhead = reserved - single_allocated
    complete: set[str] = set()
    if reshape is not None:
        # One rank's fragmentation is taken to be the single GPU's (an assumption: sharded
        # states are smaller blocks, so this errs high).
        phase, categories, moments, complete = _highest_moment(depths, points, reshape)
        sampled = _reshaped_phase_peaks(depths, points, reshape)
    else:
        sampled = {k: line([p.phase_peaks.get(k, 0) for p in points]) for k in points[-1].phase_peaks}
    # A phase's highest moment (memfit.planner.shortcuts.peaks), or its samples' own highest,
    # extrapolated, where that is higher: in a phase weighed at its head and tail only (the
    # optimizer's multi-tensor ops allocate for every layer in turn, op after op) the highest can
    # lie between them. (With one kind of layer neither is above the full step's highest: the
    # second, the samples' highest extrapolated with a weight of one or more, is at most the full
    # step's at the moment the deeper sample is highest.) One rank's phase weighed at every moment
    # has its highest read off them.
    phase_peaks = {k: moments[k] if k in complete else max(v, moments.get(k, 0)) for k, v in sampled.items()}
    if reshape is None and full_phase_peaks is not None:
        phase_peaks = full_phase_peaks  # read off the full depth's events: every moment of every phase
    allocated = sum(categories.values())
    return StepEstimate(
        allocated_bytes=allocated,
        reserved_bytes=allocated + overhead,
        host_peak_bytes=line([p.host_peak_bytes for p in points]),
        paged_peak_bytes=line([p.paged_peak_bytes for p in points]),
        categories=categories,
        phase=phase,
        phase_peaks=phase_peaks,
        total_params=line([p.total_params for p in points]),
        trainable_params=line([p.trainable_params for p in points]),
        adapter_bytes={
            group: {key: line([p.adapter_bytes[group][key] for p in points]) for key in counts}
            for group, counts in points[-1].adapter_bytes.items()
        },
        single_gpu_categories=single,
        num_layers=num_layers,
        **shared,
    )


def _full_depth(
    depths: DepthPlan, points: list[SampledStep], allocated_bytes: int
) -> tuple[int, dict[str, int] | None]:
    """The bytes the caching allocator reserves at its highest over the full depth's events, and
    each phase's highest live bytes (:mod:`memfit.planner.shortcuts.depth_stream`); where the
    samples are not the base with blocks inserted, the samples' largest overhead over the full
    depth's ``allocated_bytes``, and no phase's highest. Kept in the memo by the samples' results (a
    search plans some configurations twice: to check a prediction, under two methods' names)."""
    from memfit.planner.shortcuts.depth_stream import NotInserted, full_depth_stream

    results = tuple(p.result for p in points)
    key = (depths, tuple(id(r) for r in results))
    kept = MEMO.full_depths.get(key)
    if kept is not None and all(a is b for a, b in zip(kept[0], results)):
        return kept[1][0], dict(kept[1][1])
    try:
        found = full_depth_stream(depths, list(results)).replay()
    except NotInserted:
        return _overhead(points, allocated_bytes)
    MEMO.keep("full_depths", key, (results, found))  # (the results kept with it: ids are not reused while they live)
    return found[0], dict(found[1])


def _reshaped_phase_peaks(depths: DepthPlan, points: list[SampledStep], reshape: Reshape) -> dict[str, int]:
    """Each phase's highest for one rank, from the samples' own highest moments: their single-GPU
    categories extrapolated, then ``reshape``d (a rank's bytes round each category up, a shard of an
    odd size, which a line through the samples' reshaped bytes would not follow to the byte)."""
    tops = [phase_tops(p.result, reshape) for p in points]
    out = {}
    for phase, (_, _, last) in tops[-1].items():
        at = [top.get(phase, (0, 0, {}))[2] for top in tops]
        categories = {name: max(depths.combine([c.get(name, 0) for c in at]), 0) for name in last}
        out[phase] = sum(reshape(categories, phase).values())
    return out


def _overhead(points: list[SampledStep], allocated_bytes: int) -> tuple[int, None]:
    """Reserved bytes as ``allocated_bytes`` and the samples' largest allocator overhead (no phase's
    highest): where the full depth is not replayed."""
    return allocated_bytes + max(p.reserved_bytes - p.allocated_bytes for p in points), None


def _highest_moment(depths: DepthPlan, points: list[SampledStep], reshape: Reshape | None = None):
    """Phase and categories at the peak of the full-depth step, and each phase's highest, from the
    sampled cuts (:func:`memfit.planner.shortcuts.peaks.highest_moment`).

    Where the peak lies can move with depth: in full fine-tuning the start of backward (logits,
    every layer's activations) is highest for a few layers, the end of backward (every gradient)
    for many; within a layer's backward (its recomputation, a tiled MLP's chunks) for others. So the
    peak is not extrapolated as one number: every moment of the full step is, and the highest taken.
    Without a phase the samples share, the last sample's own peak.
    """
    found = highest_moment(depths, [p.result for p in points], reshape)
    if found is not None:
        return found
    if reshape is not None:
        return (*reshaped_peak(points[-1].result, reshape), set())
    return points[-1].phase, dict(points[-1].categories), dict(points[-1].phase_peaks), set()


def extrapolate_peak(depths: DepthPlan, points: list) -> tuple[str, dict[str, int]]:
    """(phase, categories) at the highest moment of the full-depth run from the simulations of the
    cuts of ``depths`` (anything with a tracker ``result``, a ``phase``, ``categories`` and
    ``phase_peaks``): the depth arithmetic of the step (:func:`_highest_moment`), for other simulated
    phases (grpo's generation)."""
    phase, categories, _, _ = _highest_moment(depths, points)
    return phase, categories


def sample_step(
    config: dict[str, Any],
    spec: RunSpec,
    layers: tuple[int, ...] | None,
    workspace_allocs: tuple[int, ...],
    arch: str | None = None,
) -> SampledStep:
    """Simulate (or recall, from the memo) the step of the model cut to copies of its ``layers``
    (None: all of them), work seen before replayed (:mod:`memfit.planner.shortcuts.replay`), and
    summarise it: peaks, categories, counts."""
    from memfit.planner.exact.simulate import simulate
    from memfit.planner.shortcuts.replay import Replay

    key = _sample_key(config, spec, layers, workspace_allocs, arch)
    cached = MEMO.samples.get(key)
    if cached is None:
        replay = Replay(MEMO.templates_for(config, spec, arch))
        simulated = simulate(
            config, spec, layers=layers, workspace_allocs=workspace_allocs, arch=arch, runner=replay.bind
        )
        cached = MEMO.keep("samples", key, _summarise(simulated, frozenset(replay.loops)))
    # Callers must not change the tracker result; the dicts around it they may.
    return dataclasses.replace(
        cached,
        **{f.name: copy.deepcopy(getattr(cached, f.name)) for f in dataclasses.fields(cached) if f.name != "result"},
    )


def exact_step(
    config: dict[str, Any],
    spec: RunSpec,
    layers: tuple[int, ...] | None,
    workspace_allocs: tuple[int, ...],
    arch: str | None = None,
) -> SampledStep:
    """The step of the model cut to copies of its ``layers`` (None: all of them), simulated with no
    shortcut (every chunk, region and micro-batch run) and nothing remembered, summarised."""
    from memfit.planner.exact.simulate import simulate

    return _summarise(simulate(config, spec, layers=layers, workspace_allocs=workspace_allocs, arch=arch), frozenset())


def cached_sample(
    config: dict[str, Any],
    spec: RunSpec,
    layers: tuple[int, ...] | None,
    workspace_allocs: tuple[int, ...],
    arch: str | None = None,
) -> SampledStep | None:
    """The step :func:`sample_step` simulated already in this process for these inputs, or None (nothing is simulated)."""
    return MEMO.samples.get(_sample_key(config, spec, layers, workspace_allocs, arch))


def _sample_key(
    config: dict[str, Any],
    spec: RunSpec,
    layers: tuple[int, ...] | None,
    workspace_allocs: tuple[int, ...],
    arch: str | None,
) -> tuple:
    cut = None if layers is None else tuple(layers)
    return (config_key(config), spec.model_dump_json(), cut, tuple(workspace_allocs), arch)


def _summarise(sim, chunk_loops: frozenset) -> SampledStep:
    """A simulation's figures, with the chunked loops its step ran (for the length model)."""
    result = sim.tracker
    return SampledStep(
        result=result,
        attention=sim.attention,
        attention_kernels=sim.attention_kernels,
        batch_layout=sim.batch_layout,
        embeddings_on_host=sim.embeddings_on_host,
        trained_copies=[dict(entry) for entry in sim.trained_copies],
        allocated_bytes=result.peak.allocated_bytes,
        host_peak_bytes=result.outside_peaks.get("host", 0),
        paged_peak_bytes=result.outside_peaks.get("paged", 0),
        categories=dict(result.peak.categories),
        phase=result.peak.phase,
        phase_peaks=dict(result.phase_peaks),
        total_params=sim.total_params,
        trainable_params=sim.trainable_params,
        chunk_loops=chunk_loops,
        adapted=sim.adapted,
        adapter_bytes=copy.deepcopy(sim.adapter_bytes),
    )
