"""``memfit fit``: the training configurations that fit a GPU or a budget, ranked by estimated speed.

:func:`fit` checks a :class:`~memfit.planner.search.request.FitRequest` whole before any plan, then
searches each method (:mod:`~memfit.planner.search.jobs`: its settings and largest micro-batch,
:mod:`~memfit.planner.search.micro_batch`, and its longest sequence,
:mod:`~memfit.planner.search.longest`), in worker processes
(:mod:`memfit.planner.shortcuts.workers`), and ranks what fits. Every configuration it returns has
been planned (:func:`memfit.planner.api.plan`) and fits; no answer comes from a formula alone. The
search is kept short with what is known about memory:

- memory grows with micro-batch size and with sequence length (monotone), so the largest
  micro-batch and the longest sequence are found by bracketing and bisection;
- memory is close to affine in the micro-batch, so two plans predict where the boundary lies and
  the bisection starts from a tight bracket around the prediction;
- the longest sequence is searched on a model of the step over lengths, learnt from two plans
  (:mod:`memfit.planner.shortcuts.lengths`: each length then costs a replay of the allocator, not a
  simulation), and the answer checked with one more plan;
- settings are tried fastest first (no checkpointing, then checkpointing, then offloaded); once
  one fits the whole effective batch in a single micro-batch, the slower ones are not planned;
- simulations are cached within the process (:mod:`memfit.planner.shortcuts.extrapolate`);
- the methods, and on one GPU each method's micro-batch and longest sequence, are searched in
  worker processes.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from memfit.errors import shown_name
from memfit.planner.errors import PlanError
from memfit.planner.inputs import quick_problems, validate, validation_state
from memfit.planner.search.images import image_planner, largest_image
from memfit.planner.search.jobs import MethodJob, MethodOutcome, gpu_levels, merged_outcome
from memfit.planner.search.micro_batch import micro_batches
from memfit.planner.search.plans import OPTIMIZERS_LEAN_FIRST, SearchPlanner, planned_miss
from memfit.planner.search.request import FitEvents, FitRequest
from memfit.planner.search.results import Fit, FitResult, Miss
from memfit.planner.search.tool_configs import tool_config_request
from memfit.planner.shortcuts.switch import exact_wanted
from memfit.planner.shortcuts.workers import run_parallel, start_worker_server, worker_count
from memfit.planner.throughput import relative_speeds
from memfit.spec import SpecError, choices, default, make_spec, upper_bound

METHODS = choices("method")
#: The methods searched unless ``--method`` says otherwise: an 8-bit base is searched only when asked.
DEFAULT_METHODS = ("full", "lora", "qlora")
#: Adapter options: given to fit, they hold for every plan, so only methods that take them are searched.
ADAPTER_KNOBS = ("dora", "rslora", "modules_to_save")
#: Knobs the search chooses, refused among the knobs a request holds.
CHOSEN_BY_THE_SEARCH = ("method", "checkpointing", "optimizer", "grad_accum")
#: The effective batch without ``batch_size`` (grpo's: one group of completions).
DEFAULT_EFFECTIVE_BATCH = 8


def fit(request: FitRequest, events: FitEvents | None = None) -> FitResult:
    """Find the configurations of ``request.model`` that fit ``request``'s GPU, budget or Target,
    fastest first, telling ``events`` as it goes.

    Another tool's config as the model (:mod:`memfit.interop`) is searched as that tool runs it
    (:func:`~memfit.planner.search.tool_configs.tool_config_request`); the result keeps what was read
    (``config``).

    Raises:
        PlanError: listing every problem with the request, before any plan is made.
        SearchCancelled: ``events.stop`` was set before the search ended.
    """
    from memfit.interop import is_tool_config

    events = events or FitEvents()
    if not is_tool_config(request.model):
        return _search(request, events)
    search, config = tool_config_request(request)
    result = _search(search, events)
    result.config = config
    return result


def _search(request: FitRequest, events: FitEvents) -> FitResult:
    """:func:`fit` of a model (not a tool config)."""
    from memfit.planner.api import check_no_override

    check_no_override(request.model, request.model_override)
    started = time.perf_counter()
    methods, refused = _methods_for(request.methods, request.knobs)
    exact = exact_wanted(request.exact)  # also MEMFIT_EXACT=1: every plan exact, in this one process
    workers = 1 if exact else worker_count(len(methods)) if request.workers is None else max(1, request.workers)
    source, target = _validated(request, refused, start_workers=workers > 1)
    job = _method_job(request, source, target)
    events.expect(expected_plans(len(methods), job.effective_batch, longest=bool(job.seq_limit), counts=_counts(job)))
    progress = events.plan_reporter()
    outcomes = _run_parts(job, methods, workers, progress, events.method_found, events.stop)
    result = _fit_result(job, outcomes, methods, request.max_seq_len, progress)
    _add_largest_image(result, job, source.config, progress)
    gpu = {"name": target.name, "memory_bytes": target.memory_bytes}
    return dataclasses.replace(
        result,
        model=source.name,
        gpu=gpu,
        seconds=time.perf_counter() - started,
        max_gpus=int(request.gpus or 1),
        notes=[source.note] if source.note else [],
    )


def _add_largest_image(
    result: FitResult, job: MethodJob, config: dict[str, Any], progress: Callable[[str], None] | None
) -> None:
    """A vision-language model's largest image at the fastest fit (``result.max_image``,
    :mod:`~memfit.planner.search.images`), and the plans it took."""
    from memfit.models.vision import is_vision_config

    if not result.fits or not is_vision_config(config):
        return
    planner = image_planner(job, result.fits[0], progress)
    result.max_image = largest_image(planner, result.fits[0], config)
    result.plans_made += planner.count


def _method_job(request: FitRequest, source, target) -> MethodJob:
    """What each method's search needs, from a request whose inputs are valid."""
    model = request.model
    if isinstance(model, str) and (source.hub or source.note):
        # A Hub id is fetched once: every plan of the search (and every worker) uses that config.
        model = dict(source.config, _name_or_path=source.name)
    knobs = dict(request.knobs)
    levels = gpu_levels(int(request.gpus or 1), knobs.pop("shard", None))
    degree = int(knobs.get("sequence_parallel") or 1)
    # Sequence parallelism shares each row among `degree` GPUs: only the counts it divides.
    levels = [(gpus, shard) for gpus, shard in levels if gpus % degree == 0] or levels
    max_positions = int(source.config.get("max_position_embeddings") or 0) or None
    seq_len = request.seq_len
    if seq_len is None:
        seq_len = min(default("seq_len"), max_positions) if max_positions else default("seq_len")
    # Without a precision: bf16 where the card has it (a budget alone is taken to have it).
    supports_bf16 = "precision" in knobs or target.supports_bf16 is not False
    return MethodJob(
        model=model,
        target=target,
        base=dict(knobs, seq_len=seq_len),
        supports_bf16=supports_bf16,
        effective_batch=_effective_batch(request),
        seq_limit=(max_positions or 131072) if request.max_seq_len else 0,
        levels=levels,
        optimizers=dict(OPTIMIZERS_LEAN_FIRST, **(request.optimizers or {})),
        deepspeed=request.deepspeed,
        exact=exact_wanted(request.exact),
    )


