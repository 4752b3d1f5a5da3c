"""The files of a run folder that more than one part of memfit reads or writes.

``memfit train`` and the Hugging Face callback write them; ``memfit doctor`` and ``memfit report``
read them. One definition keeps writers and readers agreeing on the names.
"""

from __future__ import annotations

#: The resolved configuration, the plan and how the run ended (``memfit train``).
RUN_FILE = "run.json"
#: One JSON object a line: loss, learning rate, throughput per logged step.
METRICS_FILE = "metrics.jsonl"
#: Memory recorded every step by rank 0 (or the only process).
MEMORY_FILE = "memory.jsonl"

_RANK_PREFIX, _RANK_SUFFIX = "memory-rank", ".jsonl"


def memory_file_name(rank: int) -> str:
    """The memory file of process ``rank``: ``memory.jsonl`` for rank 0 (what ``memfit report``
    reads first), ``memory-rank<N>.jsonl`` for the others."""
    if rank < 0:
        raise ValueError(f"rank: {rank} must be 0 or more")
    return MEMORY_FILE if rank == 0 else f"{_RANK_PREFIX}{rank}{_RANK_SUFFIX}"


def rank_of_memory_file(name: str) -> int | None:
    """The rank a ``memory-rank<N>.jsonl`` file belongs to (None for any other name)."""
    if not (name.startswith(_RANK_PREFIX) and name.endswith(_RANK_SUFFIX)):
        return None
    digits = name[len(_RANK_PREFIX) : -len(_RANK_SUFFIX)]
    return int(digits) if digits.isdigit() else None
