"""Where the training step meets its simulation: the questions it asks, and who may answer them.

The planner runs this package's step on fake tensors, which have shapes and no values, and it runs
them in a fraction of the step's time by not running again what would only repeat known memory.
The step knows nothing of either. It asks the few questions whose answers differ between a run and
a simulation here, each named for what it asks, and runs two kinds of self-contained work through
here; this module alone knows fake tensors and the planner's runner:

- :func:`chunks_to_run`: which chunks of a chunked loop run (the fused loss, the tiled MLPs and
  norms, TRL's and Liger's chunked losses);
- :func:`run_region`: one chunk's work, whose memory depends only on its module, its arguments'
  shapes and the modes it runs under;
- :func:`run_micro_batch`: one micro-batch's forward and backward, the same;
- :func:`token_count_known`: whether a count a tensor holds can be read (fake tensors hold none);
- :func:`host_copy_pinnable`: whether a host copy of a CPU tensor can be pinned;
- :func:`keeps_dropout_masks`: whether a recomputation must replay dropout's random masks.

Every chunk after the first of a chunked loop does what the one before it did: the same ops on
tensors of the same shapes, each transient freed before the next chunk starts. A chunk's work is
the same from one call to the next too (every micro-batch, the recomputation of an activation
checkpoint), and so is a micro-batch's. A :class:`Runner` installed with :func:`running` (the
planner's, :mod:`memfit.planner.shortcuts.replay`) answers the first three for work on fake tensors:
it may run only the chunks that stand for the others and replay the memory of work it has seen.
Without one (the trainer, and every call on real tensors) each is the plain thing: every chunk
runs, and the work is a plain call.

Module state that decides what a module's forward allocates is declared here, next to the code
that sets it (:func:`memory_attribute`): a private attribute the planner could not tell from
bookkeeping otherwise. The planner keys what it replays by the declared set
(:func:`memory_attributes`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(slots=True)
class Unit:
    """One piece of self-contained work: a chunk's (a *region*) or a micro-batch's.

    Its only effects are its return value (new tensors, or None), the tensors it makes and frees
    before it returns, the phases it tells ``observer`` and, for a micro-batch, the gradients it
    accumulates into ``owner``'s parameters. What it allocates depends only on ``owner``'s state,
    ``what``, the shapes (and plain values) of ``inputs``, the gradients ``owner`` holds and the
    grad, autocast and autograd modes it runs under. A region is a micro-batch without phases or
    gradients.
    """

    owner: Any  # the module whose work it is
    what: str  # "tiled-forward", "tiled-backward", "micro-batch"
    run: Callable[[Any], Any]  # does the work, telling its phases to the observer it is given
    inputs: tuple  # what it works on: tensors (by their shapes) and plain values, nested
    observer: Any = None  # told the phases (a micro-batch's step observer); None: it has none
    gradients: bool = False  # it accumulates gradients into ``owner``'s parameters


class Runner(Protocol):
    """Answers the step's questions for work on fake tensors while installed (:func:`running`)."""

    def chunk_starts(self, starts: list[int], total: int, chunk: int) -> list[int]:
        """The chunks that run, of ``starts`` (every chunk of ``chunk`` rows over ``total`` rows)."""

    def run(self, unit: Unit) -> Any:
        """``unit.run(unit.observer)``, or what makes the same memory and returns the same layout."""


#: The installed runners, innermost last (the one that answers).
_runners: list[Runner] = []


@contextlib.contextmanager
def running(runner: Runner) -> Iterator[Runner]:
    """``runner`` answers the step's questions about fake tensors while the block runs."""
    _runners.append(runner)
    try:
        yield runner
    finally:
        _runners.remove(runner)


def chunks_to_run(total: int, chunk: int, like: torch.Tensor | None = None) -> list[int]:
    """Start offsets of the chunks of ``chunk`` rows over ``total`` rows that a loop runs over
    ``like``: every chunk, or on fake tensors those the installed runner picks."""
    starts = list(range(0, total, chunk))
    if _runners and like is not None and _fake(like):
        return _runners[-1].chunk_starts(starts, total, chunk)
    return starts