def _counts(job: MethodJob) -> int:
    """The GPU counts whose longest sequence is searched with and without sequence parallelism."""
    degree = int(job.base.get("sequence_parallel") or 1)
    return len(dict(job.levels)) if job.seq_limit and degree > 1 else 0


def _effective_batch(request: FitRequest) -> int | str:
    return _default_batch(request.knobs) if request.batch_size is None else request.batch_size


def _default_batch(knobs: Mapping[str, Any]) -> int:
    """The effective batch fit keeps when none is given: 8, or grpo's one group of completions."""
    if knobs.get("objective") != "grpo":
        return DEFAULT_EFFECTIVE_BATCH
    from memfit.spec import whole_number_value

    generations = whole_number_value(knobs.get("num_generations", default("num_generations")))
    return generations if isinstance(generations, int) and generations > 0 else DEFAULT_EFFECTIVE_BATCH


def _placeholder_length(knobs: Mapping[str, Any]) -> int:
    """A valid length to check the inputs with before the model's is known: 1 (with sequence
    parallelism, a token for each rank), or for grpo a token more than its completion (whose prompt
    needs room)."""
    from memfit.spec import whole_number_value

    if knobs.get("objective") != "grpo":
        degree = whole_number_value(knobs.get("sequence_parallel", 1))
        # A row every rank has a shard of; a degree past its bound is refused by its own check, and a
        # placeholder that long would be refused as a length no one gave.
        return degree if isinstance(degree, int) and 1 < degree <= upper_bound("sequence_parallel") else 1

    completion = whole_number_value(knobs.get("max_completion_length", default("max_completion_length")))
    return completion + 1 if isinstance(completion, int) and completion > 0 else 1


