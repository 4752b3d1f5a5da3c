"""A model of PyTorch's CUDA caching allocator.

The planner records every storage allocation and free of a training step (run
under FakeTensorMode, so no GPU is touched) and replays that sequence here to
learn what the real allocator would *reserve* from the device, which is what
decides an out-of-memory error.

The rules follow ``c10/cuda/CUDACachingAllocator.cpp`` (torch 2.4 to 2.13)
with the default configuration: no ``expandable_segments``, no
``max_split_size_mb``, no ``garbage_collection_threshold``,
``roundup_power2_divisions`` off, one device, one stream.

* ``round_size``: a request of ``n`` bytes becomes a block of ``n`` rounded up
  to a multiple of 512 bytes (``kMinBlockSize``), at least 512. Zero-byte
  requests never reach the allocator (``allocate(0)`` returns a null pointer).
* ``get_pool``: rounded sizes up to 1 MiB (``kSmallSize``) use the small pool,
  the rest the large pool. Free blocks of one pool never serve the other.
* ``get_free_block``: best fit. Free blocks are kept ordered by
  ``(stream, size, address)`` and the allocator takes the first one whose size
  is at least the request, i.e. the smallest fitting block, lowest address on
  ties.
* ``get_allocation_size``: when nothing fits, a new segment is requested from
  ``cudaMalloc``: 2 MiB (``kSmallBuffer``) for the small pool, 20 MiB
  (``kLargeBuffer``) for large requests below 10 MiB (``kMinLargeAlloc``),
  otherwise the request rounded up to a multiple of 2 MiB (``kRoundLarge``).
* ``should_split``: the block found (or the new segment) is split when the
  remainder is at least 512 bytes (small pool) or more than 1 MiB (large
  pool); otherwise the whole block is handed out and counts as allocated.
* ``free_block``: a freed block merges with free neighbours of the same
  segment and goes back to its pool. The segment stays reserved (cached).
* ``release_cached_blocks`` (``torch.cuda.empty_cache()`` and the OOM path):
  every free block that is a whole segment (never split, or merged back) is
  returned with ``cudaFree``; split segments stay.
* ``malloc`` with a device limit: if ``cudaMalloc`` fails, the allocator frees
  all whole cached segments and tries ``cudaMalloc`` once more (it does not
  search the pools again); if that fails too it raises
  ``torch.OutOfMemoryError``.

``memory_allocated`` counts rounded block sizes (including the slack of an
unsplit block); ``memory_reserved`` counts segment sizes.

Not modelled: expandable segments, ``max_split_size_mb`` and the
``release_available_cached_blocks`` path it enables, garbage collection,
``roundup_power2_divisions``, several streams (``record_stream`` events),
CUDA graph private pools, the CUDA context and memory outside the allocator,
and the addresses ``cudaMalloc`` really returns: new segments get increasing
addresses here, which only matters for the tie break between free blocks of
equal size.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left, insort
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

K_MIN_BLOCK_SIZE = 512  # every block is a multiple of this
K_SMALL_SIZE = 1 << 20  # largest request served by the small pool (1 MiB)
K_SMALL_BUFFER = 2 << 20  # segment size of the small pool (2 MiB)
K_MIN_LARGE_ALLOC = 10 << 20  # large requests below this share a 20 MiB segment
K_LARGE_BUFFER = 20 << 20  # segment size for large requests below 10 MiB
K_ROUND_LARGE = 2 << 20  # bigger requests get their own segment, 2 MiB granular

# Space left between consecutive model segments so that blocks of different
# segments are never address-adjacent and can never be merged.
_SEGMENT_GAP = K_MIN_BLOCK_SIZE

ALLOC = "alloc"
FREE = "free"
EMPTY_CACHE = "empty_cache"

Event = tuple[str, int, int]


@dataclass(frozen=True)
class AllocatorResult:
    """What the allocator model saw over a replayed event sequence.

    Peaks are taken after every event. ``allocated_at_peak_reserved_bytes`` is
    the allocated figure right after the event that first reached the reserved
    peak: the gap between the two is the fragmentation at the worst moment.
    When ``oom`` is true the replay stopped at event ``oom_event_index`` (the
    allocation that could not be served) and every figure describes the state
    just before it, as a real run would have raised there.
    """

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    allocated_at_peak_reserved_bytes: int
    final_allocated_bytes: int
    final_reserved_bytes: int
    num_segments: int
    num_allocs: int
    oom: bool
    reserved_trace: tuple[int, ...] | None
    allocated_trace: tuple[int, ...] | None
    peak_requested_bytes: int = 0
    final_requested_bytes: int = 0
    oom_event_index: int | None = None
    #: With ``marks``: the requested bytes' highest after an allocation in each stretch of events
    #: (from one mark to the next, the last to the end; 0 where a stretch allocates nothing).
    stretch_peaks: tuple[int, ...] = ()


def round_size(nbytes: int) -> int:
    """Block size for a request of ``nbytes`` (``round_size`` in torch)."""
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def allocation_size(block_bytes: int) -> int:
    """Segment size ``cudaMalloc``'d for a rounded request (``get_allocation_size``)."""
    if block_bytes <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if block_bytes < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-block_bytes // K_ROUND_LARGE) * K_ROUND_LARGE


