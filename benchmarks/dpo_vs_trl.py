"""DPO: `memfit train` against TRL's DPOTrainer + PEFT, measured on the CPU and planned on a 24 GB card.

Measured (``--part cpu``): both sides train DPO with LoRA on the same model (the demo model of
examples/dpo-tiny.yaml, random weights), the same pairs (the shipped tiny-preferences.jsonl, which
both tokenize to the same tokens: tests/step/test_preference_vs_trl.py), the same longest sequence
(``--seq-len``: memfit's seq_len, TRL's max_length), micro-batch of pairs, optimizer (fused AdamW),
learning rate, beta, sigmoid loss, activation checkpointing and number of steps, in the same order
(TRL gets memfit's order, unshuffled). Each side runs in a fresh process: its peak resident memory
(``ru_maxrss``, imports included), the resident memory right before training, and tokens per second
(every non-padding token of the chosen and rejected sequences, over the training loop). memfit runs
its own step: a micro-batch's pairs in one row without padding, the reference pass (adapters
disabled) before the policy's forward, the chunked log-probs; TRL 1.16 pads, runs the policy then the
reference, with its fused log-prob head.

Planned (``--part plan``): Llama-3.1-8B, QLoRA r=16, DPO, a micro-batch of one pair, an RTX 4090
(24 GB): memfit's recipe against the ``hf`` recipe (the plain stack's step: the policy's whole
``[2 x seq, vocab]`` logits, upcast to fp32 for the log-softmax, then the reference pass on top of
the activations the policy holds, as TRL's DPOTrainer ran before its fused head), at a few lengths,
and the longest sequence each fits (``memfit fit --objective dpo --max seq-len``).

    python benchmarks/dpo_vs_trl.py --part cpu     # writes benchmarks/results/dpo_vs_trl-cpu.json
    python benchmarks/dpo_vs_trl.py --part plan    # writes benchmarks/results/dpo_vs_trl-plan.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _memfit_api as api
from _machine import run_json_child
from train_vs_hf import TINY_OVERRIDES, _memory, machine, throughput_after_warmup

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PAIRS = REPO / "src" / "memfit" / "assets" / "data" / "tiny-preferences.jsonl"

MODEL = "llama-3.1-8b"
CARD = "rtx-4090"
PLAN_KNOBS = {"method": "qlora", "rank": 16, "objective": "dpo", "batch_size": 1}
PLAN_LENGTHS = (1024, 2048, 4096)
RECIPES = ("memfit", "hf")


# ------------------------------------------------------------------------------------------------
# Measured on the CPU: one side in its own process


def _settings(args) -> dict:
    return {
        "model": "smollm2-135m",
        "init": "random",
        "model_overrides": dict(TINY_OVERRIDES),
        "data": [str(PAIRS)],
        "objective": "dpo",
        "beta": args.beta,
        "loss_type": "sigmoid",
        "method": "lora",
        "rank": args.rank,
        "alpha": 2 * args.rank,
        "targets": "all-linear",
        "precision": "fp32",
        "optimizer": "adamw",
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "grad_accum": 1,
        "checkpointing": "on",
        "max_steps": args.steps,
        "lr": args.lr,
        "schedule": "constant",
        "max_grad_norm": 1.0,
        "device": "cpu",
        "seed": 0,
        "log_every": 1,
        "keep_checkpoints": 1,
    }


def run_memfit(args, scratch: Path) -> dict:
    config = api.train_config(_settings(args) | {"output_dir": str(scratch / "memfit")})
    result = api.train(config, progress=False)
    steps = [
        r
        for r in (json.loads(line) for line in (scratch / "memfit" / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    ]
    tokens, seconds = sum(r["tokens"] for r in steps), steps[-1]["elapsed_s"]
    return {
        "steps": result.step,
        "tokens": tokens,
        "loop_seconds": seconds,
        "tokens_per_second": tokens / seconds,
        "tokens_per_second_after_warmup": throughput_after_warmup(
            [r["tokens"] for r in steps], [r["elapsed_s"] for r in steps], args.warmup_steps
        ),
        "first_loss": steps[0]["loss"],
        "last_loss": steps[-1]["loss"],
        "last_rewards_accuracies": steps[-1]["rewards/accuracies"],
        "last_rewards_margins": steps[-1]["rewards/margins"],
        "trainable_params": result.setup["trainable_params"],
        **_memory("cpu"),
    }


def memfit_order(args, count: int) -> list[int]:
    """The order memfit's trainer draws the pairs in (its BatchIterator, same seed): TRL gets it too."""
    from memfit.train.data import BatchIterator

    order = BatchIterator(list(range(count)), batch_size=args.batch_size, seed=0)
    return [i for _ in range(args.steps) for i in next(order)]


