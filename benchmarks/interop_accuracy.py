"""memfit's plans of other tools' configs against the GPU memory those tools' authors published.

Each case is a config of the tool, written here from the published run's settings (the tool's own
example at the commit the figure was published with, or the settings the publication lists), with
memfit's catalog name for the model (the same config.json; nothing is downloaded). It is planned
with ``memfit.plan`` (what ``memfit plan CONFIG`` runs) and compared with the published figure:

- ``measured``: a peak the publisher measured on the GPU ("takes up about 17 GB of VRAM");
- ``fits``: the publisher ran it on a card of that size (its peak is at most the card's memory);
- ``longest``: the longest sequence the publisher found to fit the card (its peak is the card's
  memory, give or take the next step they tried);
- ``estimate``: a figure the publisher marks as estimated (LLaMA-Factory's hardware table).

A published "GB" is read as GiB (nvidia-smi's MiB / 1024; an "80GB" A100 has 80 GiB).

    python benchmarks/interop_accuracy.py              # writes benchmarks/results/interop_accuracy.json
    python benchmarks/interop_accuracy.py --only 3     # the first three cases (a quick look)
    python benchmarks/interop_accuracy.py --doc        # docs/interop.md's table and figures, from the results file

The table in docs/interop.md is the ``interop-accuracy`` block of benchmarks/figures.py, and the
figures its text quotes carry references to this results file: ``figures.py`` checks both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "interop_accuracy.json"
DOC = Path(__file__).resolve().parents[1] / "docs" / "interop.md"
GIB = 2**30

AXOLOTL_README_2023 = (
    "https://github.com/axolotl-ai-cloud/axolotl/blob/15d3a654b/examples/llama-2/README.md",
    "The 7b variant fits on any 24GB VRAM GPU and will take up about 17 GB of VRAM during training if "
    "using qlora and 20 GB if using lora. On a RTX 4090 ...",
)
AXOLOTL_LLAMA3 = (
    "https://github.com/axolotl-ai-cloud/axolotl/blob/067b021/examples/llama-3/README.md",
    "[Full Fine Tune](./fft-8b.yaml) - Single GPU @ 48GB VRAM",
)
UNSLOTH = (
    "https://unsloth.ai/blog/llama3-3",
    "Llama 3.3 (70B) max. context length, Hugging Face+FA2: 48 GB OOM, 80 GB 6,916. Hugging Face + FA2 can only do "
    "28,000 [Llama 3.1 (8B)] on a 80GB GPU. We tested ... on a 80GB A100 and did 4bit QLoRA on all linear layers "
    "(Q, K, V, O, gate, up and down) with rank = 32 with a batch size of 1. We padded all sequences to a certain "
    "maximum sequence length.",
)
LLAMA_FACTORY = (
    "https://github.com/hiyouga/LLaMA-Factory/blob/ff6d4d1/README.md#hardware-requirement",
    "Hardware Requirement (* estimated): Full (bf16 or fp16) 32 bits 7B 120GB, 14B 240GB, 30B 600GB, 70B 1200GB; "
    "Full (pure_bf16) 16 bits 60GB 120GB 300GB 600GB; Freeze/LoRA/... 16 bits 16GB 32GB 64GB 160GB; QLoRA 8 bits "
    "10GB 20GB 40GB 80GB; QLoRA 4 bits 6GB 12GB 24GB 48GB; QLoRA 2 bits 4GB 8GB 16GB 24GB",
)

_AXOLOTL_LLAMA2 = """\
base_model: llama-2-7b          # NousResearch/Llama-2-7b-hf in the example
{quant}
adapter: {adapter}
sequence_len: 4096
sample_packing: true
pad_to_sequence_len: true
lora_r: 32
lora_alpha: 16
lora_dropout: 0.05
lora_target_linear: true
gradient_accumulation_steps: 4
micro_batch_size: 2
optimizer: {optimizer}
bf16: true
tf32: false
gradient_checkpointing: true
flash_attention: true
"""

_AXOLOTL_FFT_8B = """\
base_model: llama-3.1-8b        # NousResearch/Meta-Llama-3.1-8B in the example
sequence_len: 8192
sample_packing: true
gradient_accumulation_steps: 8
micro_batch_size: 1
optimizer: paged_adamw_8bit
bf16: auto
tf32: false
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: false
attn_implementation: flash_attention_2
"""

# Unsloth's Hugging Face + FA2 baseline as a TRL config: 4-bit QLoRA r=32 on every linear layer,
# micro-batch 1, sequences padded to the length tried, transformers' gradient checkpointing, the
# model's own loss (TRL 2024), 8-bit AdamW (Unsloth's notebooks'; the post does not say). Also
# published_runs.py's Unsloth cases.
UNSLOTH_HF = """\
model_name_or_path: {model}
dtype: bfloat16
attn_implementation: flash_attention_2
use_peft: true
load_in_4bit: true
lora_r: 32
lora_alpha: 32
lora_dropout: 0.0
lora_target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]
max_length: {tokens}
packing: false
loss_type: nll
per_device_train_batch_size: 1
gradient_accumulation_steps: 4
gradient_checkpointing: true
bf16: true
optim: adamw_8bit
"""

# The Axolotl of August 2023 kept PEFT's fp32 upcast of everything not quantized (it cast nothing
# back for LoRA), on transformers 4.31, whose loss returned fp32 logits.
AXOLOTL_2023 = {"kbit_upcast": True, "hf_loss": "model-4.45"}
_AXOLOTL_2023_NOTE = (
    "planned with --kbit-upcast and --hf-loss model-4.45, as the Axolotl and transformers of August 2023 ran it"
)

# TRL of 2024 ran QLoRA through PEFT's prepare_model_for_kbit_training (removed in TRL 0.22), with fp32 adapters (TRL casts them to bf16 since 0.26).
TRL_2024 = {"kbit_upcast": True, "adapter_dtype": "fp32"}
_TRL_2024_NOTE = (
    "planned with --kbit-upcast and fp32 adapters: the TRL of December 2024 prepared QLoRA with PEFT's "
    "prepare_model_for_kbit_training"
)

# LLaMA-Factory's table, with the settings of its example configs (micro-batch 1, bf16,
# checkpointing on by default) at 1,024 tokens: the table names no batch or length.
_LLAMA_FACTORY = """\
model_name_or_path: {model}
stage: sft
finetuning_type: {finetuning_type}
{extra}
cutoff_len: 1024
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
bf16: true
flash_attn: fa2
"""

_LF_MODELS = {"7B": "llama-2-7b", "14B": "qwen2.5-14b", "30B": "qwen2.5-32b", "70B": "llama-3.1-70b"}
_LF_FIGURES = {  # GB by method and size, as the table gives them
    "full (bf16)": ("full", "", (120, 240, 600, 1200)),
    "full (pure_bf16)": ("full", "pure_bf16: true", (60, 120, 300, 600)),
    "lora": ("lora", "lora_target: all", (16, 32, 64, 160)),
    "qlora 4-bit": ("lora", "lora_target: all\nquantization_bit: 4", (6, 12, 24, 48)),
}


def cases() -> list[dict]:
    """Every comparison: the tool's config text, the published figure, where it comes from."""
    out = [
        dict(
            id="axolotl llama-2-7b qlora (rtx 4090)",
            tool="axolotl",
            kind="measured",
            published_gib=17,
            source=AXOLOTL_README_2023,
            config=_AXOLOTL_LLAMA2.format(quant="load_in_4bit: true", adapter="qlora", optimizer="paged_adamw_32bit"),
            options=AXOLOTL_2023,
            note=_AXOLOTL_2023_NOTE,
        ),
        dict(
            id="axolotl llama-2-7b lora 8-bit (rtx 4090)",
            tool="axolotl",
            kind="measured",
            published_gib=20,
            source=AXOLOTL_README_2023,
            config=_AXOLOTL_LLAMA2.format(quant="load_in_8bit: true", adapter="lora", optimizer="adamw_bnb_8bit"),
            options=AXOLOTL_2023,
            note=_AXOLOTL_2023_NOTE,
        ),
        dict(
            id="axolotl llama-3.1-8b full fine-tuning (48 GB card)",
            tool="axolotl",
            kind="fits",
            published_gib=48,
            source=AXOLOTL_LLAMA3,
            config=_AXOLOTL_FFT_8B,
        ),
        dict(
            id="unsloth's hf+fa2 llama-3.3-70b qlora, longest on 80 GB (6,916 tokens)",
            tool="trl",
            kind="longest",
            published_gib=80,
            source=UNSLOTH,
            config=UNSLOTH_HF.format(model="llama-3.1-70b", tokens=6916),
            options=TRL_2024,
            note="Llama 3.3 70B has Llama 3.1 70B's shapes (the catalog's config); " + _TRL_2024_NOTE,
        ),
        dict(
            id="unsloth's hf+fa2 llama-3.1-8b qlora, longest on 80 GB (28,000 tokens)",
            tool="trl",
            kind="longest",
            published_gib=80,
            source=UNSLOTH,
            config=UNSLOTH_HF.format(model="llama-3.1-8b", tokens=28000),
            options=TRL_2024,
            note=_TRL_2024_NOTE,
        ),
    ]
    for method, (finetuning_type, extra, figures) in _LF_FIGURES.items():
        for (size, model), gib in zip(_LF_MODELS.items(), figures):
            out.append(
                dict(
                    id=f"llama-factory {size} {method}",
                    tool="llama-factory",
                    kind="estimate",
                    published_gib=gib,
                    source=LLAMA_FACTORY,
                    config=_LLAMA_FACTORY.format(model=model, finetuning_type=finetuning_type, extra=extra),
                    note=f"{size} planned as {model}",
                )
            )
    return out


