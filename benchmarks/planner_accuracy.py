"""Planner accuracy: the plan next to a real CUDA run of the same training step.

Each configuration is run for real in its own process (a fresh CUDA context and allocator), with a
random-init model built from a catalog config on the GPU (no downloads), by memfit's own loader and
training step (the ``hf`` recipe's step for ``recipe="hf"``), for three steps. Recorded:
``torch.cuda.max_memory_allocated``, ``max_memory_reserved`` and the device memory in use
(``torch.cuda.mem_get_info``), next to the plan and the error of each. Goal: median error <= 3%
and p95 <= 8% on peak reserved.

    python benchmarks/planner_accuracy.py                 # needs a CUDA GPU; 61 configurations
    python benchmarks/planner_accuracy.py --list          # show the configurations
    python benchmarks/planner_accuracy.py --tiny --device cpu   # check the harness on a CPU

Writes ``benchmarks/results/planner_accuracy-<gpu>.json``. ``benchmarks/gpu_campaign.py`` runs the
same cases (the functions below) with a time budget and resume.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _memfit_api as api
from _machine import describe_in_subprocess, run_json_child

# (model, knobs), in priority order: the first twelve cover every method and technique once, so a
# run cut short still says something about each; the next fifteen what landed after them (preference
# objectives, adapter variants, the 8-bit base under either checkpointing variant, mixed precision,
# the hf recipe as peers run it), so that the first GPU measures those too; then sizes 1B to 8B, batch
# and length spread, the hf recipe on a quarter. All plan below 62 GiB on an 80 GB card.
CASES: list[tuple[str, dict]] = [
    ("llama-3.2-1b", dict(method="lora", checkpointing="on", batch_size=4, seq_len=2048)),
    ("llama-3.1-8b", dict(method="qlora", checkpointing="on", batch_size=2, seq_len=4096)),
    ("llama-3.2-3b", dict(method="full", checkpointing="on", batch_size=2, seq_len=2048)),
    ("qwen2.5-1.5b", dict(method="lora", checkpointing="off", batch_size=2, seq_len=2048)),
    ("llama-3.1-8b", dict(method="lora", checkpointing="offload", batch_size=1, seq_len=16384)),
    ("mistral-7b-v0.3", dict(method="qlora", checkpointing="on", batch_size=4, seq_len=2048, recipe="hf")),
    ("llama-3.2-1b", dict(method="full", checkpointing="on", batch_size=4, seq_len=2048, optimizer="paged-adamw8bit")),
    ("llama-3.2-3b", dict(method="full", checkpointing="on", batch_size=2, seq_len=1024, optimizer="adamw8bit")),
    ("qwen2.5-7b", dict(method="lora", checkpointing="on", batch_size=1, seq_len=4096, tiling="on")),
    ("llama-3.1-8b", dict(method="qlora", checkpointing="on", batch_size=1, seq_len=4096, recipe="hf")),
    ("llama-3.2-1b", dict(method="lora", checkpointing="off", batch_size=8, seq_len=1024, recipe="hf")),
    ("gemma-2-2b", dict(method="lora", checkpointing="on", batch_size=2, seq_len=2048)),
    # what landed since the first twelve, once each: preference objectives (DPO's reference as the
    # base with adapters disabled and as a frozen copy, ORPO, SimPO), adapter variants, the 8-bit
    # base, mixed precision, and the hf recipe as peers run it (Liger's loss, TRL's chunked loss,
    # the base in the compute dtype, PyTorch's foreach AdamW)
    ("llama-3.2-1b", dict(method="lora", checkpointing="on", batch_size=2, seq_len=1024, objective="dpo")),
    ("llama-3.2-1b", dict(method="full", checkpointing="on", batch_size=1, seq_len=1024, objective="dpo")),
    ("llama-3.2-1b", dict(method="lora", checkpointing="on", batch_size=2, seq_len=1024, objective="orpo")),
    ("qwen2.5-1.5b", dict(method="lora", checkpointing="on", batch_size=2, seq_len=1024, objective="simpo")),
    ("llama-3.2-1b", dict(method="lora", checkpointing="on", batch_size=2, seq_len=2048, dora=True)),
    ("llama-3.2-1b", dict(method="lora", checkpointing="on", batch_size=2, seq_len=2048, rslora=True, rank=64)),
    (
        "qwen2.5-1.5b",
        dict(method="lora", checkpointing="on", batch_size=2, seq_len=2048, modules_to_save="embed_tokens,lm_head"),
    ),
    ("llama-3.2-3b", dict(method="lora-8bit", checkpointing="on", batch_size=2, seq_len=2048)),
    # the 8-bit base under each checkpointing variant of the hf recipe: non-reentrant keeps every
    # 8-bit layer's input until the end of backward, reentrant none
    (
        "llama-3.2-3b",
        dict(method="lora-8bit", checkpointing="on", batch_size=2, seq_len=2048, recipe="hf", use_reentrant="on"),
    ),
    (
        "llama-3.2-3b",
        dict(method="lora-8bit", checkpointing="on", batch_size=2, seq_len=2048, recipe="hf", use_reentrant="off"),
    ),
    ("llama-3.2-1b", dict(method="full", checkpointing="on", batch_size=2, seq_len=2048, precision="bf16-mixed")),
    ("llama-3.2-1b", dict(method="lora", checkpointing="on", batch_size=2, seq_len=4096, recipe="hf", hf_loss="liger")),
    (
        "llama-3.2-1b",
        dict(method="lora", checkpointing="on", batch_size=2, seq_len=4096, recipe="hf", hf_loss="chunked-nll"),
    ),
    (
        "llama-3.2-3b",
        dict(method="qlora", checkpointing="on", batch_size=2, seq_len=2048, recipe="hf", kbit_upcast=False),
    ),
    (
        "llama-3.2-1b",
        dict(method="full", checkpointing="on", batch_size=2, seq_len=1024, recipe="hf", adamw_impl="foreach"),
    ),
    # torchtune's step on the hf recipe: its chunked-output loss (compile: false), adapters in bf16,
    # and the optimizer step in backward
    (
        "llama-3.2-1b",
        dict(
            method="lora",
            checkpointing="on",
            batch_size=2,
            seq_len=4096,
            recipe="hf",
            hf_loss="chunked-output",
            adapter_dtype="compute",
        ),
    ),
    (
        "llama-3.2-1b",
        dict(
            method="full",
            checkpointing="on",
            batch_size=2,
            seq_len=2048,
            recipe="hf",
            hf_loss="chunked-output",
            step_in_backward=True,
            max_grad_norm=None,
        ),
    ),
    # Axolotl's chunked_cross_entropy: the model's whole logits, the loss a chunk at a time
    (
        "llama-3.2-1b",
        dict(method="lora", checkpointing="on", batch_size=2, seq_len=4096, recipe="hf", hf_loss="chunked-ce"),
    ),
    # the spread
    ("llama-3.2-1b", dict(method="full", checkpointing="off", batch_size=1, seq_len=1024)),
    ("llama-3.2-1b", dict(method="qlora", checkpointing="on", batch_size=4, seq_len=2048)),
    ("llama-3.2-1b", dict(method="lora", checkpointing="on", batch_size=1, seq_len=32768)),
    ("llama-3.2-1b", dict(method="full", checkpointing="on", batch_size=2, seq_len=4096, step_in_backward=True)),
    ("llama-3.2-1b", dict(method="qlora", checkpointing="offload", batch_size=1, seq_len=16384, recipe="hf")),
    ("tinyllama-1.1b", dict(method="lora", checkpointing="off", batch_size=4, seq_len=2048, recipe="hf")),
    ("qwen2.5-1.5b", dict(method="full", checkpointing="on", batch_size=2, seq_len=2048)),
    ("qwen2.5-1.5b", dict(method="qlora", checkpointing="off", batch_size=2, seq_len=1024)),
    ("qwen2.5-1.5b", dict(method="lora", checkpointing="offload", batch_size=2, seq_len=8192, recipe="hf")),
    ("qwen2.5-1.5b", dict(method="lora", checkpointing="on", batch_size=4, seq_len=2048, tiling="off")),
    ("smollm2-1.7b", dict(method="full", checkpointing="on", batch_size=4, seq_len=2048, recipe="hf")),
    ("llama-3.2-3b", dict(method="lora", checkpointing="on", batch_size=4, seq_len=4096)),
    ("llama-3.2-3b", dict(method="qlora", checkpointing="off", batch_size=1, seq_len=2048)),
    ("llama-3.2-3b", dict(method="lora", checkpointing="off", batch_size=1, seq_len=4096, recipe="hf")),
    ("llama-3.2-3b", dict(method="qlora", checkpointing="offload", batch_size=1, seq_len=16384)),
    ("llama-3.2-3b", dict(method="full", checkpointing="on", batch_size=1, seq_len=2048, recipe="hf")),
    ("phi-3-mini-4k", dict(method="lora", checkpointing="on", batch_size=2, seq_len=4096)),
    ("phi-3-mini-4k", dict(method="qlora", checkpointing="on", batch_size=4, seq_len=2048, recipe="hf")),
    ("llama-3.1-8b", dict(method="lora", checkpointing="on", batch_size=1, seq_len=2048)),
    ("llama-3.1-8b", dict(method="lora", checkpointing="on", batch_size=4, seq_len=4096)),
    ("llama-3.1-8b", dict(method="lora", checkpointing="off", batch_size=1, seq_len=2048)),
    ("llama-3.1-8b", dict(method="qlora", checkpointing="off", batch_size=1, seq_len=1024)),
    ("llama-3.1-8b", dict(method="qlora", checkpointing="offload", batch_size=1, seq_len=8192)),
    ("llama-3.1-8b", dict(method="qlora", checkpointing="on", batch_size=2, seq_len=8192, grad_accum=2)),
    ("llama-3.1-8b", dict(method="full", checkpointing="on", batch_size=1, seq_len=2048)),
    ("llama-3.1-8b", dict(method="full", checkpointing="on", batch_size=1, seq_len=1024, optimizer="paged-adamw8bit")),
    ("llama-3.1-8b", dict(method="lora", checkpointing="on", batch_size=2, seq_len=4096, recipe="hf")),
    ("qwen2.5-7b", dict(method="qlora", checkpointing="on", batch_size=1, seq_len=8192)),
    ("qwen2.5-7b", dict(method="lora", checkpointing="on", batch_size=2, seq_len=2048, grad_accum=2)),
    ("qwen2.5-7b", dict(method="full", checkpointing="on", batch_size=1, seq_len=1024, optimizer="adamw8bit")),
    ("qwen2.5-7b", dict(method="full", checkpointing="on", batch_size=2, seq_len=2048, step_in_backward=True)),
    ("qwen2.5-7b", dict(method="qlora", checkpointing="offload", batch_size=1, seq_len=16384, tiling="on")),
    ("mistral-7b-v0.3", dict(method="lora", checkpointing="off", batch_size=1, seq_len=4096)),
    ("mistral-7b-v0.3", dict(method="qlora", checkpointing="on", batch_size=2, seq_len=4096)),
    ("qwen3-8b", dict(method="lora", checkpointing="on", batch_size=2, seq_len=4096)),
    ("qwen3-8b", dict(method="qlora", checkpointing="on", batch_size=1, seq_len=8192, recipe="hf")),
]

TINY_MODEL = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
}
TINY_CASES: list[tuple[str | dict, dict]] = [
    (TINY_MODEL, dict(method="lora", checkpointing="on", batch_size=2, seq_len=64)),
    (TINY_MODEL, dict(method="full", checkpointing="off", batch_size=1, seq_len=64, recipe="hf")),
]

STEPS = 3

#: The goal on peak reserved memory (docs/plan.md).
GOAL = {"metric": "reserved", "median_abs_error": 0.03, "p95_abs_error": 0.08}


def model_label(model: str | dict) -> str:
    return model if isinstance(model, str) else "tiny-llama"


def case_id(model: str | dict, knobs: dict) -> str:
    """A stable, readable name for a case: ``llama-3.1-8b/qlora-on-2x4096-hf``."""
    parts = [
        knobs.get("method", "lora"),
        knobs.get("checkpointing", "on"),
        f"{knobs.get('batch_size', 1)}x{knobs.get('seq_len', 2048)}",
    ]
    if knobs.get("grad_accum", 1) != 1:
        parts.append(f"ga{knobs['grad_accum']}")
    for key in (
        "optimizer",
        "tiling",
        "precision",
        "rank",
        "objective",
        "hf_loss",
        "adamw_impl",
        "modules_to_save",
        "use_reentrant",
        "adapter_dtype",
    ):
        if key in knobs:
            parts.append(f"{key}-{knobs[key]}")
    for flag in ("dora", "rslora"):
        if knobs.get(flag):
            parts.append(flag)
    if knobs.get("kbit_upcast") is False:
        parts.append("no-kbit-upcast")
    if knobs.get("step_in_backward"):
        parts.append("step-in-backward")
    if knobs.get("recipe", "memfit") != "memfit":
        parts.append(knobs["recipe"])
    return f"{model_label(model)}/{'-'.join(str(p) for p in parts)}"


# ------------------------------------------------------------------------------------------------
# The plan (any process; never touches CUDA)


def plan_case(model: str | dict, knobs: dict, gpu_key: str | None, device: str) -> dict:
    """The plan of one case, as the results file stores it."""
    # No cuBLAS and no CUDA context on a CPU: plan without them there.
    on_cpu = device == "cpu"
    plan = api.plan(
        model, gpu=gpu_key, cublas_workspace_bytes=0 if on_cpu else None, context_bytes=0 if on_cpu else None, **knobs
    )
    return {
        "allocated_bytes": plan.allocated_bytes,
        "reserved_bytes": plan.reserved_bytes,
        "device_total_bytes": plan.device_total_bytes,
        "paged_bytes": int(plan.details.get("paged_peak_bytes") or 0),
        "context_bytes": plan.details.get("context_bytes"),
        "cublas_workspace_bytes": plan.details.get("cublas_workspace_bytes"),
        "phase": plan.phase,
        "fits": plan.fits,
        "total_params": plan.details.get("total_params"),
        "trainable_params": plan.details.get("trainable_params"),
        "plan_seconds": plan.details.get("plan_seconds"),
    }


# ------------------------------------------------------------------------------------------------
# The measurement (a fresh process per case)


def measure_one(model: str | dict, knobs: dict, device: str, steps: int = STEPS) -> dict:
    """Run ``steps`` real training steps; return peak memory as the framework reports it.

    On CUDA: the allocator's peaks, and the device memory in use at the end (``mem_get_info``) with
    what of it lies outside the allocator (CUDA context, library handles, paged optimizer states).
    On a CPU the planner's tracker measures the same step on real tensors (allocated bytes only).
    """
    import torch

    spec = api.make_spec(**knobs)
    config_dict = api.model_config(model)
    dev = api.resolve_device(device)  # "cuda" -> cuda:0, the device tensors report
    cuda = dev.type == "cuda"
    started = time.perf_counter()
    loaded = api.load_model(config_dict, spec, dev, init="random", seed=0)
    api.keep_reference(loaded.model, spec)
    optimizer = api.build_optimizer(
        loaded.model.parameters(), spec.optimizer, step_in_backward=spec.step_in_backward, adamw_impl=spec.adamw_impl
    )
    step = api.training_step(spec, config_dict)
    grad_scaler = step.grad_scaler(dev)
    load_seconds = time.perf_counter() - started
    vocab = int(loaded.config.vocab_size)
    generator = torch.Generator(device="cpu").manual_seed(0)
    rows = torch.randint(0, vocab, (spec.batch_size, spec.seq_len), generator=generator).tolist()
    # As the trainer makes them: the step's layout (one row of examples, or padded rows), grad_accum
    # micro-batches held through the step.
    micro_batches = api.step_batches(step, rows, dev, spec.grad_accum, spec=spec)
    tracker = None
    if cuda:
        # Loading leaves cached blocks the step never needs; the trainer starts from a clean cache too.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    else:
        # On a CPU the harness measures with the planner's tracker on real tensors: weights first.
        tracker = api.memory_tracker()
        tracker.__enter__()
        tracker.mark_model(loaded.model)
    status, error, step_seconds = "ok", None, []
    try:
        for _ in range(steps):
            step_started = time.perf_counter()
            loss, _ = api.train_step(loaded.model, micro_batches, optimizer, step=step, grad_scaler=grad_scaler)
            float(loss)  # waits for the device
            step_seconds.append(time.perf_counter() - step_started)
    except torch.OutOfMemoryError as err:
        status, error = "oom", str(err).splitlines()[0][:300]
    finally:
        if tracker is not None:
            tracker.__exit__(None, None, None)
    timing = {
        "load_seconds": round(load_seconds, 3),
        "first_step_seconds": round(step_seconds[0], 3) if step_seconds else None,
        "step_seconds": round(statistics.median(step_seconds[1:]), 4) if len(step_seconds) > 1 else None,
    }
    if timing["step_seconds"]:
        timing["tokens_per_second"] = round(
            spec.batch_size * spec.seq_len * spec.grad_accum / timing["step_seconds"], 1
        )
    if not cuda:
        peak = tracker.result().peak.allocated_bytes
        return {
            "status": status,
            "error": error,
            "allocated_bytes": peak,
            "reserved_bytes": None,
            "device_total_bytes": None,
            **timing,
        }
    from _machine import process_gpu_bytes

    torch.cuda.synchronize(dev)
    free_bytes, total_bytes = torch.cuda.mem_get_info(dev)
    used = total_bytes - free_bytes
    reserved_now = torch.cuda.memory_reserved(dev)
    peak_reserved = torch.cuda.max_memory_reserved(dev)
    paged = paged_state_bytes(optimizer)
    # Memory outside the caching allocator (context, library handles), paged states left out: they
    # sit in unified memory and are counted on their own.
    outside = used - reserved_now - paged
    return {
        "status": status,
        "error": error,
        "allocated_bytes": torch.cuda.max_memory_allocated(dev),
        "reserved_bytes": peak_reserved,
        # The device total at the peak: the peak reserved plus what lives outside the allocator.
        "device_total_bytes": peak_reserved + outside + paged,
        "device_used_end_bytes": used,
        "reserved_end_bytes": reserved_now,
        "outside_allocator_bytes": outside,
        "paged_bytes": paged,
        "process_used_bytes": process_gpu_bytes(),
        "device_memory_bytes": total_bytes,
        **timing,
    }


def paged_state_bytes(optimizer) -> int:
    """Bytes of bitsandbytes' paged optimizer states (CUDA unified memory, outside the allocator)."""
    total = 0
    for state in getattr(optimizer, "state", {}).values():
        for value in state.values():
            if getattr(value, "is_paged", False):
                total += value.numel() * value.element_size()
    return total


