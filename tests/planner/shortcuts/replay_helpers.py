"""What the replay tests (test_replay, test_shortcuts) compare: a simulation's events."""

from __future__ import annotations


def events_of(result) -> list[tuple]:
    """Every device event with what the tracker knows of its storage, without ids."""
    allocations = result.allocations
    return [
        (
            kind,
            allocations[i].nbytes,
            allocations[i].requested_bytes,
            allocations[i].op,
            allocations[i].shape,
            allocations[i].role,
            allocations[i].phase,
        )
        for kind, i, _ in result.events
    ]
