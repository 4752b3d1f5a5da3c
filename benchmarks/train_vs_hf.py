"""Peak memory and tokens/s of `memfit train` against Hugging Face `Trainer` + PEFT, same run.

Both sides train the same model configuration with the same data, tokenizer, LoRA settings,
precision, batch, sequence length, optimizer (fused AdamW), activation checkpointing and number of
optimizer steps; each in its own subprocess so that peak memory is the run's own:

- on CPU: peak resident memory of the process (``ru_maxrss``), and the resident memory right
  before training starts (what the model and data hold);
- on CUDA: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over the training loop.

Throughput is tokens (non-padding input tokens) per second over the training loop (first step to
last step), model loading excluded. TRL's SFTTrainer is run too when ``trl`` is installed.

    python benchmarks/train_vs_hf.py                       # CPU, the tiny demo model
    python benchmarks/train_vs_hf.py --device cuda --model llama-3.2-1b --init random --steps 30 \\
        --precision bf16 --batch-size 4 --seq-len 1024

Results go to benchmarks/results/train_vs_hf-<device>.json with the machine and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
DATA = REPO / "src" / "memfit" / "assets" / "data" / "tiny-instruct.jsonl"

#: The demo model of examples/tiny.yaml (used when --model is not given).
TINY_OVERRIDES = {
    "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 256, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512,
    "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
}


# ------------------------------------------------------------------------------------------------
# One side, run inside its own process


def _memory(device: str) -> dict:
    import resource

    import psutil
    import torch

    out = {
        "rss_bytes": psutil.Process().memory_info().rss,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if device.startswith("cuda"):
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    return out


def _settings(args) -> dict:
    overrides = dict(TINY_OVERRIDES) if args.model == "tiny" else {}
    return {
        "model": "smollm2-135m" if args.model == "tiny" else args.model,
        "init": "random",
        "model_overrides": overrides,
        "data": [str(DATA)],
        "method": "lora",
        "rank": args.rank,
        "alpha": 2 * args.rank,
        "targets": "all-linear",
        "precision": args.precision,
        "optimizer": "adamw",
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "grad_accum": args.grad_accum,
        "checkpointing": "on",
        "max_steps": args.steps,
        "lr": 1e-3,
        "schedule": "constant",
        "max_grad_norm": 1.0,
        "device": args.device,
        "seed": 0,
        "log_every": 1,
        "keep_checkpoints": 1,
    }


def run_memfit(args, out_dir: Path) -> dict:
    from memfit.train.config import validate_config
    from memfit.train.recipe import train

    settings = _settings(args) | {"output_dir": str(out_dir / "memfit")}
    config = validate_config(settings)
    result = train(config, progress=False)
    records = [json.loads(line) for line in (out_dir / "memfit" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    tokens = sum(r["tokens"] for r in steps)
    seconds = steps[-1]["elapsed_s"]
    return {
        "steps": result.step,
        "tokens": tokens,
        "loop_seconds": seconds,
        "tokens_per_second": tokens / seconds,
        "first_loss": steps[0]["loss"],
        "last_loss": steps[-1]["loss"],
        "trainable_params": result.setup["trainable_params"],
        **_memory(args.device),
    }


def run_hf(args, out_dir: Path, use_trl: bool = False) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from memfit.models.build import make_config
    from memfit.train.config import model_config_dict, tokenizer_path, validate_config
    from memfit.train.data import BatchIterator, collate, load_records, tokenize_records

    config = validate_config(_settings(args) | {"output_dir": str(out_dir / "hf")})
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path(config)))
    records, _ = load_records(config.data)
    examples = tokenize_records(records, tokenizer, seq_len=config.seq_len)
    # The exact micro-batches memfit trains on, in its order: padded shapes (and so memory and
    # speed) are then the same on both sides.
    batches = BatchIterator(examples, batch_size=config.batch_size, seed=config.seed)
    ordered = [example for _ in range(config.max_steps * config.grad_accum) for example in next(batches)]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[config.precision]
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(make_config(model_config_dict(config)), dtype=dtype, attn_implementation="sdpa")
    model = get_peft_model(model, LoraConfig(r=config.rank, lora_alpha=config.spec.lora_alpha, target_modules="all-linear", task_type="CAUSAL_LM"))
    counted = {"tokens": 0}
    pad_id = tokenizer.pad_token_id

    def collator(batch):
        return collate(batch, pad_token_id=pad_id)

    class CountingTrainer(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

        def compute_loss(self, model, inputs, *a, **kw):
            counted["tokens"] += int(inputs["attention_mask"].sum())
            return super().compute_loss(model, inputs, *a, **kw)

    timing = {}

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            timing["start"] = time.perf_counter()

        def on_train_end(self, *a, **kw):
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            timing["end"] = time.perf_counter()

    training_args = TrainingArguments(
        output_dir=str(out_dir / "hf"),
        per_device_train_batch_size=config.batch_size,
        gradient_accumulation_steps=config.grad_accum,
        max_steps=config.max_steps,
        learning_rate=config.lr,
        lr_scheduler_type="constant",
        max_grad_norm=config.max_grad_norm,
        optim="adamw_torch_fused",
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=config.precision == "bf16",
        fp16=config.precision == "fp16",
        use_cpu=args.device == "cpu",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        remove_unused_columns=False,
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
    )
    trainer_cls = CountingTrainer
    kwargs = {}
    if use_trl:
        from trl import SFTConfig, SFTTrainer  # noqa: F401  (optional)

        class CountingSFT(SFTTrainer):
            def _get_train_sampler(self, train_dataset=None):
                return torch.utils.data.SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

            def compute_loss(self, model, inputs, *a, **kw):
                counted["tokens"] += int(inputs["attention_mask"].sum())
                return super().compute_loss(model, inputs, *a, **kw)

        trainer_cls = CountingSFT
    trainer = trainer_cls(model=model, args=training_args, train_dataset=ordered, data_collator=collator, callbacks=[Clock()], **kwargs)
    before = _memory(args.device)
    trainer.train()
    seconds = timing["end"] - timing["start"]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {
        "steps": trainer.state.global_step,
        "tokens": counted["tokens"],
        "loop_seconds": seconds,
        "tokens_per_second": counted["tokens"] / seconds,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "rss_before_training_bytes": before["rss_bytes"],
        **_memory(args.device),
    }


# ------------------------------------------------------------------------------------------------
# The driver


def machine(device: str) -> dict:
    import psutil
    import torch
    import transformers

    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    try:
        import peft

        info["peft"] = peft.__version__
    except ImportError:  # pragma: no cover
        pass
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="tiny", help="catalog name, or 'tiny' for the demo model")
    parser.add_argument("--init", default="random", choices=["random"], help="weights (random only: nothing is downloaded)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--precision", default="fp32", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--repeats", type=int, default=1, help="runs per side (the median tokens/s is reported)")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads per run (0: torch's default); 1 keeps runs steady on a shared machine")
    parser.add_argument("--side", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--scratch", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="results file (default benchmarks/results/train_vs_hf-<device>.json)")
    args = parser.parse_args(argv)

    if args.side is not None:  # inside a child process: run one side, print its JSON
        import warnings

        warnings.simplefilter("ignore")
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        scratch = Path(args.scratch)
        runner = {"memfit": run_memfit, "hf-trainer": run_hf, "trl-sft": lambda a, d: run_hf(a, d, use_trl=True)}[args.side]
        print("RESULT " + json.dumps(runner(args, scratch)))
        return 0

    sides = ["memfit", "hf-trainer"]
    try:
        import trl  # noqa: F401

        sides.append("trl-sft")
    except ImportError:
        pass
    passthrough = []
    for key in ("device", "model", "init", "steps", "batch_size", "seq_len", "grad_accum", "rank", "precision", "repeats", "threads"):
        passthrough += ["--" + key.replace("_", "-"), str(getattr(args, key))]
    runs: dict[str, list] = {side: [] for side in sides}
    for repeat in range(args.repeats):
        for side in sides:
            with tempfile.TemporaryDirectory(prefix="memfit-bench-") as scratch:
                cmd = [sys.executable, __file__, *passthrough, "--side", side, "--scratch", scratch]
                env = dict(os.environ)
                if args.threads:
                    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
                if proc.returncode != 0 or not lines:
                    sys.stderr.write(proc.stderr[-4000:])
                    raise SystemExit(f"{side} failed (exit {proc.returncode})")
                result = json.loads(lines[-1][len("RESULT "):])
                runs[side].append(result)
                print(f"{side:10s} run {repeat + 1}: {result['tokens_per_second']:.0f} tokens/s, peak RSS {result['peak_rss_bytes'] / 2**20:.0f} MiB"
                      + (f", peak allocated {result['peak_allocated_bytes'] / 2**20:.0f} MiB" if "peak_allocated_bytes" in result else ""))

    def median(values):
        values = sorted(values)
        return values[len(values) // 2]

    summary = {}
    for side, results in runs.items():
        summary[side] = {
            "tokens_per_second_median": median([r["tokens_per_second"] for r in results]),
            "peak_rss_bytes_median": median([r["peak_rss_bytes"] for r in results]),
            **({"peak_allocated_bytes_median": median([r["peak_allocated_bytes"] for r in results])} if "peak_allocated_bytes" in results[0] else {}),
        }
    payload = {
        "benchmark": "memfit train vs Hugging Face Trainer + PEFT (LoRA, same configuration)",
        "command": "python benchmarks/train_vs_hf.py " + " ".join(passthrough),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(args.device),
        "configuration": {k: v for k, v in vars(args).items() if k not in ("side", "scratch", "out")},
        "summary": summary,
        "runs": runs,
        "notes": [
            "each side runs in a fresh subprocess; peak_rss_bytes is that process's ru_maxrss (imports included)",
            "tokens_per_second: non-padding input tokens over the training loop time, model loading excluded",
            "memfit: loop time from metrics.jsonl elapsed_s; HF: on_train_begin to on_train_end",
            "both sides train on the same micro-batches in the same order (HF Trainer gets memfit's order, unshuffled)",
            "on a CPU shared with other processes, multi-threaded runs have multi-second stalls in single steps "
            "(OpenMP threads waiting for a busy core); --threads 1 avoids them",
        ],
    }
    out = Path(args.out) if args.out else RESULTS / f"train_vs_hf-{args.device.split(':')[0]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
