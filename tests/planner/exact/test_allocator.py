"""Tests for the caching-allocator model.

Hand-computed cases follow the rules of c10/cuda/CUDACachingAllocator.cpp
(see the module docstring of memfit.planner.exact.allocator); a slow, independent
reference model cross-checks random sequences; a GPU test replays a random
sequence against the real allocator.
"""

from __future__ import annotations

import random

import pytest

from memfit.planner.exact.allocator import (
    K_LARGE_BUFFER,
    K_SMALL_BUFFER,
    AllocatorResult,
    allocation_size,
    round_size,
    simulate,
)

KiB = 1 << 10
MiB = 1 << 20


def run(*events, **kwargs) -> AllocatorResult:
    return simulate(list(events), record_trace=True, **kwargs)


def alloc(key: int, nbytes: int):
    return ("alloc", key, nbytes)


def free(key: int):
    return ("free", key, 0)


EMPTY = ("empty_cache", 0, 0)


# --- request rounding ------------------------------------------------------


@pytest.mark.parametrize(
    "nbytes, expected",
    [(1, 512), (511, 512), (512, 512), (513, 1024), (1000, 1024), (1 * MiB + 1, 1 * MiB + 512)],
)
def test_round_size(nbytes, expected):
    assert round_size(nbytes) == expected


def test_allocated_counts_rounded_bytes_and_requested_counts_raw_bytes():
    r = run(alloc(1, 1), alloc(2, 513))
    assert r.final_allocated_bytes == 512 + 1024
    assert r.final_requested_bytes == 1 + 513
    assert r.final_reserved_bytes == 2 * MiB  # one small segment holds both


def test_zero_byte_alloc_takes_nothing():
    r = run(alloc(1, 0), free(1))
    assert r.peak_allocated_bytes == 0
    assert r.peak_reserved_bytes == 0
    assert r.num_allocs == 0


# --- pools and segment sizes ----------------------------------------------


@pytest.mark.parametrize(
    "block_bytes, segment_bytes",
    [
        (512, 2 * MiB),
        (1 * MiB, 2 * MiB),  # largest small request
        (1 * MiB + 512, 20 * MiB),  # smallest large request
        (10 * MiB - 512, 20 * MiB),
        (10 * MiB, 10 * MiB),  # kMinLargeAlloc: own segment, 2 MiB multiple
        (10 * MiB + 512, 12 * MiB),
        (33 * MiB, 34 * MiB),
    ],
)
def test_allocation_size(block_bytes, segment_bytes):
    assert allocation_size(block_bytes) == segment_bytes


def test_small_and_large_pools_do_not_share_segments():
    # the 2 MiB small segment has 1.5 MiB free but a large request cannot use it
    r = run(alloc(1, 512 * KiB), alloc(2, 1 * MiB + 1))
    assert r.reserved_trace == (K_SMALL_BUFFER, K_SMALL_BUFFER + K_LARGE_BUFFER)
    assert r.num_segments == 2


def test_large_pool_free_space_does_not_serve_small_requests():
    r = run(alloc(1, 2 * MiB), alloc(2, 4 * KiB))
    # 20 MiB segment with 18 MiB free, yet the 4 KiB request opens a 2 MiB segment
    assert r.final_reserved_bytes == 22 * MiB


def test_many_small_requests_pack_into_2mib_segments():
    events = [alloc(i, 256 * KiB) for i in range(9)]
    r = run(*events)
    # 8 blocks of 256 KiB fill a 2 MiB segment exactly; the ninth opens another
    assert r.reserved_trace[7] == 2 * MiB
    assert r.reserved_trace[8] == 4 * MiB
    assert r.final_allocated_bytes == 9 * 256 * KiB


def test_medium_requests_share_a_20mib_segment():
    r = run(*[alloc(i, 4 * MiB) for i in range(6)])
    # five 4 MiB blocks fit in one 20 MiB segment, the sixth needs a new one
    assert r.reserved_trace == (20 * MiB,) * 5 + (40 * MiB,)