def run_region(owner: Any, what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``: one chunk's work (``what``, e.g. ``"tiled-forward"``) of ``owner``, the module
    whose chunk it is; its memory as :class:`Unit` says."""
    if _runners and any(isinstance(a, torch.Tensor) and _fake(a) for a in args):
        return _runners[-1].run(Unit(owner, what, lambda observer: fn(*args), args))
    return fn(*args)


def run_micro_batch(model: Any, fn: Callable[..., Any], batch: Any, totals: Any, count: int, observer: Any) -> Any:
    """``fn(model, batch, totals, count, observer)``: one micro-batch's forward and backward.

    Its memory is as :class:`Unit` says, with ``batch`` and ``totals`` what it works on (not
    ``count``, a divisor).
    """
    if _runners and any(_fake(t) for t in _tensors(batch)):
        unit = Unit(
            model, "micro-batch", lambda told: fn(model, batch, totals, count, told), (batch, totals), observer, True
        )
        return _runners[-1].run(unit)
    return fn(model, batch, totals, count, observer)


def token_count_known(count: torch.Tensor) -> bool:
    """Whether the number ``count`` holds can be read. A simulation's fake tensors hold no values:
    the step then takes the most the count can be."""
    return not _fake(count)


def host_copy_pinnable(source: torch.Tensor) -> bool:
    """Whether a host copy of ``source``, a CPU tensor, can be allocated pinned: with an
    accelerator's pinned-memory allocator, and always in a simulation (fake tensors pin without
    one, and the planner's tracker counts pinned storages as host memory)."""
    return _fake(source) or torch.cuda.is_available()


def keeps_dropout_masks(x: torch.Tensor) -> bool:
    """Whether a recomputation over ``x`` must replay the random masks dropout drew in forward. Not
    in a simulation: fake tensors have no values to mask, and capturing a fake CUDA device's random
    state would need a real one."""
    return not _fake(x)


#: The module attributes declared as deciding memory (:func:`memory_attribute`).
_memory_attributes: set[str] = set()


def memory_attribute(name: str) -> str:
    """Declare ``name``, a private attribute the step or a library it drives sets on a module, as
    deciding what the module's forward allocates (a chunk size, an adapter switch); returns ``name``.

    Work is replayed by what decides its memory; a module's private attributes are bookkeeping unless
    declared here, beside the code that sets them."""
    _memory_attributes.add(name)
    return name


def memory_attributes() -> frozenset[str]:
    """The module attributes declared as deciding memory."""
    return frozenset(_memory_attributes)


def _fake(x: torch.Tensor) -> bool:
    """Whether ``x`` is a fake tensor (shapes and no storage: a simulation's)."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(x)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


# ------------------------------------------------------------------------------------------------
# Values a vision-language forward reads: image grids, masks, the image tokens' places

#: The most elements a tensor a simulation keeps the values of may hold (a micro-batch's ids, masks
#: and image grids): fake tensors keep the values of small tensors only (one element), and a
#: vision-language model's forward reads these (it counts image tokens, splits the tower's
#: attention by the images' grids). What is computed from them alone is computed on their values.
VALUES_KEPT_ELEMENTS = 1 << 24


@contextlib.contextmanager
def values_kept() -> Iterator[None]:
    """While the block runs, a simulation keeps the values of the tensors made by
    :func:`values_tensor`, and of what is computed from them alone (up to
    :data:`VALUES_KEPT_ELEMENTS` elements each)."""
    from torch._subclasses import fake_tensor

    before = fake_tensor.CONSTANT_NUMEL_LIMIT
    fake_tensor.CONSTANT_NUMEL_LIMIT = max(before, VALUES_KEPT_ELEMENTS)
    try:
        yield
    finally:
        fake_tensor.CONSTANT_NUMEL_LIMIT = before


def values_tensor(array: Any) -> torch.Tensor:
    """A micro-batch's tensor of ``array``'s values (ids, masks, image grids), on the host: a run's
    shares the array's memory; a simulation's is a fake tensor that keeps the values (under
    :func:`values_kept`), so that a forward that reads them takes the path the run takes."""
    import numpy as np

    values = np.ascontiguousarray(array)
    if not _simulating():
        return torch.from_numpy(values)
    return torch.tensor(values)  # lifted into the fake mode with its values


def on_host_values(fn: Callable[[], Any]) -> Any:
    """``fn()``, which computes from the host's real values (numpy arrays, host tensors), with a
    simulation's modes off: what the batch's collate computes on the host is no device memory."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return fn()


def _simulating() -> bool:
    """Whether a fake tensor mode is active (the planner's simulation)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(isinstance(mode, FakeTensorMode) for mode in _get_current_dispatch_mode_stack())
