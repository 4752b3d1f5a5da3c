"""``memfit fit``: the training configurations that fit a GPU or a budget, ranked by estimated speed.

Every configuration this module returns has been planned (:func:`memfit.planner.api.plan`) and
fits; no answer comes from a formula alone. The search is kept short with what is known about
memory:

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
  worker processes (:mod:`memfit.planner.shortcuts.workers`).

The search arithmetic here (the largest micro-batch that fits, bracketing and bisection) is shared
with a training run's search (:meth:`memfit.planner.search.run.RunPlanner.fit`).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memfit.errors import shown_name
from memfit.json_form import JsonForm
from memfit.planner.api import plan
from memfit.planner.errors import PlanError, SearchCancelled
from memfit.planner.inputs import quick_problems, validate, validation_state
from memfit.planner.layout import proven_over_budget
from memfit.planner.report import MemoryPlan
from memfit.planner.sharding import mode_problems
from memfit.planner.shortcuts.switch import exact_wanted
from memfit.planner.shortcuts.workers import run_parallel, start_worker_server, worker_count
from memfit.planner.target import Target
from memfit.planner.throughput import relative_speeds
from memfit.spec import TILING_AUTO_TOKENS, TRAINED_SHARD_MODES, SpecError, choices, default, make_spec, upper_bound

METHODS = choices("method")
#: The methods searched unless ``--method`` says otherwise: an 8-bit base is searched only when asked.
DEFAULT_METHODS = ("full", "lora", "qlora")
#: Adapter options: given to fit, they hold for every plan, so only methods that take them are searched.
ADAPTER_KNOBS = ("dora", "rslora", "modules_to_save")
#: Fastest first; each next one needs less memory.
CHECKPOINTING_FAST_FIRST = choices("checkpointing")  # RunSpec declares them fastest first
OPTIMIZERS_LEAN_FIRST = {"full": ("paged-adamw8bit", "adamw8bit", "adamw"), "lora": ("adamw",), "qlora": ("adamw",),
                         "lora-8bit": ("adamw",)}
#: Sequence lengths are reported in multiples of this many tokens.
SEQ_STEP = 128
#: With ``--gpus N`` and no ``--shard``: the modes tried at each GPU count, least communication
#: first; the ones memfit train runs, so every fit can be written as a config and trained (zero3
#: is fsdp).
SHARD_FAST_FIRST = tuple(mode for mode in TRAINED_SHARD_MODES if mode != "zero3")


def gpu_levels(gpus: int, shard: str | None) -> list[tuple[int, str]]:
    """(GPU count, shard mode) pairs to try, fewest GPUs first: 1, 2, 4, 8... up to ``gpus``, and ``gpus``.

    ``--gpus N`` means "up to N GPUs": the search reports the smallest count that fits.
    """
    counts, n = [1], 2
    while n < gpus:
        counts.append(n)
        n *= 2
    if gpus > 1:
        counts.append(gpus)
    modes = (shard,) if shard and shard != "none" else SHARD_FAST_FIRST
    return [(1, "none")] + [(n, mode) for n in counts[1:] for mode in modes]


@dataclass
class Fit(JsonForm):
    """A configuration that fits, its plan and its estimated relative speed."""

    spec: dict[str, Any]
    plan: MemoryPlan
    relative_speed: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"spec": self.spec, "gpus": self.spec.get("gpus", 1), "shard": self.plan.details.get("shard", self.spec.get("shard", "none")),
                "per_rank": bool(self.plan.details.get("per_rank")), "peak": self.plan.to_dict()["peak"],
                "relative_speed": round(self.relative_speed, 4), "headroom_bytes": self.plan.headroom_bytes}


@dataclass
class Miss:
    """A faster setting that does not fit, and by how much.

    A setting proven not to fit without a plan (:meth:`_Planner.cannot_fit`) has no figures yet
    (None) and keeps the knobs to plan it with: :func:`fit` plans it only if it is reported.
    """

    spec: dict[str, Any]
    device_total_bytes: int | None
    over_bytes: int | None
    knobs: dict[str, Any] | None = field(default=None, repr=False)


@dataclass
class FitResult(JsonForm):
    """Everything `memfit fit` reports."""

    model: str
    gpu: dict[str, Any]
    fits: list[Fit]
    misses: list[Miss]
    max_seq_len: dict[str, int]
    max_seq_len_specs: dict[str, dict[str, Any]] = field(default_factory=dict)
    plans_made: int = 0
    seconds: float = 0.0
    max_gpus: int = 1
    notes: list[str] = field(default_factory=list)  # how the model's config was obtained, when worth saying
    config: dict[str, Any] | None = None  # another tool's config fitted (memfit.interop), as read

    def to_dict(self) -> dict[str, Any]:
        """The JSON form as a dict (docs/fit.md); ``to_json(indent=...)`` gives it as JSON text."""
        return {
            "model": self.model,
            "gpu": self.gpu,
            "fits": [f.to_dict() for f in self.fits],
            "max_seq_len": dict(self.max_seq_len),
            "details": {
                "max_gpus": self.max_gpus,
                "per_rank": self.max_gpus > 1,
                "max_seq_len_specs": self.max_seq_len_specs,
                "not_fitting": [{"spec": m.spec, "device_total_bytes": m.device_total_bytes, "over_bytes": m.over_bytes} for m in self.misses],
                "plans_made": self.plans_made,
                "seconds": round(self.seconds, 2),
                "relative_speed": "an estimate (memfit.planner.throughput), not a measurement",
                **({"notes": list(self.notes)} if self.notes else {}),
                **({"config": self.config} if self.config else {}),
            },
        }


class _Planner:
    """Plans with fixed model, target and base knobs; counts the plans it makes."""

    def __init__(self, model: str | dict, target: Target, base: dict[str, Any], progress: Callable[[str], None] | None,
                 deepspeed: Any = None, exact: bool = False):
        self.model = model
        self.exact = exact  # every plan made exact (memfit.planner.shortcuts.switch)
        self.target = target
        self.deepspeed = {"deepspeed": deepspeed} if deepspeed is not None else {}
        self.base = base
        self.count = 0
        self.progress = progress or (lambda message: None)
        self.supports_bf16 = True
        self.optimizers = OPTIMIZERS_LEAN_FIRST  # the optimizers tried for each method, leanest first

    def precision_for(self, method: str) -> str:
        """bf16 where the card has it; otherwise fp16 for adapters and fp32 for full fine-tuning."""
        if self.supports_bf16:
            return "bf16"
        return "fp32" if method == "full" else "fp16"

    def knobs_for(self, **knobs: Any) -> dict[str, Any]:
        """Every knob a plan of ``knobs`` is made with: the base knobs, these, the precision."""
        merged = dict(self.base)
        merged.update(knobs)
        merged.setdefault("precision", self.precision_for(merged["method"]))
        return merged

    def __call__(self, **knobs: Any) -> MemoryPlan:
        merged = self.knobs_for(**knobs)
        self.count += 1
        self.progress(_describe(merged))
        return _room_for_paged_states(plan(self.model, target=self.target, exact=self.exact, **self.deepspeed, **merged))

    def predict(self, sampler: Any, **knobs: Any) -> MemoryPlan:
        """The plan of ``knobs`` with its step predicted by ``sampler`` (:func:`memfit.planner.api.predicted_plan`);
        not counted, not reported: it only steers the search."""
        from memfit.planner.api import predicted_plan

        return _room_for_paged_states(predicted_plan(self.model, sampler, target=self.target, **self.deepspeed,
                                                     **self.knobs_for(**knobs)))

    def cannot_fit(self, **knobs: Any) -> bool:
        """Whether what the model states alone need (weights, gradients, optimizer states: a floor
        under any plan, :func:`memfit.planner.layout.memory_lower_bound`) is over the target already,
        so that planning ``knobs`` could only say it does not fit. No plan is made."""
        return proven_over_budget(self.model, target=self.target, exact=self.exact, **self.deepspeed, **self.knobs_for(**knobs))

    def unplanned_miss(self, **knobs: Any) -> Miss:
        """The miss ``knobs`` would be, proven by :meth:`cannot_fit`, its figures left to plan."""
        from memfit.spec import make_spec

        merged = self.knobs_for(**knobs)
        return Miss(make_spec(**merged).knobs(), None, None, knobs=merged)


def _room_for_paged_states(result: MemoryPlan) -> MemoryPlan:
    """The plan as the search counts it: paged optimizer states need room on the device too.

    bitsandbytes' paged states live in CUDA unified memory, outside the caching allocator, so a
    plan fits without them. But when they do not fit beside the step's peak they are paged out to
    host memory and back every step, which runs, slowly; the search looks for configurations
    that run at speed, so it counts them against the headroom.
    """
    paged = int(result.details.get("paged_peak_bytes") or 0)
    if not paged or result.headroom_bytes is None:
        return result
    headroom = result.headroom_bytes - paged
    details = dict(result.details, notes=list(result.details.get("notes", [])) + [
        "fit counts the paged optimizer states against the headroom (paged to the host every step otherwise)"])
    return dataclasses.replace(result, headroom_bytes=headroom, fits=headroom >= 0, details=details)


def fit(
    model: str | dict,
    *,
    gpu: str | None = None,
    budget: str | int | None = None,
    target: Target | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    methods: tuple[str, ...] | None = None,
    max_seq_len: bool = True,
    progress: Callable[[str], None] | None = None,
    workers: int | None = None,
    revision: str | None = None,
    optimizers: dict[str, tuple[str, ...]] | None = None,
    deepspeed: Any = None,
    plans_expected: Callable[[int], None] | None = None,
    found: Callable[[str, list[Fit]], None] | None = None,
    model_override: str | None = None,
    stop: threading.Event | None = None, exact: bool = False,
    **knobs: Any,
) -> FitResult:
    """Find the configurations of ``model`` that fit ``gpu`` (or ``budget``, or ``target``), fastest first.

    ``model`` may be another tool's training config (:mod:`memfit.interop`): its method, knobs,
    effective batch and sequence length are kept (``methods``, ``batch_size``, ``seq_len`` and the
    knobs given here replace them) and its micro-batch, accumulation, checkpointing and optimizer
    are searched, with the Hugging Face step it runs; the result keeps what was read (``config``).

    Args:
        target: what to fit, made already (:class:`~memfit.planner.target.Target`), instead of
            ``gpu`` / ``budget``.
        batch_size: the effective batch (sequences per optimizer step) to keep: each fit splits it
            into a micro-batch and gradient accumulation (default 8).
        seq_len: sequence length to hold fixed (default: RunSpec's, or the model's maximum if smaller).
        methods: restrict the search to these methods (default: full, lora, qlora; lora-8bit only when
            named here). With adapter options among ``knobs`` (``dora``, ``rslora``, ``modules_to_save``)
            every plan has them, and the default is the methods that take them.
        max_seq_len: also find the longest sequence each method fits (micro-batch 1).
        knobs ``gpus`` and ``shard``: ``gpus=N`` (N > 1) means "up to N GPUs": each method is searched
            on 1, 2, 4... up to N GPUs and reported at the smallest count that fits, with the
            first shard mode that fits (``shard``, or ddp, zero1, zero2, fsdp, fsdp-offload in turn);
            memory is then per GPU. Each configuration is simulated once for all counts and modes.
        workers: processes to search the methods in (default: one per method, at most one per CPU
            core; one with ``exact``: every plan exact, :mod:`memfit.planner.shortcuts.switch`).
        revision: branch, tag or commit of a Hugging Face Hub id (default: main).
        optimizers: the optimizers to try for a method, leanest first, where not
            :data:`OPTIMIZERS_LEAN_FIRST`'s.
        deepspeed: a DeepSpeed config's settings, for the plans on several GPUs that its ZeRO stage
            shards (:func:`memfit.planner.api.plan`).
        progress: called with each plan's description as it starts (from the worker processes too).
        plans_expected: called once, when the inputs are validated and before the first plan, with
            about how many plans the search will make (:func:`expected_plans`).
        found: called with a method and its fits (not yet ranked: speeds are relative to the
            fastest fit of all methods) as soon as that method's search ends.
        model_override: with another tool's config as ``model``, the model to fit in place of the
            config's (``--model``).
        stop: when set (by another thread), the search ends where it is, its worker processes
            ended, and raises :class:`~memfit.planner.errors.SearchCancelled`.
        knobs: fixed RunSpec knobs passed through (rank, alpha, targets, precision...). Without a
            precision, bf16 is used where the GPU supports it, else fp16 (LoRA, QLoRA) or fp32 (full).
    """
    from memfit.interop import is_tool_config
    from memfit.planner.api import check_no_override

    if is_tool_config(model):
        return _fit_tool_config(str(model), gpu=gpu, budget=budget, target=target, batch_size=batch_size, seq_len=seq_len,
                                methods=methods, max_seq_len=max_seq_len, progress=progress, workers=workers, revision=revision,
                                plans_expected=plans_expected, found=found, model_override=model_override, stop=stop, exact=exact, **knobs)
    check_no_override(model, model_override)
    batch_size = 8 if batch_size is None else batch_size
    started = time.perf_counter()
    asked = tuple(methods or ())
    methods, refused = _methods_for(methods, knobs)
    workers = 1 if exact_wanted(exact) else worker_count(len(methods)) if workers is None else max(1, workers)
    # Without a length, any valid one: the model's longest is taken once the model is known.
    inputs = dict(revision=revision, gpu=gpu, budget=budget, target=target, batch_size=batch_size,
                  seq_len=1 if seq_len is None else seq_len, **knobs)
    source, target = _validated(model, inputs, asked, refused, knobs, start_workers=workers > 1)
    if isinstance(model, str) and (source.hub or source.note):
        # A Hub id is fetched once: every plan of the search (and every worker) uses that config.
        model = dict(source.config, _name_or_path=source.name)
    max_gpus = int(knobs.pop("gpus", 1) or 1)
    levels = gpu_levels(max_gpus, knobs.pop("shard", None))
    max_positions = int(source.config.get("max_position_embeddings") or 0) or None
    if seq_len is None:
        seq_len = min(default("seq_len"), max_positions) if max_positions else default("seq_len")
    # Without a precision: bf16 where the card has it (a budget alone is taken to have it).
    supports_bf16 = "precision" in knobs or target.supports_bf16 is not False
    job = _MethodJob(model=model, target=target, base=dict(knobs, seq_len=seq_len),
                     supports_bf16=supports_bf16, effective_batch=batch_size,
                     seq_limit=(max_positions or 131072) if max_seq_len else 0, levels=levels,
                     optimizers=dict(OPTIMIZERS_LEAN_FIRST, **(optimizers or {})), deepspeed=deepspeed, exact=exact_wanted(exact))
    if plans_expected is not None:
        plans_expected(expected_plans(len(methods), batch_size, longest=bool(job.seq_limit)))
    progress = _stoppable(progress, stop)
    outcomes = _run_parts(job, methods, workers, progress, found or (lambda method, fits: None), stop)
    result = _fit_result(job, outcomes, methods, max_seq_len, progress)
    return dataclasses.replace(result, model=source.name, gpu={"name": target.name, "memory_bytes": target.memory_bytes},
                               seconds=time.perf_counter() - started, max_gpus=max_gpus,
                               notes=[source.note] if source.note else [])


def _stoppable(progress: Callable[[str], None] | None, stop: threading.Event | None) -> Callable[[str], None] | None:
    """``progress``, raising :class:`SearchCancelled` before a plan this process makes once ``stop``
    is set (the plans of worker processes are stopped by :func:`run_parallel`)."""
    if stop is None:
        return progress

    def checked(message: str) -> None:
        if stop.is_set():
            raise SearchCancelled()
        if progress is not None:
            progress(message)

    return checked


def _run_parts(job: _MethodJob, methods: tuple[str, ...], workers: int, progress: Callable[[str], None] | None,
               found: Callable[[str, list[Fit]], None], stop: threading.Event | None = None) -> list[_MethodOutcome]:
    """Each method's outcome, its parts searched in ``workers`` processes (or here, with one);
    ``found`` is called with a method's fits as soon as its batch search ends; ``stop``: see :func:`fit`."""
    parts = job.parts(methods) if workers > 1 else tuple(methods)

    def finished(part: str, outcome: _MethodOutcome) -> None:
        if not part.endswith(":longest"):
            found(outcome.method, outcome.fits)

    if workers > 1:
        results = dict(zip(parts, run_parallel(job, parts, workers, progress, finished, stop)))
    else:
        results = {}
        for part in parts:
            results[part] = job.run(part, progress)
            finished(part, results[part])
    return [_merged(method, [o for part, o in results.items() if part.partition(":")[0] == method]) for method in methods]