def test_big_request_gets_its_own_rounded_segment():
    r = run(alloc(1, 10 * MiB + 1))
    assert r.final_reserved_bytes == 12 * MiB
    # remainder 2 MiB - 512 B > 1 MiB: split off, so only the block counts
    assert r.final_allocated_bytes == 10 * MiB + 512


# --- splitting ------------------------------------------------------------


def test_large_block_is_split_when_more_than_1mib_is_left():
    # 1 MiB + 512 left over in a 12 MiB segment: split, and a later large request reuses the rest
    split = run(alloc(1, 11 * MiB - 512), alloc(2, 1 * MiB + 512))
    assert split.final_reserved_bytes == 12 * MiB
    # exactly 1 MiB left: not split, so the second request needs a segment of its own
    whole = run(alloc(1, 11 * MiB), alloc(2, 1 * MiB + 512))
    assert whole.final_reserved_bytes > 12 * MiB


def test_large_block_with_1mib_remainder_is_not_split():
    # 11 MiB request -> 12 MiB segment, 1 MiB left over: not split, whole
    # segment counts as allocated (torch reports 12 MiB allocated here)
    r = run(alloc(1, 11 * MiB))
    assert r.final_allocated_bytes == 12 * MiB
    assert r.final_reserved_bytes == 12 * MiB


def test_large_block_with_remainder_above_1mib_is_split_and_reused():
    # 10 MiB + 512 B request -> 12 MiB segment, remainder 2 MiB - 512 B is split
    # off and serves a later 1.5 MiB request without a new segment
    r = run(alloc(1, 10 * MiB + 512), alloc(2, 1536 * KiB))
    assert r.final_reserved_bytes == 12 * MiB
    # remainder 2 MiB - 512 - 1.5 MiB < 1 MiB: the second block takes it whole
    assert r.final_allocated_bytes == 12 * MiB


def test_small_pool_exact_fill_then_new_segment():
    # 1 MiB + 1 MiB - 512 B fills a 2 MiB segment but for 512 B: the 512 B
    # remainder is split off and serves the third request
    r = run(alloc(1, 1 * MiB), alloc(2, 1 * MiB - 512), alloc(3, 100))
    assert r.reserved_trace == (2 * MiB, 2 * MiB, 2 * MiB)
    assert r.final_allocated_bytes == 2 * MiB
    r = run(alloc(1, 1 * MiB), alloc(2, 1 * MiB - 512), alloc(3, 100), alloc(4, 100))
    assert r.final_reserved_bytes == 4 * MiB


# --- best fit, caching and coalescing --------------------------------------


def test_freed_memory_stays_reserved_and_is_reused():
    r = run(alloc(1, 50 * MiB), free(1), alloc(2, 50 * MiB))
    assert r.reserved_trace == (50 * MiB, 50 * MiB, 50 * MiB)
    assert r.allocated_trace == (50 * MiB, 0, 50 * MiB)
    assert r.num_segments == 1


def test_best_fit_takes_the_smallest_fitting_block():
    # two cached segments of 40 and 30 MiB; a 28 MiB request must take the 30
    # MiB one (remainder 2 MiB is split off), leaving the 40 MiB one for a 40
    # MiB request
    r = run(
        alloc(1, 40 * MiB),
        alloc(2, 30 * MiB),
        free(1),
        free(2),
        alloc(3, 28 * MiB),
        alloc(4, 40 * MiB),
    )
    assert r.final_reserved_bytes == 70 * MiB
    assert r.final_allocated_bytes == 68 * MiB


def test_freed_neighbours_coalesce():
    # three 4 MiB blocks carved out of one 20 MiB segment; freeing the middle
    # one then its neighbours must give back one 20 MiB free block, which a
    # 19 MiB request can then use without a new segment
    events = [alloc(1, 4 * MiB), alloc(2, 4 * MiB), alloc(3, 4 * MiB), free(2), free(1), free(3), alloc(4, 19 * MiB)]
    r = run(*events)
    assert r.final_reserved_bytes == 20 * MiB
    assert r.final_allocated_bytes == 20 * MiB  # 1 MiB remainder: not split