class _OutOfMemory(Exception):
    """``cudaMalloc`` failed even after the cached segments were released: the replay stops there."""

    def __init__(self, reserved_bytes: int) -> None:
        super().__init__(reserved_bytes)
        self.reserved_bytes = reserved_bytes  # what stays reserved once the cache was released


class _Segments:
    """The model's segments and their blocks: the two pools of free blocks, every block's size and
    the block that ends where another starts, the segments ``cudaMalloc`` handed out.

    Free blocks of each pool are a sorted list of ``(size, addr)``: best fit is one bisect, and
    ``(size, addr)`` is the order torch's std::set keeps. The replay (:func:`_replay`) works on
    these containers directly; the methods here are the rare events: a new segment, a release.
    """

    __slots__ = ("block_at_end", "block_size", "free_addrs", "large_free", "next_addr", "segments", "small_free")

    def __init__(self) -> None:
        self.small_free: list[tuple[int, int]] = []
        self.large_free: list[tuple[int, int]] = []
        self.block_size: dict[int, int] = {}  # addr -> size, every block (free or in use)
        self.block_at_end: dict[int, int] = {}  # addr + size -> addr, to find the left neighbour
        self.free_addrs: set[int] = set()  # addresses of the free blocks
        self.segments: dict[int, int] = {}  # segment start addr -> segment size
        self.next_addr = 0

    def cuda_malloc(self, pool: list[tuple[int, int]], size: int, reserved: int, capacity_bytes: int | None) -> int:
        """A new segment for a request of ``size`` (rounded) bytes that no free block of ``pool``
        holds, put in ``pool`` as one free block; returns the bytes reserved after it. Past
        ``capacity_bytes``, whole cached segments are released and the segment is tried once more
        (torch's malloc); :class:`_OutOfMemory` when it still does not fit."""
        seg_size = allocation_size(size)
        if capacity_bytes is not None and reserved + seg_size > capacity_bytes:
            reserved -= self.release_cached()
            if reserved + seg_size > capacity_bytes:
                raise _OutOfMemory(reserved)
        addr = self.next_addr
        self.next_addr += seg_size + _SEGMENT_GAP
        self.segments[addr] = seg_size
        self.block_size[addr] = seg_size
        self.block_at_end[addr + seg_size] = addr
        insort(pool, (seg_size, addr))
        self.free_addrs.add(addr)
        return reserved + seg_size

    def release_cached(self) -> int:
        """``cudaFree`` every free block that is a whole segment; returns the bytes released."""
        released = 0
        for pool in (self.large_free, self.small_free):
            kept = []
            for entry in pool:
                size, addr = entry
                if self.segments.get(addr) == size:
                    del self.segments[addr]
                    del self.block_size[addr]
                    del self.block_at_end[addr + size]
                    self.free_addrs.remove(addr)
                    released += size
                else:
                    kept.append(entry)
            pool[:] = kept
        return released


class EventError(ValueError):
    """An event the replay cannot take: an alloc of a live key or of negative size, a free of a key
    that is not live, an unknown kind."""