def measure_in_subprocess(
    model: str | dict, knobs: dict, device: str, *, timeout_s: float | None = None, env: dict | None = None
) -> dict:
    """:func:`measure_one` in a fresh process (its own CUDA context and allocator); never raises."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--device",
        device,
        "--one",
        json.dumps({"model": model, "knobs": knobs}),
    ]
    return run_json_child(command, timeout_s=timeout_s, env=env)


# ------------------------------------------------------------------------------------------------
# Comparing


def relative_error(planned: int | None, measured: int | None) -> float | None:
    """(planned - measured) / measured: positive when the plan says more than the run used."""
    if not planned or not measured:
        return None
    return (planned - measured) / measured


def compare(planned: dict, measured: dict) -> dict:
    """The errors of one case (None where a figure is missing or the run did not finish)."""
    if measured.get("status") != "ok":
        return {"allocated": None, "reserved": None, "device_total": None}
    # Paged optimizer states are outside the plan's device total but on the device when resident.
    planned_total = planned.get("device_total_bytes")
    if planned_total is not None and measured.get("paged_bytes"):
        planned_total += planned.get("paged_bytes") or 0
    return {
        "allocated": relative_error(planned.get("allocated_bytes"), measured.get("allocated_bytes")),
        "reserved": relative_error(planned.get("reserved_bytes"), measured.get("reserved_bytes")),
        "device_total": relative_error(planned_total, measured.get("device_total_bytes")),
    }


def percentile(sorted_values: list[float], fraction: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    return sorted_values[min(len(sorted_values) - 1, round(fraction * (len(sorted_values) - 1)))]


def summarize(rows: list[dict]) -> dict:
    """Median, p95 and worst absolute error per metric, and whether the goal is met."""
    summary = {}
    for key in ("allocated", "reserved", "device_total"):
        errors = [r["error"][key] for r in rows if r.get("error", {}).get(key) is not None]
        if not errors:
            continue
        absolute = sorted(abs(e) for e in errors)
        summary[key] = {
            "n": len(errors),
            "median_abs_error": statistics.median(absolute),
            "p95_abs_error": percentile(absolute, 0.95),
            "max_abs_error": absolute[-1],
            "mean_error": statistics.fmean(errors),
        }
    goal = summary.get(GOAL["metric"])
    summary["meets_goal"] = (
        (goal["median_abs_error"] <= GOAL["median_abs_error"] and goal["p95_abs_error"] <= GOAL["p95_abs_error"])
        if goal
        else None
    )
    summary["statuses"] = {
        s: sum(1 for r in rows if r["measured"].get("status") == s)
        for s in sorted({r["measured"].get("status") for r in rows})
    }
    return summary


def make_row(model: str | dict, knobs: dict, planned: dict, measured: dict) -> dict:
    return {
        "id": case_id(model, knobs),
        "model": model_label(model),
        "knobs": knobs,
        "plan": planned,
        "measured": measured,
        "error": compare(planned, measured),
    }


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
            print(case_id(model, knobs))
        return

    # The GPU is described in a child: a CUDA context held here would sit beside every measurement.
    machine = describe_in_subprocess()
    gpu_key = api.gpu_key(machine["gpu"])
    rows = []
    for model, knobs in cases:
        planned = plan_case(model, knobs, gpu_key, args.device)
        measured = measure_in_subprocess(model, knobs, args.device)
        row = make_row(model, knobs, planned, measured)
        rows.append(row)
        err = row["error"]["reserved"] if row["error"]["reserved"] is not None else row["error"]["allocated"]
        print(f"{row['id']:48s} {measured.get('status')}  error {err if err is None else f'{err:+.2%}'}", flush=True)

    result = {
        "benchmark": "planner_accuracy",
        "command": "python benchmarks/planner_accuracy.py " + " ".join(sys.argv[1:]),
        "machine": machine,
        "steps_per_case": STEPS,
        "goal": "median |error| <= 3% and p95 <= 8% on peak reserved",
        "summary": summarize(rows),
        "cases": rows,
    }
    tag = (gpu_key or ("cpu" if args.device == "cpu" else "gpu")) + ("-tiny" if args.tiny else "")
    out = args.out or Path(__file__).parent / "results" / f"planner_accuracy-{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
