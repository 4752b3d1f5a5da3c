"""Padded, packed and padding-free batches on the shipped instruction data: tokens/s and peak memory.

The demo run (examples/tiny.yaml: a tiny Llama-shaped model, the shipped tokenizer and
tiny-instruct dataset, LoRA, batches of 8 examples of at most 128 tokens) trained three ways:

- ``padded``: ``padding_free: off``, rows padded to the longest example of each micro-batch, with
  the padding mask (and the ``[batch, 1, seq, seq]`` mask the model builds from it);
- ``padding-free``: the 8 examples of a micro-batch in one row, attention inside each example;
- ``packed``: ``packing: true``, examples concatenated into rows of exactly 128 tokens, as many rows
  a micro-batch as hold the tokens of 8 examples on average (the same effective batch in tokens).

Memory is the peak of the training steps as the planner counts it (the trainer's own steps on the
CPU under the planner's tracker and CUDA-parity rewrites), next to the plan of the configuration;
tokens/s counts real (non-padding) tokens over the steps after the first two.

    python benchmarks/batch_layouts.py      # writes benchmarks/results/batch_layouts.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import describe_machine

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "batch_layouts.json"
DATA = REPO / "src" / "memfit" / "assets" / "data" / "tiny-instruct.jsonl"
BATCH, SEQ_LEN = 8, 128


def settings(out: Path, mode: str, packed_rows: int, steps: int) -> dict:
    import yaml

    base = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
    base.update(
        data=str(DATA),
        output_dir=str(out),
        max_steps=steps,
        eval_split=0.0,
        save_every=0,
        log_every=1,
        batch_size=BATCH,
        seq_len=SEQ_LEN,
    )
    base.pop("eval_every", None)
    base.pop("epochs", None)
    if mode == "padded":
        base["padding_free"] = "off"
    elif mode == "padding-free":
        base["padding_free"] = "on"
    else:
        base.update(packing=True, batch_size=packed_rows)
    return base


def mean_example_tokens() -> float:
    from transformers import AutoTokenizer

    from memfit.train.data import load_records, tiny_tokenizer_path, tokenize_records

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_path()))
    records, _ = load_records(DATA)
    return statistics.mean(len(e["input_ids"]) for e in tokenize_records(records, tokenizer, seq_len=SEQ_LEN))


def run_mode(mode: str, packed_rows: int, speed_steps: int, memory_steps: int, work: Path) -> dict:
    from memfit.planner.api import plan
    from memfit.train.config import model_config_dict, validate_config
    from memfit.train.recipe import train
    from memfit.watch.timeline import load_run

    # Memory: every step measured as the planner counts.
    memory_config = validate_config(settings(work / f"{mode}-memory", mode, packed_rows, memory_steps))
    train(memory_config, progress=False, conformance_steps=memory_steps)
    attribution = load_run(work / f"{mode}-memory").timeline.attribution
    planned = plan(model_config_dict(memory_config), context_bytes=0, cublas_workspace_bytes=0, **memory_config.knobs())
    # Speed: a plain run (the recorder measures the first two steps by category; they are left out).
    speed_config = validate_config(settings(work / f"{mode}-speed", mode, packed_rows, speed_steps))
    started = time.perf_counter()
    train(speed_config, progress=False)
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (work / f"{mode}-speed" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r][2:]
    tokens = sum(r["tokens"] for r in steps)
    seconds = sum(r["tokens"] / r["tokens_per_second"] for r in steps if r["tokens_per_second"])
    return {
        "mode": mode,
        "batch_size": memory_config.batch_size,
        "packing": bool(memory_config.packing),
        "padding_free": memory_config.padding_free,
        "measured_peak_bytes": int(attribution["peak_allocated_bytes"]),
        "planned_peak_bytes": int(planned.allocated_bytes),
        "tokens_per_step": round(tokens / max(len(steps), 1), 1),
        "tokens_per_second": round(tokens / seconds, 1) if seconds else None,
        "final_loss": steps[-1]["loss"] if steps else None,
        "wall_seconds": round(wall, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speed-steps", type=int, default=40)
    parser.add_argument("--memory-steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    mean_tokens = mean_example_tokens()
    packed_rows = max(1, round(BATCH * mean_tokens / SEQ_LEN))
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for mode in ("padded", "padding-free", "packed"):
            row = run_mode(mode, packed_rows, args.speed_steps, args.memory_steps, Path(work))
            rows.append(row)
            print(
                f"{mode:13s} peak {row['measured_peak_bytes'] / 2**20:7.2f} MiB (plan {row['planned_peak_bytes'] / 2**20:7.2f}) "
                f"{row['tokens_per_step']:7.1f} tokens/step {row['tokens_per_second']:9.1f} tokens/s",
                flush=True,
            )
    payload = {
        "benchmark": "batch_layouts",
        "command": "python benchmarks/batch_layouts.py " + " ".join(sys.argv[1:]),
        "machine": describe_machine(),
        "setup": {
            "config": "examples/tiny.yaml",
            "batch_size": BATCH,
            "seq_len": SEQ_LEN,
            "mean_example_tokens": round(mean_tokens, 1),
            "packed_rows_per_micro_batch": packed_rows,
        },
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