def run_trl(args, scratch: Path) -> dict:
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    config = api.train_config(_settings(args) | {"output_dir": str(scratch / "trl")})
    tokenizer = AutoTokenizer.from_pretrained(str(api.train_tokenizer_path(config)))
    rows = [json.loads(line) for line in PAIRS.read_text().splitlines()]
    ordered = [rows[i] for i in memfit_order(args, len(rows))]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        api.make_hf_config(api.train_model_config(config)), dtype=torch.float32, attn_implementation="sdpa"
    )
    counted = {"tokens": 0}
    timing = {"step_ends": [], "step_tokens": []}

    class CountingDPO(DPOTrainer):
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(
                train_dataset if train_dataset is not None else self.train_dataset
            )

        def compute_loss(self, model, inputs, *a, **kw):
            counted["tokens"] += int(inputs["attention_mask"].sum())
            return super().compute_loss(model, inputs, *a, **kw)

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            timing["start"] = time.perf_counter()

        def on_step_end(self, *a, **kw):
            timing["step_ends"].append(time.perf_counter() - timing["start"])
            timing["step_tokens"].append(counted["tokens"] - sum(timing["step_tokens"]))

        def on_train_end(self, *a, **kw):
            timing["end"] = time.perf_counter()

    training_args = DPOConfig(
        output_dir=str(scratch / "trl"),
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        optim="adamw_torch_fused",
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=False,
        fp16=False,
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
        beta=args.beta,
        loss_type=["sigmoid"],
        max_length=args.seq_len,
    )
    trainer = CountingDPO(
        model=model,
        args=training_args,
        train_dataset=datasets.Dataset.from_list(ordered),
        processing_class=tokenizer,
        callbacks=[Clock()],
        peft_config=LoraConfig(
            r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM"
        ),
    )
    before = _memory("cpu")
    trainer.train()
    seconds = timing["end"] - timing["start"]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {
        "steps": trainer.state.global_step,
        "tokens": counted["tokens"],
        "loop_seconds": seconds,
        "tokens_per_second": counted["tokens"] / seconds,
        "tokens_per_second_after_warmup": throughput_after_warmup(
            timing["step_tokens"], timing["step_ends"], args.warmup_steps
        ),
        "first_loss": logs[0]["loss"] if logs else None,
        "last_loss": logs[-1]["loss"] if logs else None,
        "last_rewards_accuracies": logs[-1].get("rewards/accuracies") if logs else None,
        "last_rewards_margins": logs[-1].get("rewards/margins") if logs else None,
        "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "rss_before_training_bytes": before["rss_bytes"],
        **_memory("cpu"),
    }


SIDES = {"memfit": run_memfit, "trl-dpo": run_trl}
SIDE_OPTIONS = ("steps", "warmup_steps", "batch_size", "seq_len", "rank", "lr", "beta", "threads")


def run_side(side: str, args) -> dict:
    import os

    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    argv = [a for key in SIDE_OPTIONS for a in ("--" + key.replace("_", "-"), str(getattr(args, key)))]
    with tempfile.TemporaryDirectory(prefix="memfit-dpo-bench-") as scratch:
        result = run_json_child(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--part",
                "side",
                "--side",
                side,
                "--scratch",
                scratch,
                *argv,
            ],
            prefix="RESULT ",
            env=env,
        )
    return result if "status" in result else {"status": "ok", **result}