def _validated(model: str | dict, inputs: dict[str, Any], asked: tuple[str, ...], refused: list[str], knobs: dict[str, Any], *,
               start_workers: bool):
    """The model's source and the Target, once every input is checked; one PlanError listing every
    problem otherwise, before any simulation. ``asked``: the methods named (they must exist);
    ``refused``: why some of them cannot take the adapter options (:func:`_methods_for`).
    ``start_workers``: the search will run in worker processes, whose server starts now when the
    plans are not known to be cached."""
    problems = []
    if (inputs["target"] is None and inputs["gpu"] is None and inputs["budget"] is None) or (
            inputs["target"] is not None and not inputs["target"].has_memory):
        problems.append("fit needs --gpu NAME or --budget SIZE (e.g. --gpu rtx-4090 or --budget 24GiB)")
    most = upper_bound("grad_accum")
    batch_size = inputs["batch_size"]
    if isinstance(batch_size, int) and batch_size > most:
        # Every method's search starts at micro-batch 1 with the whole batch accumulated.
        problems.append(f"--batch-size: {batch_size} must be at most {most}: fit plans micro-batch 1 with the whole effective "
                        f"batch accumulated, and --grad-accum is at most {most} (e.g. --batch-size 8)")
    bad = [m for m in asked if m not in METHODS]
    if bad:
        problems.append(f"--method: {', '.join(map(shown_name, bad))} is not one of {', '.join(METHODS)}")
    problems.extend(refused)
    for fixed in ("method", "checkpointing", "optimizer", "grad_accum"):
        if fixed in knobs:
            problems.append(f"--{fixed.replace('_', '-')} is chosen by the search; leave it out")
    if start_workers and not problems and validation_state(model, **inputs) == "unknown":
        # Inputs never seen: the plans will be made, in worker processes. Their imports start now,
        # beside this process's validation, instead of after it.
        start_worker_server()
    if problems:  # with what else is wrong, found without importing transformers: the rest waits for the fixes
        # A --batch-size over fit's bound is named once, with fit's bound, not again with the knob's.
        batch_named = isinstance(batch_size, int) and batch_size > most
        problems.extend(quick_problems(model, **(dict(inputs, batch_size=1) if batch_named else inputs)))
    else:
        try:
            source, _, target = validate(model, **inputs)
        except PlanError as err:
            problems.extend(err.problems)
    if problems:
        raise PlanError(problems, heading="cannot search this model")
    return source, target