def run_case(case: dict, folder: Path) -> dict:
    """Plan one case's config; the planned figures beside the published one."""
    import memfit

    name = "".join(c if c.isalnum() else "-" for c in case["id"])[:60] + (
        ".yml" if case["tool"] == "axolotl" else ".yaml"
    )
    path = folder / name
    path.write_text(case["config"])
    started = time.perf_counter()
    plan = memfit.plan(str(path), **case.get("options", {}))
    data = plan.to_dict()
    planned = data["peak"]["device_total_bytes"] / GIB
    config = data["details"]["config"]
    return {
        "id": case["id"],
        "tool": case["tool"],
        "kind": case["kind"],
        "source": case["source"][0],
        "quote": case["source"][1],
        "note": case.get("note"),
        "config": case["config"],
        "published_gib": case["published_gib"],
        "options": case.get("options", {}),
        "planned_gib": round(planned, 2),
        "planned_allocated_gib": round(data["peak"]["allocated_bytes"] / GIB, 2),
        "paged_gib": round((data["details"].get("paged_peak_bytes") or 0) / GIB, 2),
        "ratio": round(planned / case["published_gib"], 3),
        "spec": data["spec"],
        "not_modelled": [f"{f['key']}: {f['why']}" for f in config["not_modelled"]],
        "approximated": [f"{f['key']}: {f['why']}" for f in config["approximated"]],
        "plan_seconds": round(time.perf_counter() - started, 1),
    }


