"""Memory against sequence length: which lengths to plan, and where the card's line is crossed.

Pure arithmetic on plans the planner made: the page plans a handful of lengths of the chosen
configuration and draws their device totals against the card's memory.
"""

from __future__ import annotations

from typing import Any

#: The shortest length planned (shorter sequences are never what decides a card).
FIRST_SEQ_LEN = 512
#: Lengths planned at most: each is a plan (seconds for a large model the first time).
MAX_POINTS = 7
#: No model here is trained past this many tokens a sequence; the planner's own search stops there too.
LONGEST_SEQ_LEN = 131072
#: Estimated lengths are given in multiples of this many tokens (as ``memfit fit`` gives them).
SEQ_STEP = 128


def sweep_lengths(seq_len: int, max_positions: int | None) -> list[int]:
    """The sequence lengths to plan: doubling from :data:`FIRST_SEQ_LEN` to the model's longest,
    with ``seq_len`` among them; the longest :data:`MAX_POINTS` when there are more."""
    limit = min(max_positions or LONGEST_SEQ_LEN, LONGEST_SEQ_LEN)
    lengths = {seq_len} if seq_len <= limit else set()
    length = FIRST_SEQ_LEN
    while length < limit:
        lengths.add(length)
        length *= 2
    lengths.add(limit)
    ordered = sorted(lengths)
    if len(ordered) > MAX_POINTS:
        # The long end decides where the card's line is crossed; the chosen length stays.
        kept = ordered[-MAX_POINTS:]
        if seq_len in ordered and seq_len not in kept:
            kept = sorted(kept[1:] + [seq_len])
        ordered = kept
    return ordered


def longest_fitting(points: list[tuple[int, int]], capacity_bytes: int | None) -> dict[str, Any] | None:
    """Where memory (``(seq_len, device_total_bytes)`` points) crosses ``capacity_bytes``.

    ``{"seq_len": N, "exact": True}`` when the longest planned length fits; an estimate between the
    last length that fits and the first that does not, on the line through them (memory is close
    to affine in the length), rounded down to :data:`SEQ_STEP` tokens, with ``"exact": False``;
    ``{"seq_len": 0, ...}`` when even the shortest does not fit; None without a capacity.
    """
    if capacity_bytes is None or not points:
        return None
    points = sorted(points)
    fitting = [p for p in points if p[1] <= capacity_bytes]
    if not fitting:
        return {"seq_len": 0, "exact": True, "between": None}
    last_fit = max(fitting)
    beyond = [p for p in points if p[0] > last_fit[0] and p[1] > capacity_bytes]
    if not beyond:
        return {"seq_len": last_fit[0], "exact": True, "between": None}
    first_over = min(beyond)
    (x0, y0), (x1, y1) = last_fit, first_over
    estimate = x0 + (capacity_bytes - y0) * (x1 - x0) / (y1 - y0)
    tokens = max(x0, int(estimate) // SEQ_STEP * SEQ_STEP)
    return {"seq_len": tokens, "exact": tokens == x0, "between": [x0, x1]}