def _fit_result(job: _MethodJob, outcomes: list[_MethodOutcome], methods: tuple[str, ...], max_seq_len: bool,
                progress: Callable[[str], None] | None) -> FitResult:
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
    return FitResult(model="", gpu={}, fits=fits, misses=misses, max_seq_len=longest, max_seq_len_specs=longest_specs,
                     plans_made=sum(o.plans for o in outcomes) + planned_misses)


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


#: Knobs the search chooses: a config's values of them are where the search starts from, not fixed.
_SEARCHED = ("method", "checkpointing", "optimizer", "grad_accum", "batch_size", "seq_len", "tiling")


def _fit_tool_config(path: str, *, batch_size: int | None, seq_len: int | None, methods: tuple[str, ...] | None,
                     revision: str | None = None, model_override: str | None = None, **options: Any) -> FitResult:
    """:func:`fit` of another tool's config: its model (or ``model_override``), its method (unless
    ``methods``), its effective batch and sequence length (unless given), its other knobs fixed, and
    DeepSpeed's buffers where its DeepSpeed config shards the run."""
    from memfit.interop import read_tool_config

    search = {k: options.pop(k) for k in ("gpu", "budget", "target", "max_seq_len", "progress", "workers", "plans_expected",
                                          "found", "stop", "exact")}
    tool = read_tool_config(path, model=model_override)
    knobs, dropped = tool.knobs_for(options)
    config_batch = int(knobs.get("batch_size", 1)) * int(knobs.get("grad_accum", 1))
    fixed = {k: v for k, v in knobs.items() if k not in _SEARCHED}
    # Adapters' optimizer states are small: the config's optimizer is kept (full fine-tuning's is searched).
    optimizers = {m: (knobs["optimizer"],) for m in ("lora", "qlora", "lora-8bit")} if knobs.get("optimizer") else None
    sharded = int(fixed.get("gpus", 1) or 1) > 1 and fixed.get("shard") == tool.shard
    # A batch or length given (even 0, which the search refuses) replaces the config's.
    result = fit(tool.model, revision=revision or tool.revision, batch_size=config_batch if batch_size is None else batch_size,
                 seq_len=knobs.get("seq_len") if seq_len is None else seq_len, methods=methods or (knobs.get("method", "lora"),),
                 optimizers=optimizers, deepspeed=tool.zero if sharded else None, **search, **fixed)
    config = tool.to_dict(given=options)
    config["not_modelled"] += [f.to_dict() for f in dropped]
    result.config = config
    return result


