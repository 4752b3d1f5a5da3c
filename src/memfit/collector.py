"""Python's cyclic garbage collector as a memfit process runs it.

A plan builds and drops hundreds of thousands of small containers (the tracker's records, the
events and moments of the shortcuts), while the process holds millions of long-lived objects it
imported (torch, transformers, PEFT). With the interpreter's default thresholds (700, 10, 10) the
collector runs thousands of times a plan, and each older-generation pass walks those imported
objects again: a fifth of a plan's time (Llama-3.1-70B QLoRA on the 2-core machine of
``benchmarks/results``: 4.7 to 5.1 s a plan, 4.0 with the thresholds here). Collecting less often
costs a few MB at most: nothing a plan makes lives in cycles for long.
"""

from __future__ import annotations

import gc

#: Container allocations between young collections, and collections between older ones.
THRESHOLDS = (10_000, 20, 20)


def collect_less() -> None:
    """Raise the collector's thresholds to :data:`THRESHOLDS` for the rest of this process (memfit's
    own command line and worker processes only: a library call leaves its caller's settings alone)."""
    gc.set_threshold(*THRESHOLDS)


def freeze_imports() -> None:
    """Move every object alive now (what a worker imported before its first plan) out of the
    collector's reach: it never walks them again, and a forked process shares their pages."""
    gc.freeze()