def test_no_coalescing_across_segments():
    # two 12 MiB segments freed: 24 MiB cached but no block of 13 MiB or more
    r = run(alloc(1, 12 * MiB), alloc(2, 12 * MiB), free(1), free(2), alloc(3, 13 * MiB))
    assert r.final_reserved_bytes == 24 * MiB + 14 * MiB


def test_fragmentation_grows_reserved_below_previous_allocated_peak():
    # Peak allocated is 40 MiB (two 20 MiB-segment halves of 10 MiB + two
    # more). Afterwards only 2 x 9 MiB are live, one in each 20 MiB segment,
    # so 22 MiB are free but split 11/11 MiB: a 12 MiB request needs a new
    # segment although 18 + 12 = 30 MiB is below the old 40 MiB peak.
    events = [
        alloc(1, 9 * MiB),
        alloc(2, 9 * MiB),  # segment A: 9 + 9 (+2 free)
        alloc(3, 9 * MiB),
        alloc(4, 9 * MiB),  # segment B: 9 + 9 (+2 free)
        free(2),
        free(4),  # A and B each: 9 live, 11 free
        alloc(5, 12 * MiB),
    ]
    r = run(*events)
    assert r.peak_allocated_bytes == 9 * MiB * 4
    assert r.allocated_trace[-1] == 18 * MiB + 12 * MiB
    assert r.allocated_trace[-1] < r.peak_allocated_bytes
    assert r.reserved_trace[-2] == 40 * MiB
    assert r.reserved_trace[-1] == 52 * MiB
    assert r.peak_reserved_bytes == 52 * MiB
    assert r.allocated_at_peak_reserved_bytes == 30 * MiB


# --- empty_cache, capacity and OOM ----------------------------------------


def test_empty_cache_releases_only_whole_free_segments():
    events = [
        alloc(1, 4 * MiB),
        alloc(2, 4 * MiB),  # one 20 MiB segment, split
        alloc(3, 30 * MiB),  # own 30 MiB segment
        alloc(4, 1000),  # small segment
        free(1),
        free(3),
        free(4),
        EMPTY,
    ]
    r = run(*events)
    # the 30 MiB and the 2 MiB segments are whole and free: released; the 20
    # MiB segment still holds block 2
    assert r.reserved_trace[-2] == 52 * MiB
    assert r.final_reserved_bytes == 20 * MiB
    assert r.num_segments == 1
    r = run(*events, free(2), EMPTY)
    assert r.final_reserved_bytes == 0
    assert r.num_segments == 0


def test_capacity_releases_cached_segments_then_retries():
    # 51 MiB capacity: a cached (free) 50 MiB large segment cannot serve a
    # 4 KiB request (other pool), and a new 2 MiB small segment would exceed
    # the capacity -> the 50 MiB segment is released and the retry succeeds
    r = run(alloc(1, 50 * MiB), free(1), alloc(2, 4 * KiB), capacity_bytes=51 * MiB)
    assert not r.oom
    assert r.reserved_trace == (50 * MiB, 50 * MiB, 2 * MiB)
    assert r.peak_reserved_bytes == 50 * MiB
    # without a capacity the cached segment stays
    r = run(alloc(1, 50 * MiB), free(1), alloc(2, 4 * KiB))
    assert r.final_reserved_bytes == 52 * MiB


def test_cached_large_block_is_split_before_any_release():
    # a 4 MiB request is served from the cached 50 MiB block (best fit in the
    # large pool), so the capacity is never approached
    r = run(alloc(1, 50 * MiB), free(1), alloc(2, 4 * MiB), capacity_bytes=50 * MiB)
    assert not r.oom
    assert r.final_reserved_bytes == 50 * MiB
    assert r.final_allocated_bytes == 4 * MiB


def test_oom_when_release_is_not_enough():
    # the 20 MiB segment is split (block 1 live) so it cannot be released
    events = [alloc(1, 4 * MiB), alloc(2, 30 * MiB), free(2), alloc(3, 50 * MiB), free(1)]
    r = run(*events, capacity_bytes=60 * MiB)
    assert r.oom
    assert r.oom_event_index == 3
    # the free 30 MiB segment was released while trying
    assert r.final_reserved_bytes == 20 * MiB
    assert r.peak_reserved_bytes == 50 * MiB
    assert len(r.reserved_trace) == 3  # the replay stopped at the failing alloc
    assert not run(*events, capacity_bytes=70 * MiB).oom


