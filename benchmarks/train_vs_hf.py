"""Peak memory and tokens/s of `memfit train` against Hugging Face `Trainer` + PEFT, same run.

Both sides train the same model configuration with the same data, tokenizer, LoRA settings,
precision, batch, sequence length, optimizer (fused AdamW), activation checkpointing and number of
optimizer steps; each in its own subprocess so that peak memory is the run's own:

- on CPU: peak resident memory of the process (``ru_maxrss``), and the resident memory right
  before training starts (what the model and data hold);
- on CUDA: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over the training loop.

Throughput is tokens (non-padding input tokens) per second over the training loop (first step to
last step), model loading excluded; ``after_warmup`` figures leave out the first ``--warmup-steps``
steps (kernel selection, allocator growth). TRL's SFTTrainer is run too when ``trl`` is installed.

``--data synthetic`` trains on generated text rows of exactly ``--seq-len`` tokens (no padding), for
long-sequence runs, and ``--data FILE`` on a training file of one's own; ``--init pretrained`` with
``--model FOLDER`` trains a model folder's weights (the Hugging Face side loads it with
``from_pretrained``; benchmarks/real_model.py does so for SmolLM2-135M-Instruct); ``--method qlora`` builds the Hugging Face side's 4-bit model with memfit's
random-init loader prepared the plain way (PEFT's ``prepare_model_for_kbit_training`` and
``get_peft_model``, ``--recipe hf``), as ``from_pretrained`` with a BitsAndBytesConfig would need a
checkpoint on disk; loading is not measured.

    python benchmarks/train_vs_hf.py                       # CPU, the tiny demo model
    python benchmarks/train_vs_hf.py --device cuda --model llama-3.1-8b --init random --steps 6 \\
        --precision bf16 --batch-size 1 --seq-len 8192 --method qlora --data synthetic

Results go to benchmarks/results/train_vs_hf-<device>.json with the machine and the command.
``benchmarks/gpu_campaign.py`` runs the sides through :func:`run_side_in_subprocess`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _memfit_api as api
from _machine import describe_in_subprocess, run_json_child

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
DATA = REPO / "src" / "memfit" / "assets" / "data" / "tiny-instruct.jsonl"

#: The demo model of examples/tiny.yaml (used when --model is not given).
TINY_OVERRIDES = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
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
        from _machine import process_gpu_bytes

        free_bytes, total_bytes = torch.cuda.mem_get_info()
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        out["device_used_end_bytes"] = total_bytes - free_bytes
        out["process_used_bytes"] = process_gpu_bytes()
    return out


#: Made-up words for --data synthetic: every one is several tokens of the shipped tokenizer.
def synthetic_data(path: Path, seq_len: int, rows: int, seed: int = 0) -> Path:
    """A JSONL file of ``rows`` plain-text records, each longer than ``seq_len`` tokens (the trainer
    cuts it to exactly ``seq_len``): long rows without padding, for speed at a given length."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9))) for _ in range(512)]
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(seq_len))}) + "\n")
    return path


def throughput_after_warmup(step_tokens: list[int], step_end_seconds: list[float], warmup_steps: int) -> float | None:
    """Tokens per second over the steps after the first ``warmup_steps`` (end times since the loop began)."""
    if len(step_tokens) <= warmup_steps or warmup_steps < 1:
        return None
    seconds = step_end_seconds[-1] - step_end_seconds[warmup_steps - 1]
    return sum(step_tokens[warmup_steps:]) / seconds if seconds > 0 else None


def _settings(args, scratch: Path | None = None) -> dict:
    overrides = dict(TINY_OVERRIDES) if args.model == "tiny" else {}
    data = DATA if args.data == "demo" else Path(args.data)
    if args.data == "synthetic":
        # One row per sequence the run trains on, plus a spare: every row is used once.
        data = synthetic_data(
            scratch / "synthetic.jsonl", args.seq_len, args.steps * args.batch_size * args.grad_accum + 1
        )
    return {
        "model": "smollm2-135m" if args.model == "tiny" else args.model,
        "init": args.init,
        "model_overrides": overrides,
        "data": [str(data)],
        "method": args.method,
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
        "lr": args.lr,
        "schedule": "constant",
        "max_grad_norm": 1.0,
        "device": args.device,
        "seed": 0,
        "log_every": 1,
        "keep_checkpoints": 1,
    }