@dataclass
class _MethodOutcome:
    method: str
    fits: list[Fit]
    misses: list[Miss]
    longest: int
    longest_spec: dict[str, Any] | None
    plans: int


@dataclass
class _MethodJob:
    """Everything one method's search needs; picklable, so a worker process can run it."""

    model: str | dict
    target: Target
    base: dict[str, Any]
    supports_bf16: bool
    effective_batch: int
    seq_limit: int  # 0: do not search the longest sequence
    levels: list[tuple[int, str]] = field(default_factory=lambda: [(1, "none")])
    optimizers: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(OPTIMIZERS_LEAN_FIRST))
    deepspeed: Any = None  # a DeepSpeed config's settings, for the plans on several GPUs it shards
    exact: bool = False  # every plan exact (memfit.planner.shortcuts.switch)

    def planner(self, progress: Callable[[str], None] | None = None, gpus: int = 1, shard: str = "none") -> _Planner:
        base = dict(self.base)
        if gpus > 1:
            base.update(gpus=gpus, shard=shard)
        planner = _Planner(self.model, self.target, base, progress, self.deepspeed, self.exact)
        planner.supports_bf16 = self.supports_bf16
        planner.optimizers = self.optimizers
        return planner

    def parts(self, methods: tuple[str, ...]) -> tuple[str, ...]:
        """What the worker processes run: each method whole, or, on one GPU, its largest micro-batch
        (``METHOD:batch``) and its longest sequence (``METHOD:longest``) apart (they do not depend on
        each other there; on several GPUs the longest sequence is searched at the count the batch
        search ends at)."""
        if not self.seq_limit or len(self.levels) > 1:
            return tuple(methods)
        return tuple(f"{method}:{part}" for method in methods for part in ("batch", "longest"))

    def heaviest_first(self, part: str) -> tuple[int, int]:
        # The longest sequence plans lengths of several chunks (slowest); 4-bit layers simulate
        # slowest; full fine-tuning usually ends in a few plans.
        method, _, which = part.partition(":")
        return (which != "longest", _HEAVIEST_FIRST.index(method) if method in _HEAVIEST_FIRST else len(_HEAVIEST_FIRST))

    def run(self, part: str, progress: Callable[[str], None] | None = None) -> _MethodOutcome:
        """Search one part (:meth:`parts`): a method, or its ``batch`` or ``longest`` part alone."""
        method, _, which = part.partition(":")
        count, fits, misses = 0, [], []
        planner = self.planner(progress, *self.levels[0])
        if which != "longest":
            # Fewest GPUs first, least sharding first: the first level where anything fits is the answer.
            # Every level plans the same single-GPU simulations (cached), only the sharding arithmetic differs.
            for gpus, shard in self.levels:
                planner = self.planner(progress, gpus, shard)
                fits, misses = _search_method(planner, method, self.effective_batch)
                count += planner.count
                if fits:
                    break
        longest, spec = (0, None)
        if self.seq_limit and which != "batch":
            before = planner.count
            longest, spec = _longest_sequence(planner, method, self.seq_limit, self.effective_batch)
            count += planner.count - before
        return _MethodOutcome(method, fits, misses, longest, spec, count)


