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
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

#: Set to False to make fake runs go through every chunk too (tests compare both ways).
SHORTCUT_FAKE_CHUNKS = True

#: The loops a fake run went through, as (rows, chunk) pairs, while :func:`recording_loops` is on.
_recorded: list[set[tuple[int, int]]] = []


@contextlib.contextmanager
def recording_loops() -> Iterator[set[tuple[int, int]]]:
    """Collect the (rows, chunk) of every chunked loop a fake run goes through in this block.

    The planner reads how a tensor's size follows the sequence length from them
    (:mod:`memfit.planner.lengths`): inside a loop's last chunk, a dimension is what is left of the
    rows after the full chunks.
    """
    loops: set[tuple[int, int]] = set()
    _recorded.append(loops)
    try:
        yield loops
    finally:
        _recorded.remove(loops)


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