def run_memfit(args, out_dir: Path) -> dict:
    settings = _settings(args, out_dir) | {"output_dir": str(out_dir / "memfit")}
    config = api.train_config(settings)
    result = api.train(config, progress=False)
    records = [json.loads(line) for line in (out_dir / "memfit" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    tokens = sum(r["tokens"] for r in steps)
    seconds = steps[-1]["elapsed_s"]
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
        "trainable_params": result.setup["trainable_params"],
        **_memory(args.device),
    }


def run_hf(args, out_dir: Path, use_trl: bool = False) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    config = api.train_config(_settings(args, out_dir) | {"output_dir": str(out_dir / "hf")})
    tokenizer = AutoTokenizer.from_pretrained(str(api.train_tokenizer_path(config)))
    # The exact micro-batches memfit trains on, in its order: padded shapes (and so memory and
    # speed) are then the same on both sides.
    _, batches = api.training_batches(config, tokenizer)
    ordered = [example for _ in range(config.max_steps * config.grad_accum) for example in next(batches)]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[config.precision]
    torch.manual_seed(0)
    if config.init == "pretrained":
        model = AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype, attn_implementation="sdpa").to(
            args.device
        )
        model = get_peft_model(
            model,
            LoraConfig(
                r=config.rank, lora_alpha=config.spec.lora_alpha, target_modules="all-linear", task_type="CAUSAL_LM"
            ),
        )
    elif config.method == "qlora":
        # 4-bit weights need a checkpoint for from_pretrained; memfit's loader quantizes random
        # weights on the device the same way, and --recipe hf prepares the model as PEFT does.
        spec = api.make_spec(**(config.knobs() | {"recipe": "hf"}))
        model = api.load_model(
            api.train_model_config(config), spec, api.resolve_device(args.device), init="random", seed=0
        ).model
    else:
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(
                api.make_hf_config(api.train_model_config(config)), dtype=dtype, attn_implementation="sdpa"
            )
        model = get_peft_model(
            model,
            LoraConfig(
                r=config.rank, lora_alpha=config.spec.lora_alpha, target_modules="all-linear", task_type="CAUSAL_LM"
            ),
        )
    counted = {"tokens": 0}
    pad_id = tokenizer.pad_token_id

    def collator(batch):
        return api.collate(batch, pad_token_id=pad_id)

    class CountingTrainer(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(
                train_dataset if train_dataset is not None else self.train_dataset
            )

        def compute_loss(self, model, inputs, *a, **kw):
            # Rows without padding come without a mask: every token counts.
            mask = inputs.get("attention_mask")
            counted["tokens"] += int(mask.sum()) if mask is not None else inputs["input_ids"].numel()
            return super().compute_loss(model, inputs, *a, **kw)

    timing = {"step_ends": [], "step_tokens": []}

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
                # memfit's loop starts its peak here too: loading is not part of the comparison.
                torch.cuda.reset_peak_memory_stats()
            timing["start"] = time.perf_counter()

        def on_step_end(self, *a, **kw):
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            timing["step_ends"].append(time.perf_counter() - timing["start"])
            timing["step_tokens"].append(counted["tokens"] - sum(timing["step_tokens"]))

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
                return torch.utils.data.SequentialSampler(
                    train_dataset if train_dataset is not None else self.train_dataset
                )

            def compute_loss(self, model, inputs, *a, **kw):
                # Rows without padding come without a mask: every token counts.
                mask = inputs.get("attention_mask")
                counted["tokens"] += int(mask.sum()) if mask is not None else inputs["input_ids"].numel()
                return super().compute_loss(model, inputs, *a, **kw)

        trainer_cls = CountingSFT
    trainer = trainer_cls(
        model=model, args=training_args, train_dataset=ordered, data_collator=collator, callbacks=[Clock()], **kwargs
    )
    before = _memory(args.device)
    trainer.train()
    seconds = timing["end"] - timing["start"]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {
        "steps": trainer.state.global_step,
        "tokens": counted["tokens"],
        "loop_seconds": seconds,
        "tokens_per_second": counted["tokens"] / seconds,
        "tokens_per_second_after_warmup": throughput_after_warmup(
            timing["step_tokens"], timing["step_ends"], args.warmup_steps
        ),
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


#: The options a side's process takes (the driver passes them through).
SIDE_OPTIONS = (
    "device",
    "model",
    "init",
    "method",
    "data",
    "steps",
    "warmup_steps",
    "batch_size",
    "seq_len",
    "grad_accum",
    "rank",
    "precision",
    "lr",
    "threads",
)
SIDES = ("memfit", "hf-trainer", "trl-sft")


def side_arguments(options: dict) -> list[str]:
    """Command-line arguments for a side's process, from option values keyed as in SIDE_OPTIONS."""
    argv = []
    for key in SIDE_OPTIONS:
        if key in options:
            argv += ["--" + key.replace("_", "-"), str(options[key])]
    return argv


def run_side_in_subprocess(
    side: str, options: dict, *, timeout_s: float | None = None, env: dict | None = None, keep_in: Path | None = None
) -> dict:
    """One side in a fresh process (its own peak memory), in a scratch folder removed afterwards
    (or in ``keep_in``, kept: memfit's run folder is then ``keep_in / "memfit"``).

    Returns the side's result, or ``{"status": "error" | "timeout", "error": ...}``; never raises.
    """
    env = dict(os.environ if env is None else env)
    if options.get("threads"):
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(options["threads"])

    def run(scratch: str) -> dict:
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            *side_arguments(options),
            "--side",
            side,
            "--scratch",
            scratch,
        ]
        return run_json_child(cmd, prefix="RESULT ", timeout_s=timeout_s, env=env)

    if keep_in is not None:
        Path(keep_in).mkdir(parents=True, exist_ok=True)
        result = run(str(keep_in))
    else:
        with tempfile.TemporaryDirectory(prefix="memfit-bench-") as scratch:
            result = run(scratch)
    return result if "status" in result else {"status": "ok", **result}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="tiny", help="catalog name, or 'tiny' for the demo model")
    parser.add_argument(
        "--init",
        default="random",
        choices=["random", "pretrained"],
        help="random: nothing is downloaded; pretrained: --model is a model folder whose weights are trained",
    )
    parser.add_argument("--method", default="lora", choices=["lora", "qlora"])
    parser.add_argument(
        "--data",
        default="demo",
        help="demo: the shipped tiny-instruct data; synthetic: generated rows of exactly --seq-len tokens; or a training file",
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup-steps", type=int, default=1, help="steps left out of the after-warm-up tokens/s")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--precision", default="fp32", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate (constant), both sides")
    parser.add_argument("--repeats", type=int, default=1, help="runs per side (the median tokens/s is reported)")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads per run (0: torch's default); 1 keeps runs steady on a shared machine",
    )
    parser.add_argument("--side", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--scratch", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--out", default=None, help="results file (default benchmarks/results/train_vs_hf-<device>.json)"
    )
    args = parser.parse_args(argv)
    if args.method == "qlora" and args.precision == "fp32":
        parser.error(
            "--method qlora: --precision fp32 cannot be used (4-bit weights are dequantized to 16 bits); use --precision bf16"
        )
    if args.warmup_steps >= args.steps:
        parser.error(f"--warmup-steps {args.warmup_steps}: must be below --steps ({args.steps}) to leave steps to time")

    if args.side is not None:  # inside a child process: run one side, print its JSON
        import warnings

        warnings.simplefilter("ignore")
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        scratch = Path(args.scratch)
        runner = {"memfit": run_memfit, "hf-trainer": run_hf, "trl-sft": lambda a, d: run_hf(a, d, use_trl=True)}[
            args.side
        ]
        print("RESULT " + json.dumps(runner(args, scratch)))
        return 0

    sides = ["memfit", "hf-trainer"]
    try:
        import trl  # noqa: F401

        sides.append("trl-sft")
    except ImportError:
        pass
    options = {key: getattr(args, key) for key in SIDE_OPTIONS}
    runs: dict[str, list] = {side: [] for side in sides}
    for repeat in range(args.repeats):
        for side in sides:
            result = run_side_in_subprocess(side, options)
            if result["status"] != "ok":
                sys.stderr.write(result["error"] + "\n")
                raise SystemExit(f"{side} failed ({result['status']})")
            runs[side].append(result)
            print(
                f"{side:10s} run {repeat + 1}: {result['tokens_per_second']:.0f} tokens/s, peak RSS {result['peak_rss_bytes'] / 2**20:.0f} MiB"
                + (
                    f", peak allocated {result['peak_allocated_bytes'] / 2**20:.0f} MiB"
                    if "peak_allocated_bytes" in result
                    else ""
                )
            )

    def median(values):
        values = sorted(values)
        return values[len(values) // 2]

    summary = {}
    for side, results in runs.items():
        summary[side] = {
            "tokens_per_second_median": median([r["tokens_per_second"] for r in results]),
            "tokens_per_second_after_warmup_median": median(
                [r["tokens_per_second_after_warmup"] or 0.0 for r in results]
            ),
            "peak_rss_bytes_median": median([r["peak_rss_bytes"] for r in results]),
            **(
                {"peak_allocated_bytes_median": median([r["peak_allocated_bytes"] for r in results])}
                if "peak_allocated_bytes" in results[0]
                else {}
            ),
        }
    payload = {
        "benchmark": f"memfit train vs Hugging Face Trainer + PEFT ({'QLoRA' if args.method == 'qlora' else 'LoRA'}, same configuration)",
        "command": "python benchmarks/train_vs_hf.py "
        + " ".join(side_arguments(options) + ["--repeats", str(args.repeats)]),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        # On a GPU the machine is described in a child: a CUDA context here would sit beside the runs.
        "machine": describe_in_subprocess() if args.device.startswith("cuda") else machine(args.device),
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
