"""Pure bf16 against bf16-mixed: the plans docs/plan.md quotes, Llama-3.1-8B full fine-tuning and LoRA.

Plans each (method, precision) with ``memfit.plan`` (what ``memfit plan llama-3.1-8b --method M
--precision P`` prints) and writes benchmarks/results/precision_plans.json: the peak, the
categories, the parameter count, and the bytes the weights, gradients and AdamW states take at the
peak (``state_bytes``, and per parameter): 8 a parameter in pure bf16, 16 in bf16-mixed.

    python benchmarks/precision_plans.py      # four plans, a few minutes on a CPU
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results" / "precision_plans.json"
sys.path.insert(0, str(BENCH))
import _memfit_api as memfit_api  # noqa: E402
from _machine import describe_machine, memfit_source, write_results  # noqa: E402

MODEL = "llama-3.1-8b"
#: (method, precision), in the order docs/plan.md lists them.
PLANS = [("full", "bf16"), ("full", "bf16-mixed"), ("lora", "bf16"), ("lora", "bf16-mixed")]
STATE = ("weights", "trainable", "gradients", "optimizer")


def plan_row(method: str, precision: str) -> dict:
    data = memfit_api.plan(MODEL, method=method, precision=precision).to_dict()
    state = sum(data["categories"][name] for name in STATE)
    parameters = data["details"]["total_params"]
    return {
        "method": method,
        "precision": precision,
        "command": f"memfit plan {MODEL} --method {method} --precision {precision}",
        "peak": data["peak"],
        "categories": data["categories"],
        "parameters": parameters,
        "trainable_parameters": data["details"]["trainable_params"],
        "state_bytes": state,
        "state_bytes_per_parameter": round(state / parameters, 3),
        "precision_regime": data["details"]["precision_regime"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", default=str(RESULTS), help="results file (default benchmarks/results/precision_plans.json)"
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows = []
    for method, precision in PLANS:
        rows.append(plan_row(method, precision))
        print(f"{rows[-1]['command']}: device total {rows[-1]['peak']['device_total_bytes']:,} B", flush=True)
    data = {
        "benchmark": "precision_plans",
        "model": MODEL,
        "plans": rows,
        "wall_seconds": round(time.perf_counter() - started, 1),
        "machine": describe_machine(),
        "memfit": memfit_source(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    out = write_results(Path(args.out), data)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