def _event_error(index: int, kind: str, key: int, nbytes: int, live: bool) -> EventError:
    """The error of an event the replay cannot take."""
    if kind == ALLOC and live:
        return EventError(f"event {index}: alloc of key {key} which is still live; free it first or use a new key")
    if kind == ALLOC:
        return EventError(f"event {index}: alloc of key {key} with negative size {nbytes}")
    if kind == FREE:
        return EventError(f"event {index}: free of key {key} which is not live (never allocated, or freed already)")
    return EventError(f"event {index}: unknown event kind {kind!r}; expected {ALLOC!r}, {FREE!r} or {EMPTY_CACHE!r}")


def simulate(
    events: Iterable[Event],
    *,
    capacity_bytes: int | None = None,
    record_trace: bool = False,
    marks: Sequence[int] = (),
) -> AllocatorResult:
    """Replay allocation events through the caching-allocator model.

    Args:
        events: ``("alloc", key, nbytes)``, ``("free", key, 0)`` or
            ``("empty_cache", 0, 0)``. ``key`` names a live block; it may be
            reused once freed. ``nbytes`` is the unrounded request.
        capacity_bytes: what ``cudaMalloc`` may hand out in total (device
            memory minus the CUDA context and anything else outside the
            allocator). When a new segment would exceed it, whole cached
            segments are released and the segment is tried again; if it still
            does not fit, the replay stops with ``oom=True``. ``None``: no limit.
        record_trace: keep reserved and allocated bytes after every event.
        marks: event indices in order, each the first of a stretch whose highest requested bytes
            the result keeps (``stretch_peaks``): a phase's highest live bytes, in one replay. Two
            marks alike: a stretch with no events.

    Raises:
        ValueError: on an unknown event kind, a negative size, an alloc of a
            key that is live, a free of a key that is not, or a capacity that
            is not positive.
    """
    if capacity_bytes is not None and capacity_bytes <= 0:
        raise ValueError(f"capacity_bytes must be a positive number of bytes or None, got {capacity_bytes!r}")
    if any(b < a for a, b in itertools.pairwise(marks)) or any(m < 0 for m in marks[:1]):
        raise ValueError(f"marks must be event indices in order, got {list(marks)!r}")
    return _replay(events, capacity_bytes, record_trace, marks)


