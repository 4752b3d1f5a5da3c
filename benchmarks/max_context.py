"""Longest context on a 24 GB card: memfit's training step next to the plain Hugging Face step.

The configuration: Llama-3.1-8B, QLoRA rank 32 on all linear layers, micro-batch 1, a 24 GB card
(RTX 4090). Two recipes of the same run:

- ``memfit``: memfit's step (fused chunked loss, its offloaded checkpointing with prefetch,
  sequence-tiled MLP);
- ``hf``: the plain Hugging Face + PEFT step (PEFT's ``prepare_model_for_kbit_training``, the
  model's own loss with ``labels=``, transformers' checkpointing and offload).

Planner part (any machine, no GPU)::

    python benchmarks/max_context.py              # writes benchmarks/results/max_context.json

runs ``memfit fit llama-3.1-8b --gpu rtx-4090 --method qlora --rank 32 --batch-size 1 --max seq-len``
for each recipe, and plans both at 8,192 tokens with the settings each search chose for its longest
sequence. Goals: memfit >= 100,000 tokens; memfit's peak at 8,192 tokens <= 0.35 x the hf recipe's.

GPU part (needs CUDA; a random-init 8B model, nothing downloaded)::

    python benchmarks/max_context.py --measure    # writes benchmarks/results/max_context-<gpu>.json
    python benchmarks/max_context.py --tiny --device cpu --out /tmp/x.json   # check the harness

caps the process at a 24 GB card's memory (``torch.cuda.set_per_process_memory_fraction``) and
finds, with real training steps, the longest context each recipe trains at (growing in 1,024-token
steps from the plan's answer and back), then tokens/s of both at a length both fit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import describe_machine  # noqa: E402

MODEL = "llama-3.1-8b"
CARD = "rtx-4090"
KNOBS = {"method": "qlora", "rank": 32}
RECIPES = ("memfit", "hf")
COMPARE_TOKENS = 8192
GOAL_TOKENS = 100_000
GOAL_RATIO = 0.35
RESULTS = Path(__file__).parent / "results"


def plan_side_by_side() -> dict:
    """The planner's answer for both recipes: longest sequence and the peak at COMPARE_TOKENS."""
    from memfit.planner.api import plan
    from memfit.planner.search import fit

    rows = {}
    for recipe in RECIPES:
        started = time.perf_counter()
        result = fit(MODEL, gpu=CARD, methods=("qlora",), batch_size=1, rank=KNOBS["rank"], recipe=recipe, workers=1)
        seconds = time.perf_counter() - started
        longest = result.max_seq_len["qlora"]
        chosen = dict(result.max_seq_len_specs.get("qlora") or {})
        # (the hf recipe has no tiling: the knob means nothing there)
        settings = {k: chosen[k] for k in ("checkpointing", "optimizer", "tiling") if k in chosen and (recipe == "memfit" or k != "tiling")}
        at_compare = plan(MODEL, gpu=CARD, batch_size=1, seq_len=COMPARE_TOKENS, recipe=recipe, **KNOBS, **settings)
        rows[recipe] = {
            "command": f"memfit fit {MODEL} --gpu {CARD} --method qlora --rank 32 --batch-size 1 --max seq-len --recipe {recipe}",
            "max_seq_len": longest,
            "settings_at_max": settings,
            "fit_seconds": round(seconds, 1),
            "plans_made": result.plans_made,
            f"peak_at_{COMPARE_TOKENS}": {
                "device_total_bytes": at_compare.device_total_bytes,
                "allocated_bytes": at_compare.allocated_bytes,
                "categories": at_compare.categories,
                "host_peak_bytes": at_compare.details.get("host_peak_bytes"),
            },
        }
        print(f"{recipe}: longest {longest} tokens ({settings}); at {COMPARE_TOKENS} tokens "
              f"{at_compare.device_total_bytes / 2**30:.2f} GiB  [{seconds:.0f} s, {result.plans_made} plans]")
    rows["hf-checkpointing-on"] = _hf_without_offload()
    memfit_peak = rows["memfit"][f"peak_at_{COMPARE_TOKENS}"]["device_total_bytes"]
    hf_peak = rows["hf"][f"peak_at_{COMPARE_TOKENS}"]["device_total_bytes"]
    ratio = memfit_peak / hf_peak
    summary = {
        "memfit_max_seq_len": rows["memfit"]["max_seq_len"],
        "hf_max_seq_len": rows["hf"]["max_seq_len"],
        "context_ratio": round(rows["memfit"]["max_seq_len"] / max(rows["hf"]["max_seq_len"], 1), 2),
        f"peak_ratio_at_{COMPARE_TOKENS}": round(ratio, 3),
        f"peak_ratio_at_{COMPARE_TOKENS}_vs_hf_checkpointing_on": round(
            memfit_peak / rows["hf-checkpointing-on"][f"peak_at_{COMPARE_TOKENS}"]["device_total_bytes"], 3),
        "hf_checkpointing_on_max_seq_len": rows["hf-checkpointing-on"]["max_seq_len"],
        "meets_token_goal": rows["memfit"]["max_seq_len"] >= GOAL_TOKENS,
        "meets_ratio_goal": ratio <= GOAL_RATIO,
    }
    print(json.dumps(summary, indent=2))
    return {"recipes": rows, "summary": summary}


