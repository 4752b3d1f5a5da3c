"""How long `memfit fit` takes for an 8B model on this machine (goal: <= 60 s).

Runs the real CLI (`memfit fit MODEL --gpu GPU --json`) in a fresh process, so imports count, and
records the wall time, the number of plans and what the search found.

    python benchmarks/fit_speed.py             # writes benchmarks/results/fit_speed.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import describe_machine  # noqa: E402

CASES = [
    ["llama-3.1-8b", "--gpu", "rtx-4090"],
    ["llama-3.1-8b", "--gpu", "a100-80gb"],
    ["qwen2.5-7b", "--budget", "40GiB", "--seq-len", "8192"],
]
GOAL_SECONDS = 60.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "fit_speed.json")
    args = parser.parse_args()
    memfit_cli = shutil.which("memfit") or "memfit"
    rows = []
    for case in CASES:
        started = time.perf_counter()
        done = subprocess.run([memfit_cli, "fit", *case, "--json"], check=True, capture_output=True, text=True)
        seconds = time.perf_counter() - started
        result = json.loads(done.stdout)
        best = result["fits"][0]["spec"] if result["fits"] else None
        rows.append({
            "command": "memfit fit " + " ".join(case) + " --json",
            "wall_seconds": round(seconds, 2),
            "meets_goal": seconds <= GOAL_SECONDS,
            "plans_made": result["details"]["plans_made"],
            "fits": len(result["fits"]),
            "best": None if best is None else {k: best[k] for k in ("method", "checkpointing", "optimizer", "batch_size", "grad_accum", "seq_len")},
            "max_seq_len": result["max_seq_len"],
        })
        print(f"{rows[-1]['command']}: {seconds:.1f} s, {rows[-1]['plans_made']} plans, max_seq_len {result['max_seq_len']}")
    out = {
        "benchmark": "fit_speed",
        "command": "python benchmarks/fit_speed.py",
        "machine": describe_machine(),
        "goal_seconds": GOAL_SECONDS,
        "cases": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
