"""Planner accuracy: the plan next to a real CUDA run of the same training step.

Each configuration is run for real in its own process (a fresh CUDA context and allocator), with a
random-init model built from a catalog config on the GPU (no downloads), by memfit's own loader and
training step, for three steps. Recorded: ``torch.cuda.max_memory_allocated``,
``max_memory_reserved`` and the device memory in use (``torch.cuda.mem_get_info``), next to the plan
and the error of each. Goal: median error <= 3% and p95 <= 8% on peak reserved.

    python benchmarks/planner_accuracy.py                 # needs a CUDA GPU; ~20 configurations
    python benchmarks/planner_accuracy.py --list          # show the configurations
    python benchmarks/planner_accuracy.py --tiny --device cpu   # check the harness on a CPU

Writes ``benchmarks/results/planner_accuracy-<gpu>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import describe_machine  # noqa: E402

# (model, knobs): 3+ model sizes; full, LoRA, QLoRA; checkpointing on/off; several batch sizes and lengths.
CASES: list[tuple[str, dict]] = [
    ("llama-3.2-1b", dict(method="full", checkpointing="off", batch_size=1, seq_len=1024)),
    ("llama-3.2-1b", dict(method="full", checkpointing="on", batch_size=4, seq_len=2048)),
    ("llama-3.2-1b", dict(method="lora", checkpointing="off", batch_size=2, seq_len=2048)),
    ("llama-3.2-1b", dict(method="lora", checkpointing="on", batch_size=8, seq_len=1024)),
    ("llama-3.2-1b", dict(method="qlora", checkpointing="on", batch_size=4, seq_len=2048)),
    ("qwen2.5-1.5b", dict(method="full", checkpointing="on", batch_size=2, seq_len=2048)),
    ("qwen2.5-1.5b", dict(method="lora", checkpointing="off", batch_size=1, seq_len=4096)),
    ("qwen2.5-1.5b", dict(method="qlora", checkpointing="off", batch_size=2, seq_len=1024)),
    ("llama-3.2-3b", dict(method="full", checkpointing="on", batch_size=1, seq_len=2048)),
    ("llama-3.2-3b", dict(method="lora", checkpointing="on", batch_size=4, seq_len=4096)),
    ("llama-3.2-3b", dict(method="qlora", checkpointing="off", batch_size=1, seq_len=2048)),
    ("llama-3.2-3b", dict(method="full", checkpointing="on", batch_size=2, seq_len=1024, optimizer="adamw8bit")),
    ("llama-3.1-8b", dict(method="lora", checkpointing="on", batch_size=1, seq_len=2048)),
    ("llama-3.1-8b", dict(method="lora", checkpointing="on", batch_size=4, seq_len=4096)),
    ("llama-3.1-8b", dict(method="lora", checkpointing="off", batch_size=1, seq_len=2048)),
    ("llama-3.1-8b", dict(method="qlora", checkpointing="on", batch_size=2, seq_len=4096)),
    ("llama-3.1-8b", dict(method="qlora", checkpointing="off", batch_size=1, seq_len=1024)),
    ("llama-3.1-8b", dict(method="qlora", checkpointing="offload", batch_size=1, seq_len=8192)),
    ("qwen2.5-7b", dict(method="qlora", checkpointing="on", batch_size=1, seq_len=8192)),
    ("qwen2.5-7b", dict(method="lora", checkpointing="on", batch_size=2, seq_len=2048, grad_accum=2)),
    ("qwen2.5-7b", dict(method="full", checkpointing="on", batch_size=1, seq_len=1024, optimizer="adamw8bit")),
    ("mistral-7b-v0.3", dict(method="qlora", checkpointing="on", batch_size=4, seq_len=2048)),
]

TINY_MODEL = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512,
}
TINY_CASES: list[tuple[str | dict, dict]] = [
    (TINY_MODEL, dict(method="lora", checkpointing="on", batch_size=2, seq_len=64)),
    (TINY_MODEL, dict(method="full", checkpointing="off", batch_size=1, seq_len=64)),
]

STEPS = 3


def measure_one(model: str | dict, knobs: dict, device: str) -> dict:
    """Run STEPS real training steps; return peak memory as the framework reports it."""
    import torch

    from memfit.models.catalog import resolve_model
    from memfit.planner.tracker import MemoryTracker
    from memfit.spec import make_spec
    from memfit.step.losses import causal_lm_loss
    from memfit.step.optim import build_optimizer
    from memfit.step.train_step import train_step
    from memfit.train.loading import load_model

    spec = make_spec(**knobs)
    source = resolve_model(model)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    loaded = load_model(source.config, spec, dev, init="random", seed=0)
    optimizer = build_optimizer(loaded.model.parameters(), spec.optimizer)
    vocab = int(loaded.config.vocab_size)
    batch = {"input_ids": torch.randint(0, vocab, (spec.batch_size, spec.seq_len), device=dev)}
    batch["labels"] = batch["input_ids"].clone()
    micro_batches = [batch] * spec.grad_accum
    tracker = None
    if dev.type == "cuda":
        # Loading leaves cached blocks the step never needs; the trainer starts from a clean cache too.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    else:
        # On a CPU the harness measures with the planner's tracker on real tensors: weights first.
        tracker = MemoryTracker()
        tracker.__enter__()
        tracker.mark_model(loaded.model)
    started = time.perf_counter()
    status = "ok"
    try:
        for _ in range(STEPS):
            loss, _ = train_step(loaded.model, micro_batches, optimizer, loss_fn=causal_lm_loss)
        float(loss)
    except torch.OutOfMemoryError:
        status = "oom"
    finally:
        if tracker is not None:
            tracker.__exit__(None, None, None)
    seconds = time.perf_counter() - started
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        free, total = torch.cuda.mem_get_info(dev)
        return {
            "status": status,
            "allocated_bytes": torch.cuda.max_memory_allocated(dev),
            "reserved_bytes": torch.cuda.max_memory_reserved(dev),
            "device_used_bytes": total - free,
            "step_seconds": seconds / STEPS,
        }
    peak = tracker.result().peak.allocated_bytes
    return {"status": status, "allocated_bytes": peak, "reserved_bytes": None, "device_used_bytes": None, "step_seconds": seconds / STEPS}


def _error(planned: int | None, measured: int | None) -> float | None:
    if not planned or not measured:
        return None
    return (planned - measured) / measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--tiny", action="store_true", help="two tiny configurations (to check the harness)")
    parser.add_argument("--list", action="store_true", help="print the configurations and exit")
    parser.add_argument("--max-cases", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: JSON of one case, run in a child
    args = parser.parse_args()

    if args.one:
        case = json.loads(args.one)
        print(json.dumps(measure_one(case["model"], case["knobs"], args.device)))
        return

    cases = TINY_CASES if args.tiny else CASES
    cases = cases[: args.max_cases] if args.max_cases else cases
    if args.list:
        for model, knobs in cases:
            print(model if isinstance(model, str) else "tiny-llama", knobs)
        return

    import memfit

    machine = describe_machine()
    gpu_name = machine["gpu"]
    gpu_key = None
    if gpu_name:
        from memfit.models.gpus import get_gpu

        try:
            gpu_key = get_gpu(gpu_name).name
        except ValueError:
            gpu_key = None
    rows = []
    for model, knobs in cases:
        # No cuBLAS on a CPU: plan without its workspaces there.
        workspace = 0 if args.device == "cpu" else None
        plan = memfit.plan(model, gpu=gpu_key, cublas_workspace_bytes=workspace, **knobs)
        child = subprocess.run(
            [sys.executable, __file__, "--device", args.device, "--one", json.dumps({"model": model, "knobs": knobs})],
            capture_output=True,
            text=True,
        )
        if child.returncode != 0:
            measured = {"status": "error", "error": child.stderr.strip().splitlines()[-1:]}
        else:
            measured = json.loads(child.stdout.strip().splitlines()[-1])
        row = {
            "model": model if isinstance(model, str) else "tiny-llama",
            "knobs": knobs,
            "plan": {
                "allocated_bytes": plan.allocated_bytes,
                "reserved_bytes": plan.reserved_bytes,
                "device_total_bytes": plan.device_total_bytes,
                "phase": plan.phase,
                "fits": plan.fits,
            },
            "measured": measured,
            "error": {
                "allocated": _error(plan.allocated_bytes, measured.get("allocated_bytes")),
                "reserved": _error(plan.reserved_bytes, measured.get("reserved_bytes")),
                "device_total": _error(plan.device_total_bytes, measured.get("device_used_bytes")),
            },
        }
        rows.append(row)
        err = row["error"]["reserved"] if row["error"]["reserved"] is not None else row["error"]["allocated"]
        print(f"{row['model']:16s} {knobs}  {measured.get('status')}  error {err if err is None else f'{err:+.2%}'}")

    summary = {}
    for key in ("allocated", "reserved", "device_total"):
        errors = sorted(abs(r["error"][key]) for r in rows if r["error"][key] is not None)
        if errors:
            summary[key] = {
                "median_abs_error": statistics.median(errors),
                "p95_abs_error": errors[min(len(errors) - 1, int(round(0.95 * (len(errors) - 1))))],
                "n": len(errors),
            }
    result = {
        "benchmark": "planner_accuracy",
        "command": "python benchmarks/planner_accuracy.py " + " ".join(sys.argv[1:]),
        "machine": machine,
        "steps_per_case": STEPS,
        "goal": "median |error| <= 3% and p95 <= 8% on peak reserved",
        "summary": summary,
        "cases": rows,
    }
    tag = (gpu_key or ("cpu" if args.device == "cpu" else "gpu")) + ("-tiny" if args.tiny else "")
    out = args.out or Path(__file__).parent / "results" / f"planner_accuracy-{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