def _hf_without_offload() -> dict:
    """The plain stack as most people run it: checkpointing on, no offload (bisection on plans)."""
    from memfit.planner.api import plan

    def fits(tokens: int):
        return plan(MODEL, gpu=CARD, batch_size=1, seq_len=tokens, recipe="hf", checkpointing="on", **KNOBS)

    step = 128
    lo, hi = 1, 131072 // step  # in steps of 128 tokens; lo fits (checked below), hi is an upper bound
    plans = 0
    started = time.perf_counter()
    if not fits(lo * step).fits:
        lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        plans += 1
        if fits(mid * step).fits:
            lo = mid
        else:
            hi = mid
    at_compare = fits(COMPARE_TOKENS)
    print(f"hf, checkpointing on (no offload): longest {lo * step} tokens; at {COMPARE_TOKENS} tokens "
          f"{at_compare.device_total_bytes / 2**30:.2f} GiB  [{time.perf_counter() - started:.0f} s, {plans + 2} plans]")
    return {
        "command": f"memfit plan {MODEL} --gpu {CARD} --method qlora --rank 32 --batch-size 1 --recipe hf --checkpointing on "
                   "--seq-len N (bisection over N, 128-token steps)",
        "max_seq_len": lo * step,
        "settings_at_max": {"checkpointing": "on", "optimizer": "adamw"},
        f"peak_at_{COMPARE_TOKENS}": {
            "device_total_bytes": at_compare.device_total_bytes,
            "allocated_bytes": at_compare.allocated_bytes,
            "categories": at_compare.categories,
            "host_peak_bytes": at_compare.details.get("host_peak_bytes"),
        },
    }


def measure_recipe(recipe: str, lengths: list[int], cap_bytes: int | None, compare_tokens: int, steps: int = 2,
                   model: str | dict = MODEL, device_name: str = "cuda", checkpointing: str = "offload") -> dict:
    """Real training steps for each length (longer ones stop at the first OOM), and tokens/s at ``compare_tokens``.

    On CUDA the process is capped at ``cap_bytes`` (a smaller card's memory). ``device_name="cpu"``
    runs the same loop without a cap (the harness check: ``--tiny``).
    """
    import torch

    from memfit.models.catalog import resolve_model
    from memfit.spec import make_spec
    from memfit.step.builder import build_step
    from memfit.step.optim import build_optimizer
    from memfit.train.loading import load_model

    device = torch.device(device_name)
    cuda = device.type == "cuda"
    if cuda and cap_bytes is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), device)
    spec = make_spec(batch_size=1, seq_len=max(lengths + [compare_tokens]), recipe=recipe, checkpointing=checkpointing, **KNOBS)
    loaded = load_model(resolve_model(model).config, spec, device, init="random", seed=0)
    optimizer = build_optimizer(loaded.model.parameters(), spec.optimizer)
    step = build_step(spec)
    vocab = int(loaded.config.vocab_size)
    results, longest, speed = [], 0, None
    for tokens in sorted(set(lengths + [compare_tokens])):
        ids = torch.randint(0, vocab, (1, tokens), device=device)
        batch = {"input_ids": ids, "labels": ids.clone()}
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            step(loaded.model, [batch], optimizer)  # warm-up
            if cuda:
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            for _ in range(steps):
                loss, _ = step(loaded.model, [batch], optimizer)
            float(loss)
            seconds = (time.perf_counter() - started) / steps
        except torch.OutOfMemoryError:
            optimizer.zero_grad(set_to_none=True)
            results.append({"tokens": tokens, "status": "oom"})
            if tokens > compare_tokens:
                break
            continue
        row = {"tokens": tokens, "status": "ok", "step_seconds": round(seconds, 3), "tokens_per_second": round(tokens / seconds, 1)}
        if cuda:
            row.update(max_allocated_bytes=torch.cuda.max_memory_allocated(device), max_reserved_bytes=torch.cuda.max_memory_reserved(device))
        results.append(row)
        longest = max(longest, tokens)
        if tokens == compare_tokens:
            speed = row["tokens_per_second"]
        print(recipe, row, flush=True)
    return {"recipe": recipe, "runs": results, "longest_measured": longest, f"tokens_per_second_at_{compare_tokens}": speed}