def _replay(
    events: Iterable[Event], capacity_bytes: int | None, record_trace: bool, marks: Sequence[int]
) -> AllocatorResult:
    """:func:`simulate`'s loop. Every event passes here, so its work is done in this one frame, on
    local names: a call or an attribute look-up per event would cost the replay a tenth of its time."""
    segments = _Segments()
    small_free, large_free, free_addrs = segments.small_free, segments.large_free, segments.free_addrs
    block_size, block_at_end = segments.block_size, segments.block_at_end
    live: dict[int, tuple[int, int]] = {}  # key -> (addr, requested bytes); addr -1: 0 bytes
    allocated = reserved = requested = num_allocs = 0
    peak_allocated = peak_reserved = peak_requested = allocated_at_peak_reserved = 0
    oom_index: int | None = None
    trace: list[tuple[int, int]] | None = [] if record_trace else None  # (reserved, allocated) after each event
    stretches, stretch_peak, passed, next_mark = [], 0, 0, marks[0] if marks else -1
    try:
        for index, (kind, key, nbytes) in enumerate(events):
            if index == next_mark:  # a stretch starts: the one before it (if one was) is over
                if passed:
                    stretches.append(stretch_peak)
                stretch_peak, passed = 0, passed + 1
                while passed < len(marks) and marks[passed] == index:  # a stretch with no events
                    stretches.append(0)
                    passed += 1
                next_mark = marks[passed] if passed < len(marks) else -1
            if kind == ALLOC:
                if key in live or nbytes < 0:
                    raise _event_error(index, kind, key, nbytes, key in live)
                if nbytes == 0:
                    live[key] = (-1, 0)  # torch hands out a null pointer without touching the allocator
                else:
                    size = -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE  # round_size, for nbytes > 0
                    small = size <= K_SMALL_SIZE
                    pool = small_free if small else large_free
                    i = bisect_left(pool, (size, -1))  # best fit: the smallest free block, then the lowest address
                    if i == len(pool):  # nothing fits: a new segment, the one free block that does
                        reserved = segments.cuda_malloc(pool, size, reserved, capacity_bytes)
                        i = bisect_left(pool, (size, -1))
                    bsize, addr = pool.pop(i)
                    free_addrs.remove(addr)
                    remaining = bsize - size
                    if (remaining >= K_MIN_BLOCK_SIZE) if small else (remaining > K_SMALL_SIZE):  # should_split
                        rest = addr + size
                        block_size[addr], block_size[rest] = size, remaining
                        block_at_end[rest], block_at_end[rest + remaining] = addr, rest
                        insort(pool, (remaining, rest))
                        free_addrs.add(rest)
                        bsize = size
                    live[key] = (addr, nbytes)
                    allocated += bsize
                    requested += nbytes
                    num_allocs += 1
                    if allocated > peak_allocated:
                        peak_allocated = allocated
                    if requested > peak_requested:
                        peak_requested = requested
                if requested > stretch_peak:
                    stretch_peak = requested
            elif kind == FREE:
                entry = live.pop(key, None)
                if entry is None:
                    raise _event_error(index, kind, key, nbytes, False)
                addr, nbytes = entry
                if addr >= 0:
                    size = block_size[addr]
                    allocated -= size
                    requested -= nbytes
                    # an in-use block's size tells its pool: small-pool blocks in use are at most 1 MiB
                    pool = small_free if size <= K_SMALL_SIZE else large_free
                    left = block_at_end.get(addr)
                    if left in free_addrs:  # merge with the free block before it (segments never touch)
                        free_addrs.remove(left)
                        del pool[bisect_left(pool, (addr - left, left))], block_size[addr], block_at_end[addr]
                        size += addr - left
                        addr = left
                    right = addr + size
                    if right in free_addrs:  # and with the free block after it
                        free_addrs.remove(right)
                        rsize = block_size.pop(right)
                        del pool[bisect_left(pool, (rsize, right))], block_at_end[right]
                        size += rsize
                    block_size[addr] = size
                    block_at_end[addr + size] = addr
                    insort(pool, (size, addr))
                    free_addrs.add(addr)
            elif kind == EMPTY_CACHE:
                reserved -= segments.release_cached()
            else:
                raise _event_error(index, kind, key, nbytes, False)
            if reserved > peak_reserved:
                peak_reserved, allocated_at_peak_reserved = reserved, allocated
            if trace is not None:
                trace.append((reserved, allocated))
    except _OutOfMemory as oom:  # the alloc at ``index`` could not be served: figures as just before it
        oom_index, reserved = index, oom.reserved_bytes
    if passed:  # the last stretch reached is over
        stretches.append(stretch_peak)
    stretches += [0] * (len(marks) - passed)  # those that start past the last event (or the OOM)
    peaks = (peak_allocated, peak_reserved, allocated_at_peak_reserved, peak_requested)
    return _result(segments, peaks, (allocated, reserved, requested), num_allocs, oom_index, trace, stretches)


def _result(
    segments: _Segments,
    peaks: tuple[int, int, int, int],
    finals: tuple[int, int, int],
    num_allocs: int,
    oom_index: int | None,
    trace: list[tuple[int, int]] | None,
    stretches: list[int],
) -> AllocatorResult:
    """:func:`_replay`'s figures as a result: ``peaks`` (allocated, reserved, allocated at the reserved
    peak, requested) and ``finals`` (allocated, reserved, requested)."""
    peak_allocated, peak_reserved, allocated_at_peak_reserved, peak_requested = peaks
    allocated, reserved, requested = finals
    return AllocatorResult(
        peak_allocated_bytes=peak_allocated,
        peak_reserved_bytes=peak_reserved,
        allocated_at_peak_reserved_bytes=allocated_at_peak_reserved,
        final_allocated_bytes=allocated,
        final_reserved_bytes=reserved,
        num_segments=len(segments.segments),
        num_allocs=num_allocs,
        oom=oom_index is not None,
        reserved_trace=tuple(r for r, _ in trace) if trace is not None else None,
        allocated_trace=tuple(a for _, a in trace) if trace is not None else None,
        peak_requested_bytes=peak_requested,
        final_requested_bytes=requested,
        oom_event_index=oom_index,
        stretch_peaks=tuple(stretches),
    )