def _plan_inputs(request: FitRequest) -> dict[str, Any]:
    """What every plan of the search is validated with: :func:`memfit.planner.inputs.validate`'s
    arguments (without a length, any valid one: the model's longest is taken once the model is known)."""
    gpus = {} if request.gpus is None else {"gpus": request.gpus}
    return dict(
        revision=request.revision,
        gpu=request.gpu,
        budget=request.budget,
        target=request.target,
        batch_size=_effective_batch(request),
        seq_len=_placeholder_length(request.knobs) if request.seq_len is None else request.seq_len,
        **request.knobs,
        **gpus,
    )


def _run_parts(
    job: MethodJob,
    methods: tuple[str, ...],
    workers: int,
    progress: Callable[[str], None] | None,
    found: Callable[[str, list[Fit]], None],
    stop: threading.Event | None = None,
) -> list[MethodOutcome]:
    """Each method's outcome, its parts searched in ``workers`` processes (or here, with one);
    ``found`` is called with a method's fits as soon as its batch search ends; ``stop``: see
    :class:`~memfit.planner.search.request.FitEvents`."""
    parts = job.parts(methods) if workers > 1 else tuple(methods)

    def finished(part: str, outcome: MethodOutcome) -> None:
        if not part.endswith(":longest"):
            found(outcome.method, outcome.fits)

    if workers > 1:
        results = dict(zip(parts, run_parallel(job, parts, workers, progress, finished, stop)))
    else:
        results = {}
        for part in parts:
            results[part] = job.run(part, progress)
            finished(part, results[part])
    return [
        merged_outcome(method, [o for part, o in results.items() if part.partition(":")[0] == method])
        for method in methods
    ]


def _validated(request: FitRequest, refused: list[str], *, start_workers: bool):
    """The model's source and the Target, once every input is checked; one PlanError listing every
    problem otherwise, before any simulation. ``refused``: why some of the methods named cannot take
    the adapter options (:func:`_methods_for`). ``start_workers``: the search will run in worker
    processes, whose server starts now when the plans are not known to be cached."""
    inputs = _plan_inputs(request)
    problems = _search_problems(request, inputs, refused)
    if start_workers and not problems and validation_state(request.model, **inputs) == "unknown":
        # Inputs never seen: the plans will be made, in worker processes. Their imports start now,
        # beside this process's validation, instead of after it.
        start_worker_server()
    if problems:  # with what else is wrong, found without importing transformers: the rest waits for the fixes
        # A --batch-size over fit's bound is named once, with fit's bound, not again with the knob's.
        batch_named = _over_fits_bound(inputs["batch_size"])
        problems.extend(quick_problems(request.model, **(dict(inputs, batch_size=1) if batch_named else inputs)))
    else:
        try:
            source, _, target = validate(request.model, **inputs)
        except PlanError as err:
            problems.extend(err.problems)
    if problems:
        raise PlanError(problems, heading="cannot search this model")
    return source, target


def _over_fits_bound(batch_size: Any) -> bool:
    return isinstance(batch_size, int) and batch_size > upper_bound("grad_accum")


def _search_problems(request: FitRequest, inputs: dict[str, Any], refused: list[str]) -> list[str]:
    """What is wrong with the request as a search, before its plans' own checks: no target, an
    effective batch over what micro-batch 1 can accumulate, a method that does not exist or cannot
    take the adapter options (``refused``), a knob the search chooses."""
    problems = []
    target = request.target
    no_target = target is None and request.gpu is None and request.budget is None
    if no_target or (target is not None and not target.has_memory):
        problems.append("fit needs --gpu NAME or --budget SIZE (e.g. --gpu rtx-4090 or --budget 24GiB)")
    batch_size, most = inputs["batch_size"], upper_bound("grad_accum")
    if _over_fits_bound(batch_size):
        # Every method's search starts at micro-batch 1 with the whole batch accumulated.
        problems.append(
            f"--batch-size: {batch_size} must be at most {most}: fit plans micro-batch 1 with the whole "
            f"effective batch accumulated, and --grad-accum is at most {most} (e.g. --batch-size 8)"
        )
    bad = [m for m in request.methods or () if m not in METHODS]
    if bad:
        problems.append(f"--method: {', '.join(map(shown_name, bad))} is not one of {', '.join(METHODS)}")
    problems.extend(refused)
    for fixed in CHOSEN_BY_THE_SEARCH:
        if fixed in request.knobs:
            problems.append(f"--{fixed.replace('_', '-')} is chosen by the search; leave it out")
    return problems


