"""The longest sequence Llama-3.1-8B trains at on 1, 2, 4 and 8 H100s, with and without sequence
parallelism, planned.

For each GPU count N: LoRA (rank 16, bf16), micro-batch 1, offloaded checkpointing (memfit's
leanest step for long rows), sharded with ``fsdp`` from 2 GPUs; once with FSDP alone (every GPU
holds whole rows) and once with ``sequence_parallel: N`` (the N GPUs share each row). The model's
config is Llama-3.1-8B's with its positions extended to 1,048,576 (``max_position_embeddings``, as a
long-context run extends its rotary embeddings): at its own 131,072 positions every count fits the
whole length, so the limit would be the config's, not memory. The longest length that fits an H100
(80 GB) is found by bisection over multiples of 1,024 tokens, each length a plan (``memfit.plan``);
the plan at the longest length is kept (per-GPU peak, activations).

    python benchmarks/sequence_parallel.py        # writes benchmarks/results/sequence_parallel.json

No GPU is used: these are plans. ``python benchmarks/figures.py --write`` puts the table into the
README.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _machine import describe_machine, write_results

RESULTS = Path(__file__).parent / "results"
MODEL, GPU = "llama-3.1-8b", "h100"
KNOBS = dict(method="lora", rank=16, precision="bf16", batch_size=1, checkpointing="offload")
GPU_COUNTS = (1, 2, 4, 8)
STEP_TOKENS, MAX_TOKENS = 1024, 1048576


def _model() -> dict:
    from memfit.models.catalog import load_catalog_config

    config = dict(load_catalog_config(MODEL))
    config["max_position_embeddings"] = MAX_TOKENS
    config["_name_or_path"] = MODEL
    return config


def _plan(gpus: int, degree: int, seq_len: int):
    from memfit import plan

    sharding = dict(gpus=gpus, shard="fsdp") if gpus > 1 else {}
    return plan(_model(), gpu=GPU, seq_len=seq_len, sequence_parallel=degree, **sharding, **KNOBS)


def longest(gpus: int, degree: int) -> dict:
    """The longest multiple of STEP_TOKENS (at most MAX_TOKENS) that fits, by bisection, and its plan."""
    started = time.perf_counter()
    low, high, best = 0, MAX_TOKENS // STEP_TOKENS, None
    plans = 0
    while low < high:
        mid = (low + high + 1) // 2
        found = _plan(gpus, degree, mid * STEP_TOKENS)
        plans += 1
        if found.fits:
            low, best = mid, found
        else:
            high = mid - 1
    row = {"gpus": gpus, "sequence_parallel": degree, "max_seq_len": low * STEP_TOKENS, "plans": plans}
    if best is not None:
        row.update(
            device_total_bytes=best.device_total_bytes,
            activations_bytes=best.categories["activations"],
            limited_by_positions=low * STEP_TOKENS == MAX_TOKENS,
            seconds=round(time.perf_counter() - started, 1),
        )
    return row


def main() -> int:
    started = time.perf_counter()
    rows = []
    for gpus in GPU_COUNTS:
        for degree in sorted({1, gpus}):
            rows.append(longest(gpus, degree))
            print(rows[-1], flush=True)
    data = {
        "machine": describe_machine(),
        "setup": {
            "model": MODEL,
            "max_position_embeddings": MAX_TOKENS,
            "gpu": GPU,
            **KNOBS,
            "step_tokens": STEP_TOKENS,
            "max_tokens": MAX_TOKENS,
        },
        "rows": rows,
        "seconds": round(time.perf_counter() - started, 1),
    }
    write_results(RESULTS / "sequence_parallel.json", data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
