"""What each adapter option adds to a plan: the plans docs/plan.md's "Adapter options" table quotes.

Plans Llama-3.1-8B with ``memfit.plan`` (what ``memfit plan llama-3.1-8b --gpu a100-80gb`` prints,
LoRA r=16 on every linear layer, bf16, one sequence of 2,048 tokens, checkpointing on) once with
plain LoRA and once with each option, and writes benchmarks/results/adapter_plans.json: each
plan's peak, categories and host memory.

    python benchmarks/adapter_plans.py      # five plans, a few minutes on a CPU
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results" / "adapter_plans.json"
sys.path.insert(0, str(BENCH))
import _memfit_api as memfit_api  # noqa: E402
from _machine import describe_machine, memfit_source, write_results  # noqa: E402

MODEL = "llama-3.1-8b"
GPU = "a100-80gb"
#: option as typed -> the knobs it sets, in the order docs/plan.md lists them (LoRA first: the others are against it).
OPTIONS = {
    "LoRA": {"method": "lora"},
    "--dora": {"method": "lora", "dora": True},
    "--modules-to-save embed_tokens,lm_head": {"method": "lora", "modules_to_save": ["embed_tokens", "lm_head"]},
    "--method lora-8bit": {"method": "lora-8bit"},
    "--method qlora": {"method": "qlora"},
}
KNOBS = {"rank": 16, "precision": "bf16", "seq_len": 2048, "batch_size": 1, "checkpointing": "on"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", default=str(RESULTS), help="results file (default benchmarks/results/adapter_plans.json)"
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows = []
    for option, knobs in OPTIONS.items():
        data = memfit_api.plan(MODEL, gpu=GPU, **KNOBS, **knobs).to_dict()
        rows.append(
            {
                "option": option,
                "knobs": knobs,
                "peak": data["peak"],
                "categories": data["categories"],
                "host_peak_bytes": data["details"].get("host_peak_bytes"),
            }
        )
        print(f"{option}: device total {data['peak']['device_total_bytes']:,} B", flush=True)
    data = {
        "benchmark": "adapter_plans",
        "model": MODEL,
        "gpu": GPU,
        "knobs": KNOBS,
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