def test_capacity_exactly_fits():
    assert not run(alloc(1, 20 * MiB), capacity_bytes=20 * MiB).oom
    assert run(alloc(1, 20 * MiB + 1), capacity_bytes=20 * MiB).oom


# --- input errors -----------------------------------------------------------


@pytest.mark.parametrize(
    "events, message",
    [
        ([alloc(1, 10), alloc(1, 10)], "still live"),
        ([free(7)], "not live"),
        ([alloc(1, 10), free(1), free(1)], "not live"),
        ([alloc(1, -1)], "negative size"),
        ([("malloc", 1, 10)], "unknown event kind"),
    ],
)
def test_bad_events_raise(events, message):
    with pytest.raises(ValueError, match=message):
        simulate(events)


def test_bad_capacity_raises():
    with pytest.raises(ValueError, match="capacity_bytes"):
        simulate([], capacity_bytes=0)


def test_key_can_be_reused_after_free():
    r = run(alloc(1, 100), free(1), alloc(1, 200))
    assert r.final_allocated_bytes == 512
    assert r.num_allocs == 2


def test_empty_sequence():
    r = simulate([])
    assert (r.peak_allocated_bytes, r.peak_reserved_bytes, r.num_segments) == (0, 0, 0)
    assert r.reserved_trace is None and not r.oom


# --- independent reference model --------------------------------------------