def measure_cpu(args) -> dict:
    runs = {side: [] for side in SIDES}
    for repeat in range(args.repeats):
        for side in SIDES:
            result = run_side(side, args)
            if result["status"] != "ok":
                raise SystemExit(f"{side} failed ({result['status']}): {result['error']}")
            runs[side].append(result)
            print(
                f"{side:8s} run {repeat + 1}: {result['tokens_per_second']:.0f} tokens/s, peak RSS "
                f"{result['peak_rss_bytes'] / 2**20:.0f} MiB, loss {result['first_loss']:.4f} -> {result['last_loss']:.4f}",
                flush=True,
            )

    def median(values):
        return sorted(values)[len(values) // 2]

    summary = {
        side: {
            "tokens_per_second_median": median([r["tokens_per_second"] for r in results]),
            "peak_rss_bytes_median": median([r["peak_rss_bytes"] for r in results]),
        }
        for side, results in runs.items()
    }
    argv = " ".join(f"--{key.replace('_', '-')} {getattr(args, key)}" for key in SIDE_OPTIONS + ("repeats",))
    return {
        "benchmark": "DPO with LoRA: memfit train against TRL DPOTrainer + PEFT (same model, pairs, lengths, batch), CPU",
        "command": f"python benchmarks/dpo_vs_trl.py --part cpu {argv}",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine("cpu"),
        "versions": {"trl": _version("trl"), "peft": _version("peft")},
        "summary": summary,
        "runs": runs,
        "notes": [
            "each side runs in a fresh subprocess; peak_rss_bytes is that process's ru_maxrss (imports included)",
            "tokens: the non-padding tokens of every chosen and rejected sequence, over the training loop (loading excluded)",
            "both sides take the pairs in memfit's order; TRL pads each micro-batch, memfit puts it in one row without padding",
            "memfit runs the reference pass (adapters disabled) before the policy's forward; TRL 1.16 after it",
        ],
    }


def _version(name: str) -> str | None:
    from _machine import library_version

    return library_version(name)


# ------------------------------------------------------------------------------------------------
# Planned on a 24 GB card


def plan_side_by_side(lengths=PLAN_LENGTHS) -> dict:
    rows = {}
    for recipe in RECIPES:
        started = time.perf_counter()
        peaks = {}
        for tokens in lengths:
            planned = api.plan(MODEL, gpu=CARD, seq_len=tokens, recipe=recipe, **PLAN_KNOBS)
            peaks[str(tokens)] = {
                "device_total_bytes": planned.device_total_bytes,
                "allocated_bytes": planned.allocated_bytes,
                "fits": planned.fits,
                "phase": planned.phase,
                "categories": planned.categories,
                "reference": planned.details.get("reference"),
            }
            print(
                f"{recipe}: {tokens} tokens: {planned.device_total_bytes / 2**30:.2f} GiB ({planned.phase})", flush=True
            )
        result = api.fit(
            MODEL,
            gpu=CARD,
            methods=("qlora",),
            batch_size=1,
            rank=PLAN_KNOBS["rank"],
            objective="dpo",
            recipe=recipe,
            workers=1,
        )
        rows[recipe] = {
            "command": f"memfit fit {MODEL} --gpu {CARD} --method qlora --rank 16 --objective dpo --batch-size 1 --max seq-len --recipe {recipe}",
            "max_seq_len": result.max_seq_len["qlora"],
            "settings_at_max": {
                k: v
                for k, v in (result.max_seq_len_specs.get("qlora") or {}).items()
                if k in ("checkpointing", "optimizer", "tiling")
            },
            "plans_made": result.plans_made,
            "peaks": peaks,
            "seconds": round(time.perf_counter() - started, 1),
        }
        print(
            f"{recipe}: longest {rows[recipe]['max_seq_len']} tokens a sequence ({rows[recipe]['settings_at_max']})",
            flush=True,
        )
    return {
        "benchmark": "Llama-3.1-8B QLoRA DPO on a 24 GB card: memfit's step against the plain stack's (planned)",
        "command": "python benchmarks/dpo_vs_trl.py --part plan",
        "planned_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "configuration": {"model": MODEL, "gpu": CARD, **PLAN_KNOBS, "precision": "bf16"},
        "recipes": rows,
        "summary": {
            "memfit_max_seq_len": rows["memfit"]["max_seq_len"],
            "hf_max_seq_len": rows["hf"]["max_seq_len"],
            **{
                f"peak_ratio_at_{n}": round(
                    rows["memfit"]["peaks"][str(n)]["device_total_bytes"]
                    / rows["hf"]["peaks"][str(n)]["device_total_bytes"],
                    3,
                )
                for n in lengths
            },
        },
        "notes": [
            "planned, not measured: no GPU was used",
            "a micro-batch is one pair: two sequences of seq_len tokens (chosen and rejected)",
            "hf recipe: PEFT's k-bit preparation, the policy's whole logits upcast to fp32 for the log-softmax, the "
            "reference pass (adapters disabled) after the policy's forward; TRL 1.16's DPOTrainer fuses its head in "
            "chunks of 4,096 tokens x 32,768 vocabulary entries instead, which this recipe does not model",
        ],
    }


def _write(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)
    print(f"wrote {path}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["cpu", "plan", "side"], default="cpu")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8, help="pairs per micro-batch")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads per run (1 keeps runs steady on a shared machine)"
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--side", choices=sorted(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part == "side":
        import warnings

        warnings.simplefilter("ignore")
        import torch

        torch.set_num_threads(args.threads or torch.get_num_threads())
        print("RESULT " + json.dumps(SIDES[args.side](args, Path(args.scratch))))
        return 0
    if args.part == "cpu":
        _write(RESULTS / "dpo_vs_trl-cpu.json", measure_cpu(args))
    else:
        _write(RESULTS / "dpo_vs_trl-plan.json", plan_side_by_side())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
