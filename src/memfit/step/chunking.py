"""Where the step's chunked loops start, and the planner's shortcut through them.

The fused loss (:mod:`memfit.step.losses`) and the tiled MLPs and norms
(:mod:`memfit.step.tiling`) loop over chunks of the tokens. Every chunk after the first does
exactly what the one before it did: the same ops on tensors of the same shapes, each transient
freed before the next chunk starts (the outputs and gradient accumulators they write into exist
from the first chunk on). So the memory timeline of chunks 2..n-1 is chunk 1's, repeated, and the
caching allocator, back in the same state after each, hands out the same blocks each time.

The planner runs the real step on fake tensors, where a 128k-token sequence means hundreds of
identical chunk iterations and a minute of simulation. Under fake tensors the loops therefore run
the first two chunks and the last one: the same peak, the same categories, the same reserved
memory (a test compares both ways). Real tensors always run every chunk.

A chunk's work is also the same from one call to the next: the same module on the same shapes in
every micro-batch, in forward and in the recomputation of an activation checkpoint. The loops run
that work through :func:`run_region`; the planner, which only needs the memory it makes, records it
the first time and replays its allocations after that (:mod:`memfit.planner.shortcuts.regions`). On real
tensors, and without the planner, :func:`run_region` is a plain call.

So is a micro-batch's: the first micro-batch of every optimizer step runs with no gradients held
yet, on a batch of the same shapes, and makes the same memory each time; the next ones make it too,
but for the gradients they add into the ones held. The step runs each micro-batch through
:func:`run_micro_batch`, and the planner replays the first step's first micro-batch for the
micro-batches of the next step instead of running them (:mod:`memfit.planner.shortcuts.micro_batches`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

#: Set to False to make fake runs go through every chunk too (tests compare both ways).
SHORTCUT_FAKE_CHUNKS = True

#: The loops a fake run went through, as (rows, chunk) pairs, while :func:`recording_loops` is on.
_recorded: list[set[tuple[int, int]]] = []


@contextlib.contextmanager
def recording_loops() -> Iterator[set[tuple[int, int]]]:
    """Collect the (rows, chunk) of every chunked loop a fake run goes through in this block.

    The planner reads how a tensor's size follows the sequence length from them
    (:mod:`memfit.planner.shortcuts.lengths`): inside a loop's last chunk, a dimension is what is left of the
    rows after the full chunks.
    """
    loops: set[tuple[int, int]] = set()
    _recorded.append(loops)
    try:
        yield loops
    finally:
        _recorded.remove(loops)


#: What runs a region under the planner (:func:`replaying_regions`); innermost last.
RegionRunner = Callable[[Any, str, Callable[..., Any], tuple], Any]
_region_runners: list[RegionRunner] = []


def run_region(owner: Any, what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``: one chunk's work (``what``, e.g. ``"tiled-forward"``) of ``owner``, the module
    whose chunk it is.

    A region's only effects are its return value (new tensors, or None) and the tensors it makes
    and frees before it returns, and the memory it makes depends only on ``owner``'s state, ``what``,
    the shapes of ``args`` (and their other values) and the grad, autocast and autograd modes it
    runs under. The planner replays the memory of a region it has seen with all of these the same
    instead of running it again.
    """
    if _region_runners and any(isinstance(a, torch.Tensor) and is_fake(a) for a in args):
        return _region_runners[-1](owner, what, fn, args)
    return fn(*args)


def replaying_regions(runner: RegionRunner) -> contextlib.AbstractContextManager[None]:
    """Run the regions of fake runs in this block through ``runner(owner, what, fn, args)``."""
    return _innermost(_region_runners, runner)


#: What runs a micro-batch under the planner (:func:`replaying_micro_batches`); innermost last.
MicroBatchRunner = Callable[[Any, Callable[..., Any], tuple], Any]
_micro_batch_runners: list[MicroBatchRunner] = []


def run_micro_batch(model: Any, fn: Callable[..., Any], batch: Any, totals: Any, count: int, observer: Any) -> Any:
    """``fn(model, batch, totals, count, observer)``: one micro-batch's forward and backward.

    Its effects are its return value, the tensors it makes and frees before it returns, the
    gradients it accumulates into ``model``'s parameters and the phases it tells ``observer``; what
    it allocates depends only on ``model``'s state, the shapes of ``batch`` and ``totals``, the
    gradients already held and the modes it runs under (not on ``count``, a divisor). The planner
    replays the memory of one it has seen with all of these the same.
    """
    args = (model, batch, totals, count, observer)
    if _micro_batch_runners and any(is_fake(t) for t in _tensors(batch)):
        return _micro_batch_runners[-1](model, fn, args)
    return fn(*args)


def replaying_micro_batches(runner: MicroBatchRunner) -> contextlib.AbstractContextManager[None]:
    """Run the micro-batches of fake runs in this block through ``runner(model, fn, args)``."""
    return _innermost(_micro_batch_runners, runner)


@contextlib.contextmanager
def _innermost(runners: list, runner: Any) -> Iterator[None]:
    """``runner`` last in ``runners`` (the one that runs) while the block runs."""
    runners.append(runner)
    try:
        yield
    finally:
        runners.remove(runner)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def chunk_starts(total: int, chunk: int, like: torch.Tensor | None = None) -> list[int]:
    """Start offsets of the chunks of ``chunk`` rows over ``total`` rows.

    With ``like`` a fake tensor (the planner), only the first two chunks and the last one (the
    first allocates what later chunks reuse, the second stands for every full chunk after it, the
    last may be partial).
    """
    starts = list(range(0, total, chunk))
    fake = like is not None and is_fake(like)
    if fake and _recorded:
        _recorded[-1].add((int(total), int(chunk)))
    if SHORTCUT_FAKE_CHUNKS and len(starts) > 3 and fake:
        return starts[:2] + starts[-1:]
    return starts


def is_fake(x: torch.Tensor) -> bool:
    """Whether ``x`` is a fake tensor (no storage, no values: the planner's simulation)."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return _is_fake(x)