#: Heaviest first (4-bit layers simulate slowest; full fine-tuning usually ends in a few plans).
_HEAVIEST_FIRST = ("qlora", "lora-8bit", "lora", "full")


def _merged(method: str, outcomes: list[_MethodOutcome]) -> _MethodOutcome:
    """One method's outcome from its parts' (:meth:`_MethodJob.parts`)."""
    fits = [f for o in outcomes for f in o.fits]
    misses = [m for o in outcomes for m in o.misses]
    longest = max(outcomes, key=lambda o: (o.longest_spec is not None, o.longest))
    return _MethodOutcome(method, fits, misses, longest.longest, longest.longest_spec, sum(o.plans for o in outcomes))


def _plan_unplanned_misses(job: _MethodJob, misses: list[Miss], progress: Callable[[str], None] | None) -> int:
    """Plan the reported misses that were proven not to fit without a plan, for their figures
    (what they need, by how much they are over); the number of plans made."""
    planner = _Planner(job.model, job.target, {}, progress, job.deepspeed, job.exact)
    for miss in misses:
        if miss.device_total_bytes is None:
            candidate = planner(**miss.knobs)
            miss.device_total_bytes = candidate.device_total_bytes + int(candidate.details.get("paged_peak_bytes") or 0)
            miss.over_bytes = -candidate.headroom_bytes
    return planner.count


def _faster(a: dict[str, Any], b: dict[str, Any]) -> bool:
    speed_a, speed_b = relative_speeds([a, b])
    return speed_a > speed_b


