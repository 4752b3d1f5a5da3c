"""What ``memfit fit`` is asked (:class:`FitRequest`) and what its caller is told as it goes
(:class:`FitEvents`).

A request holds the model, what to fit it to, the effective batch and sequence length, the GPU
count, and the RunSpec knobs every plan of the search holds (``knobs``: validated against
RunSpec's fields when the request is made; their values are checked with every other input
before the search, so that every problem is listed at once). :func:`keyword_request` reads the
keyword arguments of :func:`memfit.fit` into a request and its events.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from memfit.planner.errors import SearchCancelled
from memfit.planner.target import Target
from memfit.spec import KNOBS, make_spec

if TYPE_CHECKING:  # pragma: no cover
    from memfit.planner.search.results import Fit

#: RunSpec knobs that are fields of the request itself, with a meaning of their own in a search:
#: the effective batch, the length held, "up to N GPUs".
OWN_KNOBS = ("batch_size", "seq_len", "gpus")


@dataclass(frozen=True)
class FitRequest:
    """One ``memfit fit`` search: what to fit, to what, and what every plan of it holds.

    Attributes:
        model: a catalog name, a Hub id, a config.json or model folder, a config dict; or another
            tool's training config (:mod:`memfit.interop`): its method, knobs, effective batch and
            sequence length are kept (the fields and knobs given here replace them) and its
            micro-batch, accumulation, checkpointing and optimizer searched, with the step it runs.
        gpu, budget: a GPU catalog name, a memory budget (``"24GiB"`` or bytes); or ``target``, a
            :class:`~memfit.planner.target.Target` made already.
        revision: branch, tag or commit of a Hugging Face Hub id (default: main).
        methods: the methods to search (default: full, lora, qlora; lora-8bit only when named).
            With adapter options among ``knobs`` (``dora``, ``rslora``, ``modules_to_save``) every
            plan has them, and the default is the methods that take them.
        batch_size: the effective batch (sequences per optimizer step) each fit splits into a
            micro-batch and gradient accumulation (default 8). A whole number, or the command
            line's text that is not one (the search's checks name it with every other problem).
        seq_len: the sequence length held (default: RunSpec's, or the model's maximum if smaller).
        max_seq_len: also find the longest sequence each method fits (micro-batch 1).
        gpus: "up to N GPUs" (None: one): each method is searched on 1, 2, 4... up to N GPUs and
            reported at the smallest count that fits, with the first shard mode that fits (the
            ``shard`` knob, or ddp, zero2, fsdp, fsdp-offload in turn); memory is then per GPU.
        knobs: the RunSpec knobs every plan holds (rank, alpha, targets, precision, shard...), as
            :func:`memfit.spec.make_spec` takes them. Without a precision, bf16 is used where the GPU
            supports it, else fp16 (LoRA, QLoRA) or fp32 (full).
        optimizers: the optimizers to try for a method, leanest first, where not
            :data:`~memfit.planner.search.micro_batch.OPTIMIZERS_LEAN_FIRST`'s.
        deepspeed: a DeepSpeed config's settings, for the plans on several GPUs its ZeRO stage shards.
        workers: processes to search the methods in (default: one per method, at most one per core).
        model_override: with another tool's config as ``model``, the model to fit in its place.
        exact: every plan made the long way (:func:`memfit.planner.api.plan`'s ``exact``), and the
            longest sequence searched with plans alone.
    """

    model: str | dict
    gpu: str | None = None
    budget: str | int | None = None
    target: Target | None = None
    revision: str | None = None
    methods: tuple[str, ...] | None = None
    batch_size: int | str | None = None
    seq_len: int | str | None = None
    max_seq_len: bool = True
    gpus: int | str | None = None
    knobs: Mapping[str, Any] = field(default_factory=dict)
    optimizers: Mapping[str, tuple[str, ...]] | None = None
    deepspeed: Any = None
    workers: int | None = None
    model_override: str | None = None
    exact: bool = False

    def __post_init__(self) -> None:
        knobs = dict(self.knobs)  # the caller's dict stays theirs
        own = [name for name in knobs if name in OWN_KNOBS]
        if own:
            raise TypeError(f"FitRequest: give {', '.join(own)} as the request's own field, not among knobs")
        unknown = [name for name in knobs if name.replace("-", "_") not in KNOBS]
        if unknown:
            # make_spec says it as everywhere: SpecError, "unknown knob 'x'. Did you mean...?"
            make_spec(**{name: knobs[name] for name in unknown})
        object.__setattr__(self, "knobs", knobs)
        if self.methods is not None:
            object.__setattr__(self, "methods", tuple(self.methods))


@dataclass(frozen=True)
class FitEvents:
    """What a search tells its caller as it goes; each is optional.

    Attributes:
        progress: called with each plan's description as it starts (from the worker processes too).
        plans_expected: called once, when the inputs are validated and before the first plan, with
            about how many plans the search will make
            (:func:`~memfit.planner.search.driver.expected_plans`).
        found: called with a method and its fits (not yet ranked: speeds are relative to the fastest
            fit of all methods) as soon as that method's search ends.
        stop: when set (by another thread), the search ends where it is, its worker processes
            ended, and raises :class:`~memfit.planner.errors.SearchCancelled`.
    """

    progress: Callable[[str], None] | None = None
    plans_expected: Callable[[int], None] | None = None
    found: Callable[[str, list[Fit]], None] | None = None
    stop: threading.Event | None = None

    def expect(self, plans: int) -> None:
        if self.plans_expected is not None:
            self.plans_expected(plans)

    def method_found(self, method: str, fits: list[Fit]) -> None:
        if self.found is not None:
            self.found(method, fits)

    def plan_reporter(self) -> Callable[[str], None] | None:
        """What the search calls before each plan it makes: ``progress``, raising
        :class:`SearchCancelled` first once ``stop`` is set (the plans of worker processes are
        stopped by :func:`~memfit.planner.shortcuts.workers.run_parallel`). None when there is
        nothing to tell: the workers then report nothing."""
        if self.stop is None:
            return self.progress
        stop, progress = self.stop, self.progress

        def checked(message: str) -> None:
            if stop.is_set():
                raise SearchCancelled()
            if progress is not None:
                progress(message)

        return checked


_REQUEST_FIELDS = tuple(f.name for f in fields(FitRequest) if f.name not in ("model", "knobs"))
_EVENT_FIELDS = tuple(f.name for f in fields(FitEvents))


def keyword_request(model: str | dict, **options: Any) -> tuple[FitRequest, FitEvents]:
    """The request and events of :func:`memfit.fit`'s keyword arguments: :class:`FitRequest`'s
    fields, :class:`FitEvents`' callbacks, and every other name a RunSpec knob held fixed."""
    given = {name: options.pop(name) for name in _REQUEST_FIELDS if name in options}
    events = FitEvents(**{name: options.pop(name) for name in _EVENT_FIELDS if name in options})
    return FitRequest(model, knobs=options, **given), events
