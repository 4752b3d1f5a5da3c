"""How fast the caching-allocator model (``memfit.planner.exact.allocator.simulate``) replays events.

A seeded, transformer-like mix of allocations (many small tensors, some of 1-10 MiB, a few large
ones) and frees, replayed whole: 100,000 events (best of 5) and 1,000,000 events (best of 2). Times
are the process's CPU seconds (``time.process_time``), which other work on a shared machine
changes far less than wall time; the load average is recorded beside them.

    python benchmarks/allocator_speed.py      # writes benchmarks/results/allocator_speed.json
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results" / "allocator_speed.json"
sys.path[:0] = [str(BENCH.parent / "src"), str(BENCH)]
from _machine import describe_machine, memfit_source  # noqa: E402


def events(count: int, keys: int, seed: int = 0) -> list[tuple[str, int, int]]:
    """``count`` alloc/free events over at most ``keys`` tensors: 60% under 1 MiB, 35% of 1-10 MiB,
    5% of 10-200 MiB; a tensor is freed at random once 800 are live, or with probability 0.3."""
    rng = random.Random(seed)
    live: list[int] = []
    out: list[tuple[str, int, int]] = []
    for key in range(keys):
        r = rng.random()
        size = (
            rng.randint(1, 1 << 20)
            if r < 0.6
            else rng.randint(1 << 20, 10 << 20)
            if r < 0.95
            else rng.randint(10 << 20, 200 << 20)
        )
        out.append(("alloc", key, size))
        live.append(key)
        if len(live) > 800 or rng.random() < 0.3:
            out.append(("free", live.pop(rng.randrange(len(live))), 0))
    return out[:count]


def best_of(replays: int, sequence: list[tuple[str, int, int]]) -> float:
    from memfit.planner.exact.allocator import simulate

    times = []
    for _ in range(replays):
        started = time.process_time()
        simulate(sequence)
        times.append(time.process_time() - started)
    return min(times)


def main() -> int:
    load = os.getloadavg()
    rows = []
    for count, keys, replays in ((100_000, 60_000, 5), (1_000_000, 600_000, 2)):
        sequence = events(count, keys)
        seconds = best_of(replays, sequence)
        rows.append({"events": len(sequence), "keys": keys, "replays": replays, "best_cpu_seconds": round(seconds, 3)})
        print(f"{len(sequence):,} events: {seconds:.3f} CPU s (best of {replays})")
    data = {
        "benchmark": "allocator_speed",
        "command": "python benchmarks/allocator_speed.py",
        "machine": describe_machine(),
        "memfit": memfit_source(),
        "load_average_1_5_15_min": {
            "start": [round(x, 2) for x in load],
            "end": [round(x, 2) for x in os.getloadavg()],
        },
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "runs": rows,
    }
    RESULTS.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