def _search_method(planner: _Planner, method: str, effective_batch: int) -> tuple[list[Fit], list[Miss]]:
    """For each checkpointing setting of ``method``, fastest first: the preferred optimizer and the
    largest micro-batch that fit.

    A setting that fits the whole effective batch in one micro-batch makes the slower settings
    pointless (they cannot do better), so the search stops there.
    """
    fits: list[Fit] = []
    misses: list[Miss] = []
    options = micro_batches(effective_batch)
    for position, checkpointing in enumerate(CHECKPOINTING_FAST_FIRST):
        if position and len(options) > 1:
            whole = _whole_batch_at_once(planner, method, checkpointing, effective_batch)
            if whole is not None:
                fits.append(Fit(spec=whole.spec, plan=whole))
                break
        chosen = None
        # 32-bit AdamW first (exact); then lighter states, leanest last.
        for optimizer in planner.optimizers[method][::-1]:
            if mode_problems(planner.base.get("shard", "none"), planner.base.get("gpus", 1), optimizer):
                continue  # cannot run with this shard mode
            knobs = dict(method=method, optimizer=optimizer, checkpointing=checkpointing, batch_size=1, grad_accum=effective_batch)
            if planner.cannot_fit(**knobs):
                # Full fine-tuning of a model whose states alone are over the target (8B on 24 GB):
                # a plan could only say that it does not fit.
                misses.append(planner.unplanned_miss(**knobs))
                continue
            candidate = planner(**knobs)
            if candidate.fits:
                chosen = candidate
                break
            # What it needs: the device total, plus paged optimizer states where the search counts them.
            needed = candidate.device_total_bytes + int(candidate.details.get("paged_peak_bytes") or 0)
            misses.append(Miss(candidate.spec, needed, -candidate.headroom_bytes))
        if chosen is None:
            continue  # leaner checkpointing may still fit
        knobs = {"method": method, "optimizer": chosen.spec["optimizer"], "checkpointing": checkpointing}
        best = largest_micro_batch(lambda b, accum, knobs=knobs: planner(**knobs, batch_size=b, grad_accum=accum), options, effective_batch, chosen)
        fits.append(Fit(spec=best.spec, plan=best))
        if best.spec["batch_size"] == options[-1]:
            break
    return fits, misses


def _whole_batch_at_once(planner: _Planner, method: str, checkpointing: str, effective_batch: int) -> MemoryPlan | None:
    """The plan of the whole effective batch in one micro-batch with the optimizer the search tries
    first, when it fits; else None (one plan made, or none when that optimizer is ruled out).

    Once a faster setting has been planned, a slower one (more checkpointing) usually fits the whole
    batch at once, and then it is the answer :func:`_search_method` reaches from micro-batch 1 in
    several plans: that optimizer fits at micro-batch 1 too (memory grows with the micro-batch), the
    largest micro-batch is the whole batch, and no optimizer of this setting misses. When it does
    not fit, the search goes on from micro-batch 1 as if this plan had not been made.
    """
    for optimizer in planner.optimizers[method][::-1]:
        if mode_problems(planner.base.get("shard", "none"), planner.base.get("gpus", 1), optimizer):
            continue
        knobs = dict(method=method, optimizer=optimizer, checkpointing=checkpointing, batch_size=effective_batch, grad_accum=1)
        # Only the first optimizer the search would plan: a leaner one would leave misses to report.
        if planner.cannot_fit(**knobs):
            return None
        candidate = planner(**knobs)
        return candidate if candidate.fits else None
    return None


def expected_plans(methods: int, effective_batch: int, *, longest: bool = True) -> int:
    """About how many plans :func:`fit` makes for ``methods`` methods: an estimate for its progress
    line, not a bound (a search proven short by the model states' floor makes fewer; one that needs
    several GPU counts, more).

    Per method: the first setting that fits at micro-batch 1, often after a faster one that does
    not; the largest micro-batch, a guess confirmed in about log2 of the splits of the effective
    batch; and the longest sequence, two plans to learn the step over lengths from and one to
    check the answer (:func:`_predicted_boundary`).
    """
    splits = len(micro_batches(effective_batch))
    per_method = 2 + math.ceil(math.log2(splits)) + (3 if longest else 0)
    return methods * per_method


def micro_batches(effective_batch: int) -> list[int]:
    """Micro-batch sizes that divide the effective batch (so gradient accumulation keeps it exactly)."""
    return [b for b in range(1, effective_batch + 1) if effective_batch % b == 0]


