"""How long `memfit plan` takes: warm (in-process, imports done) and cold (a fresh CLI process).

Goal (per GPU plan, on a 2-core CPU machine): an 8B model in <= 5 s, a 70B model in <= 10 s.

    python benchmarks/plan_speed.py            # writes benchmarks/results/plan_speed.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _memfit_api as api  # noqa: E402
from _machine import describe_machine  # noqa: E402

CASES = [
    ("llama-3.1-8b", dict(method="qlora", seq_len=4096, batch_size=2, checkpointing="on")),
    ("llama-3.1-8b", dict(method="lora", seq_len=2048, batch_size=1, checkpointing="off")),
    ("llama-3.1-8b", dict(method="full", seq_len=2048, batch_size=1, checkpointing="on")),
    ("qwen2.5-7b", dict(method="qlora", seq_len=8192, batch_size=1, checkpointing="on")),
    ("llama-3.1-70b", dict(method="qlora", seq_len=4096, batch_size=1, checkpointing="on")),
    ("llama-3.1-70b", dict(method="lora", seq_len=2048, batch_size=1, checkpointing="on")),
    ("qwen2.5-72b", dict(method="qlora", seq_len=2048, batch_size=1, checkpointing="on")),
]
GOALS_S = {"8b": 5.0, "70b": 10.0}


def clear_simulation_cache() -> None:
    api.clear_plan_cache()


def _cli_args(model: str, knobs: dict) -> list[str]:
    args = [model]
    for key, value in knobs.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    return args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="warm runs per case (the median is reported)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "plan_speed.json")
    args = parser.parse_args()

    started = time.perf_counter()
    import memfit

    memfit.plan("smollm2-135m", seq_len=128)  # pays the one-time imports and first-dispatch costs
    warmup_s = time.perf_counter() - started

    cases = []
    for model, knobs in CASES:
        warm = []
        for _ in range(args.repeats):
            clear_simulation_cache()  # time the simulation, not the cache
            t0 = time.perf_counter()
            plan = memfit.plan(model, **knobs)
            warm.append(time.perf_counter() - t0)
        memfit_cli = shutil.which("memfit") or "memfit"
        t0 = time.perf_counter()
        subprocess.run([memfit_cli, "plan", *_cli_args(model, knobs), "--json"], check=True, capture_output=True)
        cold = time.perf_counter() - t0
        size = "70b" if "70b" in model or "72b" in model else "8b"
        row = {
            "model": model,
            "knobs": knobs,
            "warm_seconds_median": round(statistics.median(warm), 3),
            "warm_seconds": [round(w, 3) for w in warm],
            "cold_cli_seconds": round(cold, 3),
            "goal_seconds": GOALS_S[size],
            "warm_meets_goal": statistics.median(warm) <= GOALS_S[size],
            "cold_meets_goal": cold <= GOALS_S[size],
            "simulated_layers": plan.details["simulated_layers"],
            "device_total_bytes": plan.device_total_bytes,
        }
        cases.append(row)
        print(f"{model:16s} {knobs['method']:6s} warm {row['warm_seconds_median']:6.2f} s   cold CLI {cold:6.2f} s")

    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {api.PLANNER_MODULE}, peft, bitsandbytes"], check=True, capture_output=True)
    import_s = time.perf_counter() - t0

    result = {
        "benchmark": "plan_speed",
        "command": "python benchmarks/plan_speed.py",
        "machine": describe_machine(),
        "first_plan_in_process_seconds": round(warmup_s, 3),
        "imports_seconds": round(import_s, 3),
        "notes": (
            "warm: memfit.plan() in a process that has already planned once (imports done), with the "
            "in-process simulation cache cleared before each run; "
            "cold: a new `memfit plan ... --json` process, which first imports torch, transformers, peft "
            "and bitsandbytes (imports_seconds of it)."
        ),
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
