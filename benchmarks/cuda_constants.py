"""The runtime constants the planner assumes for a GPU, measured on it.

The planner adds to the tensors of a step what fake tensors cannot see (docs/plan.md): the CUDA
context (outside the caching allocator), cuBLAS workspaces (inside it) and the caching allocator's
rounding and segments. Each is an assumption in ``memfit.planner.exact.runtime`` and
``memfit.planner.exact.allocator``; this script measures them, in a fresh process, next to the values
assumed for the GPU's architecture:

1. the CUDA context right after the first CUDA call, as device memory in use minus what the
   allocator holds (``mem_get_info``; also nvidia-smi's figure for this process when there is one);
2. the allocator's block and segment sizes for single requests of chosen sizes, and a replay of a
   seeded sequence of allocations and frees, each against the planner's allocator model;
3. the cuBLAS workspaces: what the first forward matmul and the first backward add to allocated
   memory, and what ``torch._C._cuda_clearCublasWorkspaces()`` gives back;
4. the context again after real training steps of a small model through memfit's step (LoRA, then
   QLoRA: the kernels a training process loads, bitsandbytes' included).

    python benchmarks/cuda_constants.py                  # needs a CUDA GPU; a few seconds
    python benchmarks/cuda_constants.py --device cpu     # the harness on a CPU: assumed values only

On a CPU there is no CUDA context, no cuBLAS and no caching allocator: the file then holds the
assumed values and the model's expectations, with every measured value null.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _memfit_api as api

MiB = 1 << 20

#: Request sizes around every boundary of the allocator model: the 512-byte block, the 1 MiB small
#: pool limit, the 10 MiB line under which large requests share 20 MiB segments, 2 MiB rounding.
ROUNDING_SIZES = (
    1,
    511,
    512,
    513,
    4096,
    MiB - 1,
    MiB,
    MiB + 1,
    5 * MiB,
    10 * MiB - 1,
    10 * MiB,
    10 * MiB + 1,
    21 * MiB + 3,
    100 * MiB + 7,
)

#: A small Llama for the training-kernel stage: big enough to run real GEMMs and attention kernels
#: (on a CPU, where nothing is measured, a quarter of it in each dimension).
SMALL_MODEL = {
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 4096,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
CPU_MODEL = {**SMALL_MODEL, "hidden_size": 128, "intermediate_size": 352, "vocab_size": 1024}


def random_events(seed: int, count: int, max_live: int = 40) -> list[tuple[str, int, int]]:
    """A seeded mix of small and large allocations and frees (``empty_cache`` now and then)."""
    rng = random.Random(seed)
    live: list[int] = []
    events: list[tuple[str, int, int]] = []
    next_key = 0
    for _ in range(count):
        roll = rng.random()
        if roll < 0.02:
            events.append(("empty_cache", 0, 0))
        elif live and (roll < 0.45 or len(live) >= max_live):
            events.append(("free", live.pop(rng.randrange(len(live))), 0))
        else:
            size = rng.choice(
                [
                    rng.randint(1, 4096),
                    rng.randint(4096, MiB + 4096),
                    rng.randint(MiB, 12 * MiB),
                    rng.randint(12 * MiB, 64 * MiB),
                ]
            )
            events.append(("alloc", next_key, size))
            live.append(next_key)
            next_key += 1
    return events


def model_single_requests() -> list[dict]:
    """What the allocator model says each single request costs (allocated block, reserved segment)."""
    rows = []
    for size in ROUNDING_SIZES:
        result = api.allocator_model([("alloc", 0, size)])
        rows.append(
            {
                "request_bytes": size,
                "model_allocated_bytes": result.peak_allocated_bytes,
                "model_reserved_bytes": result.peak_reserved_bytes,
            }
        )
    return rows


def measure(device_name: str, idle_used_bytes: int | None = None) -> dict:
    """Every stage above on ``device_name`` (on a CPU: the assumptions and the model's figures only)."""
    import torch

    gpu_name = torch.cuda.get_device_name(api.resolve_device(device_name)) if device_name.startswith("cuda") else None
    key = api.gpu_key(gpu_name)
    arch = api.get_gpu(key).arch if key else None
    out = {
        "device": device_name,
        "gpu": gpu_name,
        "gpu_key": key,
        "arch": arch,
        "assumed": {**api.runtime_assumptions(arch), "allocator": api.allocator_constants()},
        "idle_used_bytes": idle_used_bytes,
        "single_requests": model_single_requests(),
    }
    events = random_events(7, 600)
    model = api.allocator_model(events)
    out["replay"] = {
        "events": len(events),
        "seed": 7,
        "model_peak_reserved_bytes": model.peak_reserved_bytes,
        "model_peak_allocated_bytes": model.peak_allocated_bytes,
    }
    if not device_name.startswith("cuda"):
        out["measured"] = None
        out["reason"] = "no CUDA device: a CPU has no CUDA context, no cuBLAS and no caching allocator"
        out["training_steps"] = _training_stages(torch.device("cpu"))
        return out

    from _machine import process_gpu_bytes

    device = api.resolve_device(device_name)  # "cuda" -> cuda:0, and the current device
    measured: dict = {}

    # 1. The context of a process that has touched CUDA once.
    first = torch.zeros(1, device=device)
    torch.cuda.synchronize(device)
    measured["after_init"] = _outside_allocator(device, idle_used_bytes, process_gpu_bytes())
    del first
    torch.cuda.empty_cache()

    # 2. Allocator: single requests on an empty allocator, then a replayed sequence.
    singles = []
    for row in out["single_requests"]:
        before_alloc, before_reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        block = torch.empty(row["request_bytes"], dtype=torch.uint8, device=device)
        singles.append(
            {
                **row,
                "allocated_bytes": torch.cuda.memory_allocated(device) - before_alloc,
                "reserved_bytes": torch.cuda.memory_reserved(device) - before_reserved,
            }
        )
        del block
        torch.cuda.empty_cache()
    out["single_requests"] = singles
    measured["single_requests_matching"] = sum(
        1
        for r in singles
        if r["allocated_bytes"] == r["model_allocated_bytes"] and r["reserved_bytes"] == r["model_reserved_bytes"]
    )
    tensors: dict[int, torch.Tensor] = {}
    mismatches = []
    for index, (kind, key_, nbytes) in enumerate(events):
        if kind == "alloc":
            tensors[key_] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        elif kind == "free":
            del tensors[key_]
        else:
            torch.cuda.empty_cache()
        real = (torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device))
        expected = (model.reserved_trace[index], model.allocated_trace[index])
        if real != expected:
            mismatches.append({"event": index, "kind": kind, "bytes": nbytes, "real": real, "model": expected})
    tensors.clear()
    torch.cuda.empty_cache()
    out["replay"].update(mismatched_events=len(mismatches), first_mismatches=mismatches[:5])

    # 3. cuBLAS workspaces: one per (handle, stream); forward runs on this thread, backward on
    # autograd's device thread.
    x = torch.randn(1024, 1024, dtype=torch.bfloat16, device=device)
    w = torch.randn(1024, 1024, dtype=torch.bfloat16, device=device, requires_grad=True)
    out_buffer = torch.empty(1024, 1024, dtype=torch.bfloat16, device=device)
    before = torch.cuda.memory_allocated(device)
    torch.matmul(x, w.detach(), out=out_buffer)
    torch.cuda.synchronize(device)
    measured["first_forward_matmul_bytes"] = torch.cuda.memory_allocated(device) - before
    y = x @ w
    before_backward = torch.cuda.memory_allocated(device)
    y.float().sum().backward()
    torch.cuda.synchronize(device)
    grad_bytes = w.grad.untyped_storage().nbytes()
    measured["first_backward_bytes_beyond_grad"] = (
        torch.cuda.memory_allocated(device) - before_backward - _block(grad_bytes)
    )
    before_clear = torch.cuda.memory_allocated(device)
    torch._C._cuda_clearCublasWorkspaces()
    measured["cublas_workspaces_freed_bytes"] = before_clear - torch.cuda.memory_allocated(device)
    del x, w, y, out_buffer
    torch.cuda.empty_cache()

    # 4. The context once a training process has loaded its kernels.
    out["training_steps"] = _training_stages(device, idle_used_bytes)
    out["measured"] = measured
    return out