def summary(rows: list[dict]) -> dict:
    """Median |planned / published - 1| over all cases, and over the ones each kind and each
    modelling state leaves (a case with a not-modelled key plans something else than was run)."""

    def median_error(selected: list[dict]) -> float | None:
        return round(statistics.median(abs(r["ratio"] - 1) for r in selected), 3) if selected else None

    groups = {
        "all": ("all", rows),
        "published": ("measured, fits, longest (published runs)", [r for r in rows if r["kind"] != "estimate"]),
        "published_fully_modelled": (
            "published runs, fully modelled",
            [r for r in rows if r["kind"] != "estimate" and not r["not_modelled"]],
        ),
        "estimate": ("estimate (LLaMA-Factory's table)", [r for r in rows if r["kind"] == "estimate"]),
        "estimate_fully_modelled": (
            "estimate, fully modelled",
            [r for r in rows if r["kind"] == "estimate" and not r["not_modelled"]],
        ),
    }
    return {
        key: {"label": label, "cases": len(selected), "median_abs_error": median_error(selected)}
        for key, (label, selected) in groups.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", type=int, default=None, help="plan the first N cases only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--doc",
        action="store_true",
        help="rewrite docs/interop.md's table and figures from the results file, plan nothing",
    )
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    if args.doc:
        import figures

        problems = figures.write([DOC], figures.Results(root=args.out.parent))
        print(*problems, sep="\n")
        return 1 if problems else 0
    from _machine import describe_machine

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for case in cases()[: args.only]:
            row = run_case(case, Path(folder))
            print(
                f"{row['id']}: published {row['published_gib']} GiB, planned {row['planned_gib']} GiB "
                f"(x{row['ratio']}){' [not modelled: ' + str(len(row['not_modelled'])) + ']' if row['not_modelled'] else ''}",
                flush=True,
            )
            rows.append(row)
    result = {"machine": describe_machine(), "summary": summary(rows), "cases": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
