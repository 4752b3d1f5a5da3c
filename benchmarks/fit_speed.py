"""How long `memfit fit` takes for an 8B model on this machine.

Runs the real CLI (``python -m memfit fit MODEL --gpu GPU --json``, with this interpreter, so that
the memfit being measured is the one this interpreter imports) in a fresh process, so imports
count, and records the wall time, the number of plans and what the search found.

Each case runs twice in the same plan-cache folder (``MEMFIT_CACHE`` pointed at a new, empty
temporary folder, so the user's cache is neither read nor written): the first run starts from an
empty cache (what a first ``memfit fit`` costs), the second finds the first one's plans on disk
(what running it again costs). Code without an on-disk plan cache simply plans twice.

Results are kept per label (``--label before``, ``--label after``...) side by side in one file,
each with the memfit commit it measured, so that a change can be shown against the code before it.
On a shared machine the load moves between two runs; ``--against OTHER/src`` runs each case with
that other checkout and then with this one, one after the other, so that both see the same load.

    python benchmarks/fit_speed.py --label after                          # updates benchmarks/results/fit_speed.json
    python benchmarks/fit_speed.py --label after --against /tmp/main/src  # and 'before', case by case
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import describe_machine, memfit_source, write_labeled_run

CASES = [
    ["llama-3.1-8b", "--gpu", "rtx-4090"],
    ["llama-3.1-8b", "--gpu", "a100-80gb"],
    ["qwen2.5-7b", "--budget", "40GiB", "--seq-len", "8192"],
]
#: Goal for a first (empty-cache) `memfit fit` of an 8B model on the 2-core benchmark machine.
GOAL_SECONDS = 20.0


def answer_digest(result: dict) -> str:
    """sha256 of what the search answered (fits, their peaks, misses, longest sequences), without
    the time it took or the number of plans it needed: equal digests, equal answers."""
    answer = json.loads(json.dumps(result))
    answer["details"].pop("seconds", None)
    answer["details"].pop("plans_made", None)
    return hashlib.sha256(json.dumps(answer, sort_keys=True).encode()).hexdigest()[:16]


def run_fit(case: list[str], cache_dir: str, src: str | None = None) -> tuple[float, dict]:
    """One `memfit fit ... --json` in a new process with ``MEMFIT_CACHE=cache_dir``: (seconds, its JSON).
    ``src``: a checkout's ``src`` folder to run memfit from instead of the one this interpreter imports."""
    env = dict(os.environ, MEMFIT_CACHE=cache_dir)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "memfit", "fit", *case, "--json"], check=True, capture_output=True, text=True, env=env
    )
    return time.perf_counter() - started, json.loads(done.stdout)


def measure_case(case: list[str], repeats: int, src: str | None = None) -> dict:
    """``repeats`` cold + warm pairs of one case, each in a new cache folder: the row the file keeps."""
    cold, warm, answers = [], [], set()
    for _ in range(repeats):
        cache_dir = tempfile.mkdtemp(prefix="memfit-fit-speed-")
        try:
            seconds, result = run_fit(case, cache_dir, src)
            cold.append((seconds, result))
            seconds, again = run_fit(case, cache_dir, src)
            warm.append((seconds, again))
            answers |= {answer_digest(result), answer_digest(again)}
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)
    result = cold[0][1]
    best = result["fits"][0]["spec"] if result["fits"] else None
    cold_s = statistics.median(s for s, _ in cold)
    warm_s = statistics.median(s for s, _ in warm)
    row = {
        "command": "memfit fit " + " ".join(case) + " --json",
        "cold_cache_wall_seconds": round(cold_s, 2),
        "cold_cache_runs_seconds": [round(s, 2) for s, _ in cold],
        "warm_cache_wall_seconds": round(warm_s, 2),
        "warm_cache_runs_seconds": [round(s, 2) for s, _ in warm],
        "meets_goal_cold": cold_s <= GOAL_SECONDS,
        "plans_made": result["details"]["plans_made"],
        "simulations": result["details"].get("simulations"),
        "fits": len(result["fits"]),
        "best": None
        if best is None
        else {k: best[k] for k in ("method", "checkpointing", "optimizer", "batch_size", "grad_accum", "seq_len")},
        "max_seq_len": result["max_seq_len"],
        "answer_sha256": sorted(answers)[0] if len(answers) == 1 else sorted(answers),
        "load_average_1_min_after": round(os.getloadavg()[0], 2),
    }
    print(
        f"{row['command']}{' (' + src + ')' if src else ''}: cold cache {cold_s:.1f} s, warm cache {warm_s:.1f} s, "
        f"{row['plans_made']} plans, max_seq_len {result['max_seq_len']}",
        flush=True,
    )
    return row


def _source_of(src: str) -> dict:
    """:func:`memfit_source` of the memfit in ``src`` (asked of a new process that imports it)."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from _machine import memfit_source; "
        "print(json.dumps(memfit_source()))"
    )
    env = dict(os.environ, PYTHONPATH=src)
    done = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).resolve().parent)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--label", default="after", help="the name these results are kept under in the file (before, after...)"
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="cold + warm pairs per case, each in a new cache (medians reported)"
    )
    parser.add_argument(
        "--against",
        metavar="SRC",
        help="another checkout's src folder, measured case by case just before this one and kept "
        "under the label 'before' (the two then see the same load)",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "fit_speed.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows, against_rows = [], []
    for case in CASES:
        if args.against:
            against_rows.append(measure_case(case, args.repeats, args.against))
        rows.append(measure_case(case, args.repeats))
    header = {
        "benchmark": "fit_speed",
        "command": "python benchmarks/fit_speed.py --label LABEL [--against OTHER/src]",
        "goal_seconds_cold_cache": GOAL_SECONDS,
        "notes": (
            "cold cache: a fresh process and an empty MEMFIT_CACHE folder (every plan is made); warm cache: the "
            "same command again in a fresh process with the first run's cache folder. With --against, each "
            "case runs with the other checkout and then with this one, one after the other. The machine is "
            "shared: timings are noisy, see load_average_1_5_15_min and each case's load_average_1_min_after."
        ),
    }
    loads = {"start": [round(x, 2) for x in load_before], "end": [round(x, 2) for x in os.getloadavg()]}
    if args.against:
        write_labeled_run(
            args.out,
            "before",
            {
                "memfit": _source_of(args.against),
                "machine": describe_machine(),
                "load_average_1_5_15_min": loads,
                "repeats": args.repeats,
                "interleaved_with": args.label,
                "cases": against_rows,
            },
            header,
        )
    run = {
        "memfit": memfit_source(),
        "machine": describe_machine(),
        "load_average_1_5_15_min": loads,
        "repeats": args.repeats,
        **({"interleaved_with": "before"} if args.against else {}),
        "cases": rows,
    }
    out = write_labeled_run(args.out, args.label, run, header)
    print(f"wrote {args.out} (runs: {', '.join(out['runs'])})")


if __name__ == "__main__":
    main()
