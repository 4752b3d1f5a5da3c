"""Plan equals run, the whole table: ``memfit train``'s real steps against their plans.

Each cell runs the trainer's own code (data, collate, loss, clipping, fp16 loss scaling, evaluation
between steps, resume) on the CPU with real tensors, measured by the planner's tracker under the
planner's CUDA-parity rewrites (memfit.train.conformance), and plans the same configuration. The
cells: the suite's matrix (every knob the trainer accepts), then every method x precision x
checkpointing mode on both tiny models.

    python benchmarks/conformance.py            # writes benchmarks/results/conformance.json
    python benchmarks/conformance.py --quick    # the suite's matrix only
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import describe_machine

RESULTS = Path(__file__).parent / "results" / "conformance.json"


def cross_product() -> list[tuple[str, dict]]:
    """Every valid method x precision x checkpointing mode on both tiny models, batch 2, padding-free."""
    cells = []
    for model, method, precision, checkpointing in itertools.product(
        ("llama", "qwen2"), ("full", "lora", "qlora"), ("fp32", "bf16", "fp16"), ("off", "on", "offload")
    ):
        if (method == "qlora" and precision == "fp32") or (method == "full" and precision == "fp16"):
            continue  # refused by the configuration
        cells.append(
            (
                f"{model} {method} {precision} ckpt-{checkpointing} b2",
                dict(model=model, method=method, precision=precision, checkpointing=checkpointing, batch_size=2),
            )
        )
    return cells


def main() -> int:
    from memfit.train.conformance import MATRIX, run_matrix

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the suite's matrix only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    cells = list(MATRIX) + ([] if args.quick else cross_product())
    started = time.perf_counter()

    def show(cell) -> None:
        verdict = (
            "equal"
            if cell.difference_bytes == 0 and not cell.error
            else (cell.error or f"{cell.difference_bytes:+,} B")
        )
        print(
            f"{cell.name:44s} plan {cell.planned_bytes:>11,} B  run {cell.measured_bytes:>11,} B  {verdict}", flush=True
        )

    with tempfile.TemporaryDirectory() as work:
        results = run_matrix(cells, work, progress=show)
    seconds = time.perf_counter() - started
    agree = sum(1 for c in results if c.agrees)
    equal = sum(1 for c in results if c.difference_bytes == 0 and not c.error)
    payload = {
        "benchmark": "conformance",
        "command": "python benchmarks/conformance.py" + (" --quick" if args.quick else ""),
        "machine": describe_machine(),
        "what": "peak allocated bytes of memfit train's steps (CPU, real tensors, the planner's tracker and CUDA-parity "
        "rewrites) against the plan of the same configuration (no CUDA context, no cuBLAS workspaces)",
        "summary": {"cells": len(results), "equal_to_the_byte": equal, "agree": agree, "seconds": round(seconds, 1)},
        "cells": [c.to_dict() for c in results],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"{equal} of {len(results)} cells equal to the byte ({seconds:.0f} s); wrote {args.out}")
    return 0 if agree == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