def _training_stages(device, idle_used_bytes: int | None = None) -> list[dict]:
    """Two steps of memfit's training step on a small model, LoRA then QLoRA; after each, what lies
    outside the allocator (CUDA only)."""
    import torch
    from _machine import process_gpu_bytes

    stages = []
    model, seq_len = (SMALL_MODEL, 512) if device.type == "cuda" else (CPU_MODEL, 128)
    for method, precision in (("lora", "bf16"), ("qlora", "bf16")):
        spec = api.make_spec(method=method, precision=precision, batch_size=2, seq_len=seq_len, checkpointing="on")
        loaded = api.load_model(model, spec, device, init="random", seed=0)
        optimizer = api.build_optimizer(loaded.model.parameters(), spec.optimizer)
        step = api.training_step(spec, model)
        rows = torch.randint(0, model["vocab_size"], (2, seq_len)).tolist()
        for _ in range(2):
            loss, _ = api.train_step(loaded.model, api.step_batches(step, rows, device), optimizer, step=step)
        row = {"method": method, "loss": float(loss)}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            row.update(_outside_allocator(device, idle_used_bytes, process_gpu_bytes()))
        stages.append(row)
        del loaded, optimizer, rows, loss
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return stages


def _outside_allocator(device, idle_used_bytes: int | None, process_bytes: int | None) -> dict:
    """Device memory in use minus what the caching allocator holds (less the idle baseline)."""
    import torch

    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    used = total_bytes - free_bytes
    reserved = torch.cuda.memory_reserved(device)
    return {
        "device_used_bytes": used,
        "reserved_bytes": reserved,
        "context_bytes": used - reserved - (idle_used_bytes or 0),
        "process_used_bytes": process_bytes,
        "context_bytes_nvidia_smi": process_bytes - reserved if process_bytes is not None else None,
    }


def _block(nbytes: int) -> int:
    return max(512, (nbytes + 511) // 512 * 512)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--idle-used-bytes",
        type=int,
        default=None,
        help="device memory in use before this process started (nvidia-smi), subtracted from the context",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here (default: print it)")
    args = parser.parse_args()
    import warnings

    warnings.simplefilter("ignore")  # deprecation notices of the libraries say nothing about the figures
    result = measure(args.device, args.idle_used_bytes)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        print(f"wrote {args.out}")
    else:
        print(text)


if __name__ == "__main__":
    main()