def _largest_fitting(
    check: Callable[[int], MemoryPlan],
    lo: int,
    hi: int,
    guess: int | None,
    best: MemoryPlan | None,
    *,
    interpolate: bool = False,
    hi_plan: MemoryPlan | None = None,
):
    """Largest index in (lo, hi) whose plan fits, given ``lo`` fits (or is a sentinel) and ``hi`` does not.

    Memory grows with the index. The search starts at ``guess`` and steps away from it (1, 2, 4...)
    in the direction the plans point until the boundary is bracketed, then narrows the bracket:
    by bisection, or with ``interpolate`` (memory close to linear in the index, as it is in
    sequence length) where the headroom crosses zero between the bracket's ends, from the first
    plan on when ``hi_plan`` (the plan of ``hi``) gives the far end's headroom. Memory is not quite
    linear, so interpolation from the same stale end would creep up on the boundary one side at a
    time; when one end moves twice running, the other end's headroom counts half (the Illinois
    rule), which keeps the bracket closing from both sides. Two plans when the guess is right.
    """
    index = min(max(guess, lo + 1), hi - 1) if guess is not None else None
    step, direction = 1, 0
    # The headroom of the known-fitting end: once a plan fails, the boundary can be interpolated.
    lo_room = best.headroom_bytes if best is not None else None
    hi_room = hi_plan.headroom_bytes if hi_plan is not None else None
    lo_weight = hi_weight = 1.0  # Illinois: halved while the other end keeps moving
    same_side = 0

    def interpolated() -> int:
        a, b = lo_room * lo_weight, hi_room * hi_weight
        return min(max(lo + int((hi - lo) * a / (a - b)), lo + 1), hi - 1)

    if interpolate and lo_room is not None and hi_room is not None and hi - lo > 1:
        index = interpolated()
    while hi - lo > 1:
        if index is None or not lo < index < hi:
            index = (lo + hi) // 2
        result = check(index)
        moved_lo = result.fits
        if moved_lo:
            lo, best, lo_room, lo_weight = index, result, result.headroom_bytes, 1.0
        else:
            hi, hi_room, hi_weight = index, result.headroom_bytes, 1.0
        same_side = same_side + 1 if (moved_lo and direction > 0) or (not moved_lo and direction < 0) else 0
        if lo_room is not None and hi_room is not None:
            if interpolate:
                if same_side:
                    if moved_lo:
                        hi_weight /= 2
                    else:
                        lo_weight /= 2
                index = interpolated() if hi - lo > 1 else None
            else:
                index = None
        else:  # not bracketed yet: keep stepping away from the guess
            index = index + step if moved_lo else index - step
            step *= 2
        direction = 1 if moved_lo else -1
    return lo, best