#: A tiny untied Llama for the harness check (``--tiny --device cpu``): every code path, in seconds.
TINY_MODEL = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure", action="store_true", help="real runs on the CUDA GPU (needs one)")
    parser.add_argument("--recipe", choices=RECIPES, help="--measure one recipe only (each recipe in its own process is cleanest)")
    parser.add_argument("--compare-tokens", type=int, default=4096, help="--measure: length for the tokens/s comparison")
    parser.add_argument("--tiny", action="store_true", help="--measure a tiny model (check the harness, e.g. with --device cpu)")
    parser.add_argument("--device", default="cuda", help="--measure on this device (cuda; cpu only with --tiny)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.tiny:
        # transformers' offload pins host memory, which needs an accelerator: on a CPU the hf recipe
        # runs with plain checkpointing (memfit's offload runs there synchronously).
        runs = [measure_recipe(recipe, [256, 512], None, 512, steps=1, model=TINY_MODEL, device_name=args.device,
                               checkpointing="on" if recipe == "hf" and args.device == "cpu" else "offload")
                for recipe in ([args.recipe] if args.recipe else RECIPES)]
        out = {"benchmark": "max_context (harness check)", "command": "python benchmarks/max_context.py --tiny", "runs": runs}
        path = args.out or RESULTS / "max_context-tiny.json"
    elif not args.measure:
        out = {"benchmark": "max_context", "command": "python benchmarks/max_context.py", "machine": describe_machine(),
               "model": MODEL, "card": CARD, "knobs": dict(KNOBS, batch_size=1),
               "goals": {"memfit_min_tokens": GOAL_TOKENS, f"max_peak_ratio_at_{COMPARE_TOKENS}": GOAL_RATIO},
               **plan_side_by_side()}
        path = args.out or RESULTS / "max_context.json"
    else:
        import torch

        if not torch.cuda.is_available() or args.device != "cuda":
            parser.error("--measure needs a CUDA GPU (check the harness on a CPU with --tiny --device cpu)")
        from memfit.models.gpus import get_gpu

        cap = get_gpu(CARD).memory_bytes
        planned = json.loads((RESULTS / "max_context.json").read_text())["recipes"] if (RESULTS / "max_context.json").exists() else {}
        runs = []
        for recipe in ([args.recipe] if args.recipe else RECIPES):
            guess = int(planned.get(recipe, {}).get("max_seq_len") or 8192)
            lengths = [max(1024, guess + k * 1024) for k in range(-4, 5)]
            runs.append(measure_recipe(recipe, lengths, cap, args.compare_tokens))
        out = {"benchmark": "max_context (measured)", "command": "python benchmarks/max_context.py --measure", "machine": describe_machine(),
               "model": MODEL, "memory_cap_bytes": cap, "runs": runs}
        path = args.out or RESULTS / f"max_context-{torch.cuda.get_device_name(0).replace(' ', '-').lower()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