def _fit_result(
    job: MethodJob,
    outcomes: list[MethodOutcome],
    methods: tuple[str, ...],
    max_seq_len: bool,
    progress: Callable[[str], None] | None,
) -> FitResult:
    """The fits of every method, fastest first, the faster settings that miss, the longest sequences."""
    fits = [f for o in outcomes for f in o.fits]
    misses = [m for o in outcomes for m in o.misses]
    for f, speed in zip(fits, relative_speeds([f.spec for f in fits])):
        f.relative_speed = speed
    fits.sort(key=lambda f: (-f.relative_speed, -(f.plan.headroom_bytes or 0)))
    if fits:
        # Only settings that would have been faster than the best fit explain anything.
        misses = [m for m in misses if _faster(m.spec, fits[0].spec)]
    planned_misses = _plan_unplanned_misses(job, misses, progress)
    longest = dict.fromkeys(methods, 0) if max_seq_len else {}
    longest_specs: dict[str, dict[str, Any]] = {}
    for o in outcomes:
        if max_seq_len:
            longest[o.method] = o.longest
        if o.longest_spec is not None:
            longest_specs[o.method] = o.longest_spec
    return FitResult(
        model="",
        gpu={},
        fits=fits,
        misses=misses,
        max_seq_len=longest,
        max_seq_len_specs=longest_specs,
        max_seq_len_by_gpus={o.method: o.longest_by_gpus for o in outcomes if o.longest_by_gpus},
        plans_made=sum(o.plans for o in outcomes) + planned_misses,
    )


def _methods_for(asked: tuple[str, ...] | None, knobs: dict[str, Any]) -> tuple[tuple[str, ...], list[str]]:
    """The methods a search plans, and why an asked one cannot take the fixed adapter options.

    Without ``asked``: :data:`DEFAULT_METHODS`, less those that refuse the adapter options among
    ``knobs`` (DoRA and rsLoRA, modules trained whole: adapters only; DoRA not on a quantized base).
    """
    options = {name: knobs[name] for name in ADAPTER_KNOBS if knobs.get(name) not in (None, False, (), [], "")}
    candidates = tuple(asked) if asked else DEFAULT_METHODS
    if not options:
        return candidates, []
    taken, problems = [], []
    for method in candidates:
        if method not in METHODS:
            continue
        try:
            make_spec(method=method, **options)
            taken.append(method)
        except SpecError as err:
            if asked:
                problems.extend(p for p in err.problems if p not in problems)
    return tuple(taken), problems


def _plan_unplanned_misses(job: MethodJob, misses: list[Miss], progress: Callable[[str], None] | None) -> int:
    """Plan the reported misses that were proven not to fit without a plan, for their figures
    (what they need, by how much they are over); the number of plans made."""
    planner = SearchPlanner(job.model, job.target, {}, progress, job.deepspeed, exact=job.exact)
    for miss in misses:
        if miss.device_total_bytes is None:
            planned = planned_miss(planner(**miss.knobs))
            miss.device_total_bytes, miss.over_bytes = planned.device_total_bytes, planned.over_bytes
    return planner.count


def _faster(a: dict[str, Any], b: dict[str, Any]) -> bool:
    speed_a, speed_b = relative_speeds([a, b])
    return speed_a > speed_b


def expected_plans(methods: int, effective_batch: int, *, longest: bool = True, counts: int = 0) -> int:
    """About how many plans :func:`fit` makes for ``methods`` methods: an estimate for its progress
    line, not a bound (a search proven short by the model states' floor makes fewer; one that needs
    several GPU counts, more).

    Per method: the first setting that fits at micro-batch 1, often after a faster one that does
    not; the largest micro-batch, a guess confirmed in about log2 of the splits of the effective
    batch; and the longest sequence, two plans to learn the step over lengths from and one to
    check the answer (:mod:`~memfit.planner.search.longest`); with sequence parallelism, that again
    at each of ``counts`` GPU counts, with it and without it.
    """
    splits = len(micro_batches(effective_batch))
    per_method = 2 + math.ceil(math.log2(splits)) + (3 if longest else 0) + 6 * counts
    return methods * per_method
