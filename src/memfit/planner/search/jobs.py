"""One method's search, as a worker process runs it: :class:`MethodJob` holds everything the search
of a method needs (picklable), and runs a method whole or one of its parts (its largest micro-batch,
its longest sequence), on the GPU counts and shard modes of ``--gpus N`` fewest first."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memfit.planner.search.longest import longest_sequence
from memfit.planner.search.micro_batch import search_method
from memfit.planner.search.plans import OPTIMIZERS_LEAN_FIRST, SearchPlanner
from memfit.planner.search.results import Fit, Miss
from memfit.planner.target import Target
from memfit.spec import TRAINED_SHARD_MODES

#: With ``--gpus N`` and no ``--shard``: the modes tried at each GPU count, least communication
#: first; the ones memfit train runs, so every fit can be written as a config and trained (zero3
#: is fsdp).
SHARD_FAST_FIRST = tuple(mode for mode in TRAINED_SHARD_MODES if mode != "zero3")
#: Heaviest first (4-bit layers simulate slowest; full fine-tuning usually ends in a few plans).
_HEAVIEST_FIRST = ("qlora", "lora-8bit", "lora", "full")


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
class MethodOutcome:
    """What one method's search (or a part of it) found, and the plans it made."""

    method: str
    fits: list[Fit]
    misses: list[Miss]
    longest: int
    longest_spec: dict[str, Any] | None
    plans: int
    longest_by_gpus: list[dict[str, Any]] = field(default_factory=list)  # see MethodJob.longest_by_gpus


@dataclass
class MethodJob:
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
    exact: bool = False  # every plan made the long way

    def planner(
        self, progress: Callable[[str], None] | None = None, gpus: int = 1, shard: str = "none", **knobs: Any
    ) -> SearchPlanner:
        """The planner of this job's plans on ``gpus`` GPUs sharded by ``shard`` (``knobs``: in place
        of the job's own)."""
        base = dict(self.base, **knobs)
        if gpus > 1:
            base.update(gpus=gpus, shard=shard)
        planner = SearchPlanner(self.model, self.target, base, progress, self.deepspeed, exact=self.exact)
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
        weight = _HEAVIEST_FIRST.index(method) if method in _HEAVIEST_FIRST else len(_HEAVIEST_FIRST)
        return (which != "longest", weight)

    def run(self, part: str, progress: Callable[[str], None] | None = None) -> MethodOutcome:
        """Search one part (:meth:`parts`): a method, or its ``batch`` or ``longest`` part alone."""
        method, _, which = part.partition(":")
        count, fits, misses = 0, [], []
        planner = self.planner(progress, *self.levels[0])
        if which != "longest":
            # Fewest GPUs first, least sharding first: the first level where anything fits is the answer.
            # Every level plans the same single-GPU simulations (cached), only the sharding arithmetic differs.
            for gpus, shard in self.levels:
                planner = self.planner(progress, gpus, shard)
                fits, misses = search_method(planner, method, self.effective_batch)
                count += planner.count
                if fits:
                    break
        longest, spec = (0, None)
        if self.seq_limit and which != "batch":
            before = planner.count
            longest, spec = longest_sequence(planner, method, self.seq_limit, self.effective_batch)
            count += planner.count - before
        by_gpus, plans = self.longest_by_gpus(method, progress) if which != "batch" else ([], 0)
        return MethodOutcome(method, fits, misses, longest, spec, count + plans, by_gpus)

    def longest_by_gpus(
        self, method: str, progress: Callable[[str], None] | None = None
    ) -> tuple[list[dict[str, Any]], int]:
        """With sequence parallelism and a longest sequence to search: ``method``'s longest sequence
        at each GPU count searched (its most sharded mode), with the degree asked and without
        sequence parallelism; and the plans made. Each count plans the same one-rank simulations
        (cached), only the sharding arithmetic differs, so the rows after the first cost little."""
        degree = int(self.base.get("sequence_parallel") or 1)
        if not self.seq_limit or degree <= 1:
            return [], 0
        rows, count = [], 0
        for gpus, shard in dict(self.levels).items():  # a count's last mode: the most sharded
            row: dict[str, Any] = {"gpus": gpus, "shard": shard, "sequence_parallel": degree}
            for key, knobs in (("seq_len", {}), ("without", {"sequence_parallel": 1})):
                planner = self.planner(progress, gpus, shard, **knobs)
                row[key], _ = longest_sequence(planner, method, self.seq_limit, self.effective_batch)
                count += planner.count
            rows.append(row)
        return rows, count


def merged_outcome(method: str, outcomes: list[MethodOutcome]) -> MethodOutcome:
    """One method's outcome from its parts' (:meth:`MethodJob.parts`)."""
    fits = [f for o in outcomes for f in o.fits]
    misses = [m for o in outcomes for m in o.misses]
    longest = max(outcomes, key=lambda o: (o.longest_spec is not None, o.longest))
    by_gpus = [row for o in outcomes for row in o.longest_by_gpus]
    plans = sum(o.plans for o in outcomes)
    return MethodOutcome(method, fits, misses, longest.longest, longest.longest_spec, plans, by_gpus)