class ReferenceAllocator:
    """Slow, list-based restatement of the same rules, for cross-checking.

    Segments are lists of [size, in_use] blocks in address order; the free
    block chosen is the minimum (size, address) over the pool, found by a
    linear scan.
    """

    def __init__(self, capacity=None):
        self.segments = []  # [addr, is_small, blocks]
        self.next_addr = 0
        self.live = {}  # key -> (segment, block)
        self.capacity = capacity

    @property
    def reserved(self):
        return sum(sum(b[0] for b in seg[2]) for seg in self.segments)

    @property
    def allocated(self):
        return sum(b[0] for seg in self.segments for b in seg[2] if b[1])

    def _release(self):
        self.segments = [s for s in self.segments if not (len(s[2]) == 1 and not s[2][0][1])]

    def alloc(self, key, nbytes):
        if nbytes == 0:
            self.live[key] = None
            return True
        size = max(512, -(-nbytes // 512) * 512)
        small = size <= MiB
        best = None
        for seg in self.segments:
            if seg[1] != small:
                continue
            offset = 0
            for block in seg[2]:
                if not block[1] and block[0] >= size:
                    cand = (block[0], seg[0] + offset)
                    if best is None or cand < best[0]:
                        best = (cand, seg, block)
                offset += block[0]
        if best is None:
            seg_size = 2 * MiB if small else (20 * MiB if size < 10 * MiB else -(-size // (2 * MiB)) * 2 * MiB)
            if self.capacity is not None and self.reserved + seg_size > self.capacity:
                self._release()
                if self.reserved + seg_size > self.capacity:
                    return False
            block = [seg_size, False]
            seg = [self.next_addr, small, [block]]
            self.next_addr += seg_size + 512
            self.segments.append(seg)
        else:
            _, seg, block = best
        remaining = block[0] - size
        if (remaining >= 512) if small else (remaining > MiB):
            i = next(i for i, b in enumerate(seg[2]) if b is block)
            block[0] = size
            seg[2].insert(i + 1, [remaining, False])
        block[1] = True
        self.live[key] = (seg, block)
        return True

    def free(self, key):
        entry = self.live.pop(key)
        if entry is None:
            return
        seg, block = entry
        block[1] = False
        merged = []
        for b in seg[2]:
            if merged and not b[1] and not merged[-1][1]:
                merged[-1][0] += b[0]
            else:
                merged.append(b)
        seg[2][:] = merged


def random_events(seed: int, n: int, max_live: int = 40):
    rng = random.Random(seed)
    live: list[int] = []
    next_key = 0
    events = []
    sizes = [0, 1, 100, 512, 4 * KiB, 300 * KiB, MiB, MiB + 1, 3 * MiB, 9 * MiB, 10 * MiB, 25 * MiB]
    for _ in range(n):
        r = rng.random()
        if r < 0.01:
            events.append(EMPTY)
        elif live and (r < 0.45 or len(live) >= max_live):
            key = live.pop(rng.randrange(len(live)))
            events.append(free(key))
        else:
            if rng.random() < 0.5:
                nbytes = rng.choice(sizes)
            else:
                nbytes = int(rng.lognormvariate(13, 3)) % (64 * MiB)
            events.append(alloc(next_key, nbytes))
            live.append(next_key)
            next_key += 1
    return events


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("capacity", [None, 300 * MiB, 400 * MiB])
def test_matches_reference_model_on_random_sequences(seed, capacity):
    events = random_events(seed, 1500)
    result = simulate(events, capacity_bytes=capacity, record_trace=True)
    ref = ReferenceAllocator(capacity)
    reserved, allocated = [], []
    for kind, key, nbytes in events:
        if kind == "alloc":
            if not ref.alloc(key, nbytes):
                break
        elif kind == "free":
            ref.free(key)
        else:
            ref._release()
        reserved.append(ref.reserved)
        allocated.append(ref.allocated)
    assert result.reserved_trace == tuple(reserved)
    assert result.allocated_trace == tuple(allocated)
    assert result.oom == (len(reserved) < len(events))
    assert result.num_segments == len(ref.segments)


def test_trace_off_by_default_and_peaks_match_trace():
    events = random_events(42, 2000)
    plain = simulate(events)
    traced = simulate(events, record_trace=True)
    assert plain.reserved_trace is None and plain.allocated_trace is None
    assert plain.peak_reserved_bytes == max(traced.reserved_trace)
    assert plain.peak_allocated_bytes == max(traced.allocated_trace)
    assert plain.final_reserved_bytes == traced.reserved_trace[-1]


# --- against the real allocator ----------------------------------------------


@pytest.mark.gpu
def test_matches_real_cuda_caching_allocator():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if torch.cuda.memory_allocated() or torch.cuda.memory_reserved():
        pytest.skip("the CUDA caching allocator is not empty in this process")
    events = random_events(7, 3000, max_live=60)
    model = simulate(events, record_trace=True)
    tensors = {}
    mismatches = []
    for i, (kind, key, nbytes) in enumerate(events):
        if kind == "alloc":
            tensors[key] = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        elif kind == "free":
            del tensors[key]
        else:
            torch.cuda.empty_cache()
        real = (torch.cuda.memory_reserved(), torch.cuda.memory_allocated())
        expected = (model.reserved_trace[i], model.allocated_trace[i])
        if real != expected:
            mismatches.append((i, events[i], real, expected))
    tensors.clear()
    torch.cuda.empty_cache()
    assert not mismatches, f"{len(mismatches)} events differ, first: {mismatches[:3]}"


def test_marks_keep_each_stretchs_highest_requested_bytes():
    events = [
        ("alloc", 1, 100),  # before the first mark: in no stretch
        ("alloc", 2, 300),
        ("free", 2, 0),
        ("alloc", 3, 50),  # stretch 0 (from event 3): 100 + 50
        ("free", 3, 0),
        ("free", 1, 0),  # stretch 1 (from event 5): frees only
        ("alloc", 4, 0),  # stretch 2 (from event 6): a zero-byte request counts as live bytes unchanged
    ]
    result = simulate(events, marks=[3, 5, 6, 9])
    assert result.stretch_peaks == (150, 0, 0, 0)  # the last mark is past the end: an empty stretch
    assert simulate(events).stretch_peaks == ()
    # Marks alike: stretches with no events (a phase that frees or allocates nothing at this depth).
    assert simulate(events, marks=[3, 3, 5, 5, 5, 6]).stretch_peaks == (0, 150, 0, 0, 0, 0)


@pytest.mark.parametrize("marks", [[3, 1], [-1, 4]])
def test_marks_must_be_event_indices_in_order(marks):
    with pytest.raises(ValueError, match="marks must be event indices in order"):
        simulate([("alloc", 1, 8)], marks=marks)