def largest_micro_batch(plan_at: Callable[[int, int], MemoryPlan], options: list[int], effective_batch: int,
                        at_one: MemoryPlan) -> MemoryPlan:
    """The plan with the largest micro-batch in ``options`` (ascending divisors of ``effective_batch``)
    that fits; ``at_one``, micro-batch 1's plan, fits. ``plan_at(micro_batch, grad_accum)`` plans one.

    What one more sequence costs is guessed from micro-batch 1's plan (its activations and
    temporaries grow with the batch; weights and states do not), and confirmed with plans.
    """

    def check(index: int) -> MemoryPlan:
        b = options[index]
        return plan_at(b, effective_batch // b)

    if len(options) == 1:
        return at_one
    per_sample = max(at_one.categories["activations"] + at_one.categories["temporaries"], 1)
    room = at_one.headroom_bytes
    guess = max((i for i, b in enumerate(options) if (b - 1) * per_sample <= room), default=0)
    _, best = _largest_fitting(check, 0, len(options), max(guess, 1), at_one)
    return best


def _longest_sequence(planner: _Planner, method: str, limit: int, effective_batch: int) -> tuple[int, dict[str, Any] | None]:
    """Longest sequence (a multiple of SEQ_STEP, at most ``limit``) that ``method`` fits.

    Micro-batch 1 (with gradient accumulation for the effective batch), the method's leanest
    settings (offloaded checkpointing, tiling on, its leanest optimizer).
    Returns (0, None) when not even SEQ_STEP tokens fit.
    """
    lean = [o for o in planner.optimizers[method]
            if not mode_problems(planner.base.get("shard", "none"), planner.base.get("gpus", 1), o)]
    # Tiling on at every length: the leanest setting, and it keeps memory monotonic in the length
    # (with auto, lengths just below TILING_AUTO_TOKENS can need more than the threshold itself).
    knobs = {"method": method, "optimizer": lean[0], "checkpointing": "offload",
             "batch_size": 1, "grad_accum": effective_batch}
    if planner.base.get("recipe", "memfit") == "memfit":
        knobs["tiling"] = "on"  # the hf recipe has no tiling to turn on

    def check(steps: int) -> MemoryPlan:
        return planner(**knobs, seq_len=steps * SEQ_STEP)

    top = limit // SEQ_STEP
    if top < 1:
        return 0, None
    if planner.cannot_fit(**knobs, seq_len=SEQ_STEP):
        return 0, None  # the floor is the model states', the same at every length: no length fits
    # The first plan is taken where the step is what it is at long lengths (tiling on from
    # TILING_AUTO_TOKENS), so that what it shows holds far out.
    long_lengths = limit > 4 * TILING_AUTO_TOKENS
    mid = min(max(2048, TILING_AUTO_TOKENS) // SEQ_STEP, top) if long_lengths else min(2048 // SEQ_STEP, top)
    at_mid = check(mid)
    if at_mid.fits:
        if mid == top:
            return top * SEQ_STEP, at_mid.spec
        bracket = _Bracket(mid, top + 1, at_mid, None)
        if long_lengths and not planner.exact:  # a model of the step over lengths is a shortcut
            found = _predicted_boundary(planner, knobs, at_mid, bracket)
            if found is not None:
                return bracket.lo * SEQ_STEP, found.spec
        # Without a model of the step over lengths: two plans give the bytes per token; the boundary
        # is predicted from them, then confirmed.
        if bracket.hi_plan is None and bracket.lo == mid:
            far = min(2 * mid, top)
            bracket.narrow(far, check(far))
        high, high_plan = (bracket.hi, bracket.hi_plan) if bracket.hi_plan is not None else (bracket.lo, bracket.best)
        low_plan, low = at_mid, mid
    else:
        at_one = check(1)
        if not at_one.fits:
            return 0, None
        bracket = _Bracket(1, mid, at_one, at_mid)
        low_plan, low, high_plan, high = at_one, 1, at_mid, mid
    lo, hi, best, hi_plan = bracket.lo, bracket.hi, bracket.best, bracket.hi_plan
    guess = _boundary_guess(low, low_plan, high, high_plan)
    if guess >= top and hi > top and lo < top:
        # Predicted to fit all the way: one plan at the limit confirms it.
        at_top = check(top)
        if at_top.fits:
            return top * SEQ_STEP, at_top.spec
        hi, hi_plan = top, at_top
    steps, best = _largest_fitting(check, lo, hi, guess, best, interpolate=True, hi_plan=hi_plan)
    return steps * SEQ_STEP, best.spec


def _boundary_guess(low: int, low_plan: MemoryPlan, high: int, high_plan: MemoryPlan) -> int:
    """Where the line through two plans (lengths in SEQ_STEPs) runs out of headroom."""
    per_step = max((high_plan.device_total_bytes - low_plan.device_total_bytes) / max(high - low, 1), 1.0)
    return low + int(low_plan.headroom_bytes // per_step)


@dataclass
class _Bracket:
    """The longest-sequence search's state, in SEQ_STEPs: ``lo`` fits (its plan ``best``), ``hi``
    does not (its plan ``hi_plan``, or None for one past the limit)."""

    lo: int
    hi: int
    best: MemoryPlan
    hi_plan: MemoryPlan | None

    def narrow(self, steps: int, result: MemoryPlan) -> None:
        if result.fits and steps > self.lo:
            self.lo, self.best = steps, result
        elif not result.fits and steps < self.hi:
            self.hi, self.hi_plan = steps, result


def _predicted_boundary(planner: _Planner, knobs: dict[str, Any], first_plan: MemoryPlan,
                        bracket: _Bracket) -> MemoryPlan | None:
    """The plan of the longest sequence, found from a model of the step over lengths
    (:mod:`memfit.planner.shortcuts.lengths`), with ``bracket.lo`` its length; None when the search must go on
    without one (``bracket`` narrowed by the plans made here).

    ``first_plan``: the plan of ``bracket.lo``. One more length is planned
    (:func:`~memfit.planner.shortcuts.lengths.second_length`), the model learnt from the two, and the boundary
    searched on its predictions, which cost a replay of the allocator instead of a simulation. One
    plan then checks the answer: the predicted longest length's (or, when that was planned already,
    the next one's), which must be its prediction, storage by storage.
    """
    from memfit.planner.shortcuts.lengths import LengthSampler, Unpredictable, second_length

    first = bracket.lo
    second = second_length(first * SEQ_STEP, SEQ_STEP) // SEQ_STEP
    if second >= bracket.hi:
        return None
    at_second = planner(**knobs, seq_len=second * SEQ_STEP)
    bracket.narrow(second, at_second)
    if bracket.hi - bracket.lo <= 1:
        return bracket.best
    sampler = LengthSampler((first * SEQ_STEP, second * SEQ_STEP))

    def predict(steps: int) -> MemoryPlan:
        return planner.predict(sampler, **knobs, seq_len=steps * SEQ_STEP)

    try:
        guess = _boundary_guess(first, first_plan, second, at_second)
        hi, hi_plan = bracket.hi, bracket.hi_plan
        # The limit predicted first: the boundary is then interpolated from both ends at once (memory
        # is close to linear in the length), in a few predictions instead of steps out from the guess.
        at_top = predict(hi - 1) if hi_plan is None and hi - 1 > bracket.lo else None
        if at_top is not None and at_top.fits:
            steps, predicted = hi - 1, at_top  # every length up to the limit fits
        else:
            if at_top is not None:
                hi, hi_plan = hi - 1, at_top
            steps, predicted = _largest_fitting(predict, bracket.lo, hi, guess, bracket.best, interpolate=True,
                                                hi_plan=hi_plan)
        check = steps if predicted is not bracket.best else steps + 1
        if check == bracket.hi:
            return bracket.best  # the next length was planned already: it does not fit
        expected = predicted if check == steps else predict(check)
    except Unpredictable:
        return None
    exact = planner(**knobs, seq_len=check * SEQ_STEP)
    bracket.narrow(check, exact)
    same = exact.fits == expected.fits and exact.device_total_bytes == expected.device_total_bytes
    # Storage by storage where its simulations were made here (not where the plan came from the cache).
    if same and sampler.explains(check * SEQ_STEP) is not False:
        return bracket.best
    return None


def _describe(knobs: dict[str, Any]) -> str:
    return (f"{knobs.get('method')} · checkpointing {knobs.get('checkpointing')} · {knobs.get('optimizer')} · "
            f"micro-batch {knobs.get('batch_size')} · {knobs.get('seq_len')} tokens"
            + (f" · {knobs['gpus']} GPUs, {knobs.get('shard')}" if knobs.get("gpus", 1) > 1 else ""))
