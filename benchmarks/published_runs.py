"""memfit's plans against the GPU memory other people published for their own fine-tuning runs.

Each case is one published measurement of a real run, with where it was published (repository,
path, commit), the tool that ran it, the configuration as it was run, the versions where the
publication names them, and the counter it reports, compared like for like:

- ``reserved``: ``torch.cuda.max_memory_reserved`` (ms-swift logs it as ``memory(GiB)``), compared
  with the plan's peak reserved;
- ``allocated``: ``torch.cuda.max_memory_allocated`` or the allocator's peak active bytes
  (torchtune's "Peak Memory Active"), compared with the plan's peak allocated;
- ``card``: the longest run that fits a card of that size (its peak is the card's memory, give or
  take the next step the publisher tried), compared with the plan's device total;
- ``nvidia-smi``: memory in use as nvidia-smi shows it, compared with the plan's device total.

A published "GB" is read as GiB (nvidia-smi's MiB / 1024). What the publication leaves open is
planned as the case's ``assumed`` entries say; a key of the run memfit cannot plan is named in
``unplannable``. Nothing here is tuned to these figures: every case is planned with
``memfit.plan`` as any user's config would be.

    python benchmarks/published_runs.py             # writes benchmarks/results/published_runs.json
    python benchmarks/published_runs.py --only 3    # the first three cases (a quick look)
    python benchmarks/published_runs.py --list      # the cases, planned nothing
    python benchmarks/published_runs.py --case torchtune --out /tmp/t.json   # the cases whose id holds "torchtune"

The summary (cases, tools, median and p95 of |planned / published - 1|, the worst case under its
measurement) is the ``published-runs`` block of README.md and docs/plan.md (benchmarks/figures.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

# The same TRL config of Unsloth's baseline, and the versions of their time both benchmarks plan runs with.
from interop_accuracy import AXOLOTL_2023, TRL_2024, UNSLOTH_HF

RESULTS = Path(__file__).parent / "results" / "published_runs.json"
GIB = 2**30

# --- sources -------------------------------------------------------------------------------------

UNSLOTH_README = {
    "repository": "unslothai/unsloth",
    "path": "README.md",
    "commit": "e3162dc5bf",
    "quote": "We tested Llama 3.1 (8B) Instruct and did 4bit QLoRA on all linear layers (Q, K, V, O, gate, up and "
    "down) with rank = 32 with a batch size of 1. We padded all sequences to a certain maximum sequence "
    "length ... | GPU VRAM | Unsloth context length | Hugging Face + FA2 |",
}
# The README's figures were written with the examples' configs of the same commit (August 2023).
AXOLOTL_LLAMA2 = {
    "repository": "axolotl-ai-cloud/axolotl",
    "path": "examples/llama-2/README.md",
    "commit": "dc71d8872",
    "quote": "The 7b variant fits on any 24GB VRAM GPU and will take up about 17 GB of VRAM during training if "
    "using qlora and 20 GB if using lora.",
}
AXOLOTL_LLAMA3 = {
    "repository": "axolotl-ai-cloud/axolotl",
    "path": "examples/llama-3/README.md",
    "commit": "15f7910d3",
    "quote": "[Full Fine Tune](./fft-8b.yaml) - Single GPU @ 48GB VRAM",
}
TORCHTUNE_FLAGS = {
    "repository": "pytorch/torchtune",
    "path": "README.md",
    "commit": "1814feb17",
    "quote": "Baseline uses Recipe=full_finetune_single_device, Model=Llama 3.2 3B, Batch size=2, Max sequence "
    "length=4096, Precision=bf16, Hardware=A100 | + Packed Dataset | 60.0 (Peak Memory Active, GiB)",
}
SWIFT_BENCHMARK = {
    "repository": "modelscope/ms-swift",
    "path": "docs/source_en/LLM/Benchmark.md",
    "commit": "cdb169b78",
    "quote": "A100, CUDA 11.8, torch 2.1.1, flash_attn 2.3.4 ... --max_length 2048 --batch_size 1 "
    "--gradient_checkpointing true --use_flash_attn true --lora_rank 8 --lora_target_modules DEFAULT ... "
    "Model Type & Max Length, LoRA: GPU Memory (GiB)",
}


PEFT_DEEPSPEED = {
    "repository": "huggingface/peft",
    "path": "docs/source/accelerate/deepspeed.md",
    "commit": "6008f272a",
    "quote": "QLoRA and DeepSpeed Stage-3 for finetuning 70B llama model on 2X40GB GPUs ... the memory consumed "
    "per GPU is **36.6 GB**",
}
PEFT_DEEPSPEED_LORA = {
    "repository": "huggingface/peft",
    "path": "docs/source/accelerate/deepspeed.md",
    "commit": "aa2ca83ca",
    "quote": "SFT of Llama-70B model with LoRA and ZeRO-3 on 8xH100 80GB GPUs ... the memory consumed per "
    "GPU is 64 GB (80%) as seen in the screenshot below",
}
PEFT_FSDP = {
    "repository": "huggingface/peft",
    "path": "docs/source/accelerate/fsdp.md",
    "commit": "6008f272a",
    "quote": "QLoRA and FSDP for finetuning 70B llama model on 2X24GB GPUs ... the memory consumed per GPU is "
    "**19.6 GB** while CPU RAM usage is around **107 GB**. When disabling CPU offloading, the GPU memory "
    "usage is **35.6 GB/ GPU**",
}


def swift_example(path: str, quote: str) -> dict:
    return {"repository": "modelscope/ms-swift", "path": path, "commit": "3602360a5", "quote": quote}


# --- configurations ------------------------------------------------------------------------------

# The DeepSpeed configs the ZeRO cases ran. ms-swift's own (swift/llm/ds_config/zero2.json and
# zero3.json: "auto" buckets, filled by transformers from the hidden size); PEFT's guides start
# DeepSpeed through accelerate's plugin without a file (zero_stage 3, nothing offloaded), which
# leaves every bucket at DeepSpeed's defaults.
SWIFT_ZERO2 = {
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "none", "pin_memory": True},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
}
SWIFT_ZERO3 = {
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "none", "pin_memory": True},
        "offload_param": {"device": "none", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}
ACCELERATE_ZERO3 = {
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "none"},
        "offload_param": {"device": "none"},
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}

# Unsloth's Hugging Face + FA2 baseline as TRL ran it in 2024 (UNSLOTH_HF): what its post leaves open.
_UNSLOTH_ASSUMED = [
    "optim: the post names no optimizer; Unsloth's notebooks' 8-bit AdamW (adamw_8bit)",
    "kbit_upcast: the TRL of 2024 (before 0.22) ran QLoRA through PEFT's prepare_model_for_kbit_training (fp32 "
    "non-4-bit parameters, fp32 adapters); given a PEFT config, its SFTTrainer then cast the embeddings and head "
    "back to bf16, which a model prepared before SFTTrainer is not. The baseline's script is not published: "
    "planned in fp32 (with bf16 embeddings and head the plans of these rows would be lower)",
    "loss: the transformers version is not published: planned with the loss of 4.50 and later (the model's own); "
    "that of 4.45 and before (hf_loss: model-4.45), whose shifted fp32 logits change the allocator's reserve at "
    "these lengths, plans the rows from 16 to 48 GB higher",
]

_AXOLOTL_LLAMA2 = """\
base_model: llama-2-7b          # NousResearch/Llama-2-7b-hf in the example
{quant}
adapter: {adapter}
sequence_len: 4096
sample_packing: true            # max_packed_sequence_len: 4096 in the example (see assumed)
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
xformers_attention: true
"""
_AXOLOTL_LLAMA2_ASSUMED = [
    "packing: the example's max_packed_sequence_len: 4096 (the axolotl of August 2023) concatenates "
    "examples into rows of 4096 tokens: planned as sample_packing with pad_to_sequence_len",
    "gradient_checkpointing: the transformers of August 2023 (4.31) had no checkpoint arguments and ran torch's "
    "default, reentrant (use_reentrant: on, as the Axolotl rule reads gradient_checkpointing: true without "
    "gradient_checkpointing_kwargs)",
    "loss: transformers 4.31's, fp32 logits returned and a shifted fp32 copy (hf_loss: model-4.45)",
    "kbit_upcast: the Axolotl of August 2023 ran PEFT's prepare_model_for_kbit_training for QLoRA and 8-bit LoRA "
    "(every parameter that is not quantized in fp32) and cast nothing back for LoRA (src/axolotl/utils/models.py "
    "at dc71d8872: only its llama-adapter path cast norms, embeddings and head to 16 bits, under flash "
    "attention): kbit_upcast on, where today's Axolotl casts them back (the rule's off)",
]

_AXOLOTL_FFT_8B = """\
base_model: llama-3-8b          # meta-llama/Meta-Llama-3-8B in the example
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
flash_attention: true
"""

# Yi's published shapes (01-ai/Yi-6B-Chat, 01-ai/Yi-34B-Chat: LlamaForCausalLM).
YI_6B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 64000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 5000000.0,
    "tie_word_embeddings": False,
}
YI_34B = dict(
    YI_6B,
    hidden_size=7168,
    intermediate_size=20480,
    num_hidden_layers=60,
    num_attention_heads=56,
    num_key_value_heads=8,
    max_position_embeddings=4096,
)
# Qwen/Qwen2.5-3B's published shapes (Qwen2ForCausalLM, tied embeddings).
QWEN25_3B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
}

# ms-swift 1.x's LoRA benchmark as the Trainer ran it: bf16 base, fp32 adapters on Llama's DEFAULT
# targets (q, k, v), r=8, alpha 32, dropout 0.05, checkpointing, flash attention, micro-batch 1.
_SWIFT1_LORA = dict(
    method="lora",
    rank=8,
    alpha=32,
    dropout=0.05,
    targets="q_proj,k_proj,v_proj",
    precision="bf16",
    batch_size=1,
    grad_accum=16,
    checkpointing="on",
    recipe="hf",
)
_SWIFT1_ASSUMED = [
    "seq_len: ms-swift 1.x drops examples longer than max_length (truncation_strategy delete) and the "
    "dataset's tokens are 3234 +- 2548 (min 91): its longest batch is planned at max_length",
    "optim: the Trainer's default of that time (adamw_torch, foreach; adapters only, so a few MiB)",
    "loss: the transformers of torch 2.1.1's time (4.35 to 4.36): fp32 logits returned and a shifted fp32 copy "
    "(hf_loss: model-4.45)",
]
_SWIFT1_FLASH = "attention: flash_attn 2.3.4 (the hf recipe's flash path planned)"
_SWIFT1_LENGTHS = (
    "batch lengths: the run's batches take every length up to max_length (91 to max_length tokens), and "
    "the peak reserved memory of a whole run holds what the caching allocator kept from all their shapes; "
    "memfit plans one step of the longest shape"
)

# ms-swift 3.x examples: swift sft's defaults (bf16, LoRA r=8 alpha 32 on all-linear, dropout 0.05,
# gradient checkpointing, micro-batch 1, max_length 2048), the Trainer's AdamW of 2025 (adamw_torch).
_SWIFT3 = dict(
    method="lora",
    rank=8,
    alpha=32,
    dropout=0.05,
    targets="all-linear",
    precision="bf16",
    batch_size=1,
    checkpointing="on",
    recipe="hf",
    seq_len=2048,
    adamw_impl="foreach",
    hf_loss="model-4.46",
)
_SWIFT3_OPTIM = "optim: swift 3.x on transformers 4.4x-4.5x and torch before 2.8: the Trainer's adamw_torch (foreach)"
# ms-swift's dataset table (docs/source_en/Instruction/Supported-models-and-datasets.md, made by
# scripts/utils/run_dataset_info.py with Qwen2.5-7B-Instruct's template): each corpus's longest row.
SWIFT_LONGEST = {"swift/self-cognition": 131, "AI-ModelScope/alpaca-gpt4-data-en": 607}


def _swift3_dated(commit: str, date: str, loss: str) -> str:
    """The note on when an example's figure was written (the commit its comment line dates from) and
    the loss of the transformers of that time."""
    era = "4.46 to 4.49: its shifted fp32 copy of the logits" if loss == "model-4.46" else "4.50 or later"
    return f"loss: the figure dates from {commit} ({date}), with transformers {era} (hf_loss: {loss})"


def _swift3_longest(dataset: str, tokens: int) -> str:
    return (
        f"seq_len: the example as of its figure trains on {dataset}, whose longest row ms-swift's dataset table gives "
        f"as {tokens} tokens (scripts/utils/run_dataset_info.py, Qwen2.5-7B-Instruct's template): planned at {tokens}"
    )


_SELF_COGNITION = _swift3_longest("swift/self-cognition#1000", SWIFT_LONGEST["swift/self-cognition"])
_QWEN2 = "model: the example of December 2024 trained Qwen2-7B-Instruct, which has Qwen2.5-7B's shapes"
# When an example's figure was written (its comment line's commit and date) and the loss of that time.
_DEC_5 = ("b40f31df7", "2024-12-05", "model-4.46")
_DEC_23 = ("a3731f998", "2024-12-23", "model-4.46")
# What ms-swift's memory(GiB) holds beyond a training step.
_SWIFT3_COUNTER = (
    "counter: ms-swift 3.x's memory(GiB) is torch.cuda.max_memory_reserved since the process started, never reset "
    "(get_max_cuda_memory in swift/trainers/mixin.py, later callback.py; until mid 2025 summed over every visible "
    "GPU), so it holds loading the model too, which memfit does not plan"
)
_SWIFT1_COUNTER = (
    "counter: ms-swift 1.x's figure is the largest torch.cuda.max_memory_reserved of its log readings, the first of "
    "which (get_max_cuda_memory in swift/trainers/mixin.py resets the peak after each reading) holds loading the "
    "model too, which memfit does not plan"
)


def cases() -> list[dict]:
    """Every published measurement, with its source, its configuration and how it is planned."""
    out: list[dict] = []
    for card_gib, tokens in ((12, 932), (16, 2551), (24, 5789), (40, 12264), (48, 15502), (80, 28454)):
        out.append(
            dict(
                id=f"unsloth's hf+fa2 baseline, llama-3.1-8b qlora r32, longest on {card_gib} GB ({tokens:,} tokens)",
                tool="trl",
                source=UNSLOTH_README,
                counter="card",
                published_gib=card_gib,
                versions={"note": "2024-2025 (Llama 3.1 / 3.3 posts)"},
                config=UNSLOTH_HF.format(model="llama-3.1-8b", tokens=tokens),
                plan_options=TRL_2024,
                assumed=_UNSLOTH_ASSUMED,
            )
        )
    out.append(
        dict(
            id="unsloth's hf+fa2 baseline, llama-3.3-70b qlora r32, longest on 80 GB (6,916 tokens)",
            tool="trl",
            source=UNSLOTH_README,
            counter="card",
            published_gib=80,
            versions={"note": "December 2024"},
            config=UNSLOTH_HF.format(model="llama-3.1-70b", tokens=6916),
            plan_options=TRL_2024,
            assumed=_UNSLOTH_ASSUMED + ["model: Llama 3.3 70B has Llama 3.1 70B's shapes (the catalog's config)"],
        )
    )
    out += [
        dict(
            id="axolotl llama-2-7b qlora, rtx 4090",
            tool="axolotl",
            source=AXOLOTL_LLAMA2,
            counter="nvidia-smi",
            published_gib=17,
            config=_AXOLOTL_LLAMA2.format(quant="load_in_4bit: true", adapter="qlora", optimizer="paged_adamw_32bit"),
            plan_options=AXOLOTL_2023,
            assumed=_AXOLOTL_LLAMA2_ASSUMED,
        ),
        dict(
            id="axolotl llama-2-7b lora 8-bit, rtx 4090",
            tool="axolotl",
            source=AXOLOTL_LLAMA2,
            counter="nvidia-smi",
            published_gib=20,
            config=_AXOLOTL_LLAMA2.format(quant="load_in_8bit: true", adapter="lora", optimizer="adamw_bnb_8bit"),
            plan_options=AXOLOTL_2023,
            assumed=_AXOLOTL_LLAMA2_ASSUMED,
        ),
        dict(
            id="axolotl llama-3-8b full fine-tuning, single 48 GB card",
            tool="axolotl",
            source=AXOLOTL_LLAMA3,
            counter="card",
            published_gib=48,
            config=_AXOLOTL_FFT_8B,
        ),
        dict(
            id="torchtune llama-3.2-3b full, packed 2x4096, a100",
            tool="torchtune",
            source=TORCHTUNE_FLAGS,
            counter="allocated",
            published_gib=60.0,
            versions={"torchtune": "1814feb17 (November 2024)"},
            config={
                "recipe": "full_finetune_single_device",
                "model": "Llama 3.2 3B",
                "batch_size": 2,
                "max_seq_len": 4096,
                "dataset.packed": True,
                "compile": False,
                "loss": "CrossEntropyLoss (the baseline's)",
                "enable_activation_checkpointing": False,
                "optimizer_in_bwd": False,
                "dtype": "bf16",
            },
            plan={
                "model": "llama-3.2-3b",
                "knobs": dict(
                    method="full",
                    precision="bf16",
                    batch_size=2,
                    seq_len=4096,
                    packing=True,
                    checkpointing="off",
                    recipe="hf",
                ),
            },
            assumed=[
                "optimizer: torchtune's configs' torch.optim.AdamW with fused=True",
                "loss: torchtune's output projection upcasts the logits to fp32 before the cross-entropy, as "
                "transformers' loss does (the hf recipe's model loss)",
            ],
        ),
    ]
    out += _torchtune_flag_cases()
    swift1 = (
        ("yi-6b-chat", YI_6B, ((512, 13.72), (1024, 15.44), (2048, 16.95), (4096, 28.25), (8192, 43.81))),
        ("yi-34b-chat", YI_34B, ((512, 66.72), (1024, 69.10), (2048, 71.34), (4096, 78.72))),
    )
    for name, config, rows in swift1:
        for tokens, gib in rows:
            out.append(
                dict(
                    id=f"ms-swift 1.x {name} lora r8 (q,k,v), max_length {tokens}, a100",
                    tool="ms-swift",
                    source=SWIFT_BENCHMARK,
                    counter="reserved",
                    published_gib=gib,
                    versions={"torch": "2.1.1", "flash_attn": "2.3.4", "cuda": "11.8"},
                    config={
                        "model_type": name,
                        "sft_type": "lora",
                        "max_length": tokens,
                        "dataset": "cls-fudan-news-zh",
                    },
                    plan={
                        "model": config,
                        "knobs": dict(_SWIFT1_LORA, seq_len=tokens, padding_free="off", hf_loss="model-4.45"),
                    },
                    assumed=_SWIFT1_ASSUMED + [_SWIFT1_FLASH],
                    unplannable=[_SWIFT1_LENGTHS, _SWIFT1_COUNTER],
                )
            )
    out += _swift3_cases()
    out += _peft_cases()
    return out


# torchtune's optimization-flags table: each row adds its flag to the rows above (compile on from its
# third row), LoRA and QLoRA take them all but optimizer_in_bwd and 8-bit AdamW (the README's command).
_TUNE_COMPILE = "compile: True: torch.compile's fused kernels (what they keep differs from eager PyTorch's)"
_TUNE_LOSS = (
    "loss: CEWithChunkedOutputLoss with its cross-entropy compiled (training.compile_loss): the hf recipe's "
    "chunked-output-compiled"
)
_TUNE_FLAGS = dict(
    precision="bf16",
    batch_size=2,
    seq_len=4096,
    packing=True,
    recipe="hf",
    hf_loss="chunked-output-compiled",
    adamw_impl="fused",
)


def _tune_knobs(knobs: dict) -> dict:
    """A row's knobs: the flags of the rows above it, full fine-tuning unless it names adapters."""
    return dict(_TUNE_FLAGS, **({"method": "full"} | knobs))


def _torchtune_flag_cases() -> list[dict]:
    full = [
        ("+ activation checkpointing", 24.9, dict(checkpointing="on"), {"enable_activation_checkpointing": True}),
        (
            "+ optimizer step in backward",
            23.1,
            dict(checkpointing="on", step_in_backward=True, max_grad_norm=None),
            {"optimizer_in_bwd": True},
        ),
        (
            "+ activation offloading",
            21.8,
            dict(checkpointing="offload", step_in_backward=True, max_grad_norm=None),
            {"enable_activation_offloading": True},
        ),
    ]
    adapters = [
        ("lora", 8.5, dict(method="lora"), {"config": "llama3_2/3B_lora_single_device"}),
        # torchtune quantizes the linear layers and leaves every other parameter in bf16 (no upcast).
        ("qlora", 4.6, dict(method="qlora", kbit_upcast=False), {"config": "llama3_2/3B_qlora_single_device"}),
    ]
    # torchtune builds the model, adapters included, in its dtype (bf16): adapters, their gradients
    # and AdamW's states in bf16.
    lora = dict(
        rank=64,
        alpha=128,
        dropout=0.0,
        targets="q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        adapter_dtype="compute",
    )
    out = []
    for what, gib, knobs, flags in full + adapters:
        adapted = "method" in knobs
        if adapted:
            knobs = dict(knobs, **lora, checkpointing="offload")
        out.append(
            dict(
                id=f"torchtune llama-3.2-3b {what if adapted else 'full ' + what}, packed 2x4096, compile, a100",
                tool="torchtune",
                source=dict(TORCHTUNE_FLAGS, quote=f"| {what} ... | {gib} (Peak Memory Active, GiB)"),
                counter="allocated",
                published_gib=gib,
                versions={"torchtune": "1814feb17 (November 2024)"},
                config={
                    "recipe": "lora_finetune_single_device" if adapted else "full_finetune_single_device",
                    "batch_size": 2,
                    "tokenizer.max_seq_len": 4096,
                    "dataset.packed": True,
                    "compile": True,
                    "loss": "CEWithChunkedOutputLoss",
                    **flags,
                },
                plan={"model": "llama-3.2-3b", "knobs": _tune_knobs(knobs)},
                assumed=[_TUNE_LOSS]
                + (
                    [
                        "lora: the configs' lora_attn_modules q_proj, v_proj, output_proj and the MLP, rank 64, alpha "
                        "128, no dropout, in bf16 as torchtune builds them (adapter_dtype: compute); "
                        "torch.optim.AdamW (fused), as the README's command sets it",
                        "activation offloading with checkpointing: the checkpointed layer inputs in host memory",
                    ]
                    + (
                        [
                            "qlora: torchao's NF4 (64-value blocks, scalers quantized per 256) planned as "
                            "bitsandbytes' double-quantized NF4; the embeddings, norms and tied head stay in bf16 as "
                            "torchtune loads them (kbit_upcast: false: no prepare_model_for_kbit_training)"
                        ]
                        if knobs["method"] == "qlora"
                        else []
                    )
                    if adapted
                    else [
                        "optimizer: torchtune's configs' torch.optim.AdamW with fused=True (8-bit AdamW is a later row)"
                    ]
                ),
                unplannable=[_TUNE_COMPILE],
            )
        )
    return out


def _swift3_cases() -> list[dict]:
    q7 = "qwen2.5-7b"
    return [
        dict(
            id="ms-swift 3.x qwen2.5-7b-instruct lora r8 all-linear, packed 2048",
            tool="ms-swift",
            source=swift_example(
                "examples/train/packing/llm.sh",
                "# 22GB ... --packing true --attn_impl flash_attn "
                "--lora_rank 8 --target_modules all-linear --max_length 2048",
            ),
            counter="reserved",
            published_gib=22,
            config={"swift": "sft", "packing": True, "attn_impl": "flash_attn"},
            plan={"model": q7, "knobs": dict(_SWIFT3, packing=True, padding_free="on")},
            assumed=[_SWIFT3_OPTIM, _swift3_dated("dbe09322a", "2025-03-31", "model-4.46")],
            unplannable=[_SWIFT3_COUNTER],
        ),
        dict(
            id="ms-swift 3.x qwen2.5-3b full, packed 8192, liger",
            tool="ms-swift",
            source=swift_example(
                "examples/train/agent/qwen2_5.sh",
                "# 35GiB ... --tuner_type full --max_length 8192 "
                "--packing true --use_liger_kernel true --attn_impl flash_attn",
            ),
            counter="reserved",
            published_gib=35,
            config={"swift": "sft", "tuner_type": "full", "packing": True, "liger": True},
            plan={
                "model": QWEN25_3B,
                "knobs": dict(
                    method="full",
                    precision="bf16",
                    batch_size=1,
                    seq_len=8192,
                    packing=True,
                    padding_free="on",
                    checkpointing="on",
                    recipe="hf",
                    hf_loss="liger",
                    adamw_impl="foreach",
                ),
            },
            assumed=[_SWIFT3_OPTIM],
            unplannable=[
                _SWIFT3_COUNTER,
                "use_liger_kernel: Liger's RMSNorm, SwiGLU and RoPE kernels (its fused linear cross-entropy is planned)",
            ],
        ),
        _swift3_short(
            "tuners/lora/train.sh",
            "lora r8, swift/self-cognition",
            17.2,
            {},
            _DEC_5,
            assumed=(_QWEN2,),
        ),
        _swift3_short(
            "tuners/dora/train.sh",
            "dora r8, swift/self-cognition",
            17.2,
            {"dora": True},
            _DEC_5,
            assumed=(_QWEN2,),
        ),
        _swift3_short(
            "multi-gpu/deepspeed/train_zero2.sh",
            "lora r8, deepspeed zero2 on 2 gpus",
            18,
            {"gpus": 2, "shard": "zero2", "adamw_impl": "fused"},
            _DEC_23,
            assumed=("optimizer: zero2.json's AdamW block: DeepSpeed's FusedAdam, which updates in place",),
            deepspeed=("ms-swift's swift/llm/ds_config/zero2.json", SWIFT_ZERO2),
        ),
        _swift3_short(
            "multi-gpu/deepspeed/train_zero3.sh",
            "lora r8, deepspeed zero3 on 2 gpus",
            16,
            {"gpus": 2, "shard": "zero3"},
            _DEC_23,
            deepspeed=("ms-swift's swift/llm/ds_config/zero3.json", SWIFT_ZERO3),
        ),
        _swift3_short(
            "multi-gpu/ddp/train.sh",
            "lora r8, ddp on 2 gpus",
            27.5,
            {"gpus": 2, "shard": "ddp"},
            _DEC_23,
        ),
        _swift3_short(
            "streaming/lazy_tokenize.sh",
            "lora r8, lazy_tokenize",
            17,
            {},
            ("11a345d41", "2025-07-31", "model"),
            assumed=("lazy_tokenize: examples tokenized as the loader reads them (the host's work, not the GPU's)",),
        ),
        _swift3_short(
            "tuners/neftune/train.sh",
            "lora r8, neftune",
            17,
            {},
            _DEC_5,
            assumed=(_QWEN2,),
            unplannable=(
                "neftune_noise_alpha: the noise NEFTune adds to the embeddings' output (a tensor of its size)",
            ),
        ),
        _swift3_short(
            "tuners/olora/train.sh",
            "lora r8, olora init",
            17,
            {},
            _DEC_5,
            assumed=(_QWEN2, "init_weights olora: how the adapters start; the step trains the same LoRA"),
        ),
        _swift3_short(
            "tuners/pissa/train.sh",
            "lora r8, pissa init",
            17,
            {},
            _DEC_5,
            assumed=(
                _QWEN2,
                "init_weights pissa: the base's principal part moves into the adapters once, before training",
            ),
        ),
        _swift3_short(
            "multi-gpu/fsdp2_lora/train.sh",
            "lora r8, fsdp2 on 2 gpus",
            14.7,
            {"gpus": 2, "shard": "fsdp"},
            ("376640797", "2025-11-07", "model"),
            assumed=(
                "gradient_checkpointing false with the accelerate config's fsdp_activation_checkpointing true (FSDP2, "
                "reshard_after_forward, mixed_precision bf16): each decoder layer checkpointed, planned as checkpointing on",
            ),
        ),
        *_swift3_more(),
    ]


def _swift3_more() -> list[dict]:
    """ms-swift 3.x examples on other corpora, other methods and objectives."""
    return [
        dict(
            id="ms-swift 3.x qwen2.5-7b-instruct full, max_length 2048",
            tool="ms-swift",
            source=swift_example(
                "examples/train/full/train.sh", "# 76GiB ... --model Qwen/Qwen2.5-7B-Instruct --tuner_type full"
            ),
            counter="reserved",
            published_gib=76,
            config={"swift": "sft", "tuner_type": "full", "torch_dtype": "bfloat16", "max_length": 2048},
            plan={
                "model": "qwen2.5-7b",
                "knobs": dict(_SWIFT3, method="full", seq_len=SWIFT_LONGEST["swift/self-cognition"]),
            },
            assumed=[
                _SWIFT3_OPTIM,
                _swift3_dated(*_DEC_5),
                _SELF_COGNITION,
                _QWEN2,
                "precision: torch_dtype bfloat16: bf16 weights, gradients and AdamW states",
            ],
            unplannable=[_SWIFT3_COUNTER],
        ),
        dict(
            id="ms-swift 3.x qwen2.5-7b-instruct qlora (bnb nf4) r8 all-linear, max_length 2048",
            tool="ms-swift",
            source=swift_example(
                "examples/train/qlora/bnb/train.sh",
                "# 10GB ... --quant_method bnb --quant_bits 4 --bnb_4bit_use_double_quant true",
            ),
            counter="reserved",
            published_gib=10,
            config={"swift": "sft", "quant_method": "bnb", "quant_bits": 4, "bnb_4bit_use_double_quant": True},
            plan={
                "model": "qwen2.5-7b",
                "knobs": dict(
                    _SWIFT3,
                    method="qlora",
                    kbit_upcast=False,
                    seq_len=SWIFT_LONGEST["AI-ModelScope/alpaca-gpt4-data-en"],
                    hf_loss="model",
                ),
            },
            assumed=[
                _SWIFT3_OPTIM,
                _swift3_dated("74e4831d2", "2025-07-31", "model"),
                _swift3_longest(
                    "alpaca-gpt4-data-zh#500, alpaca-gpt4-data-en#500 and swift/self-cognition#500 (the longest: "
                    "alpaca-gpt4-data-en)",
                    SWIFT_LONGEST["AI-ModelScope/alpaca-gpt4-data-en"],
                ),
                "kbit_upcast: ms-swift loads the base in torch_dtype bfloat16 and never calls PEFT's "
                "prepare_model_for_kbit_training: the parameters that are not 4-bit stay bf16",
                "counter: '10GB' read as GiB, as ms-swift's other examples write it",
            ],
            unplannable=[_SWIFT3_COUNTER],
        ),
        dict(
            id="ms-swift 3.x qwen2.5-7b-instruct dpo lora r8 all-linear, max_length 2048",
            tool="ms-swift",
            source=swift_example(
                "examples/train/rlhf/dpo/lora.sh", "# 24GiB ... swift rlhf --rlhf_type dpo --tuner_type lora"
            ),
            counter="reserved",
            published_gib=24,
            config={"swift": "rlhf", "rlhf_type": "dpo", "rpo_alpha": 0.1, "max_length": 2048},
            plan={"model": "qwen2.5-7b", "knobs": dict(_SWIFT3, objective="dpo", hf_loss="model")},
            assumed=[_SWIFT3_OPTIM, "reference: the model with its adapters disabled (LoRA, no ref_model)"],
            unplannable=[
                _SWIFT3_COUNTER,
                "seq_len: the longest chosen / rejected pair of hjh0119/shareAI-Llama3-DPO-zh-en-emoji is not "
                "published: planned at max_length 2048 (an upper bound)",
                "rpo_alpha: 0.1: the chosen answers' NLL added to the loss (from the same logits)",
            ],
        ),
    ]


def _swift3_short(
    path: str,
    what: str,
    gib: float,
    knobs: dict,
    dated: tuple[str, str, str],
    assumed: tuple[str, ...] = (),
    unplannable: tuple[str, ...] = (),
    deepspeed: tuple[str, dict] | None = None,
) -> dict:
    """An example on swift/self-cognition (its short chat turns), planned at their longest row with
    the loss of its figure's date (``dated``: commit, date, hf_loss)."""
    tokens = SWIFT_LONGEST["swift/self-cognition"]
    plan = {"model": "qwen2.5-7b", "knobs": dict(_SWIFT3, seq_len=tokens, hf_loss=dated[2], **knobs)}
    if deepspeed is not None:
        plan |= {"deepspeed_source": deepspeed[0], "deepspeed": deepspeed[1]}
    return dict(
        id=f"ms-swift 3.x qwen2.5-7b-instruct {what}",
        tool="ms-swift",
        source=swift_example(
            f"examples/train/{path}", f"# {gib:g}GiB ... --model Qwen/Qwen2.5-7B-Instruct --lora_rank 8"
        ),
        counter="reserved",
        published_gib=gib,
        config={"swift": "sft", **knobs} | ({"deepspeed": deepspeed[0]} if deepspeed else {}),
        plan=plan,
        assumed=[_SWIFT3_OPTIM, _swift3_dated(*dated), _SELF_COGNITION, *assumed],
        unplannable=[_SWIFT3_COUNTER, *unplannable],
    )


# Llama-2-70B's shapes (meta-llama/Llama-2-70b-hf: Llama-2-7B's config with these).
LLAMA2_70B_SHAPES = {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
}
# PEFT's examples/sft/train.py through TRL's SFTTrainer: packed rows of 2048 tokens, LoRA r=8 alpha 16
# dropout 0.1 on all-linear, bf16, flash attention, gradient checkpointing.
_PEFT_SFT = dict(
    rank=8,
    alpha=16,
    dropout=0.1,
    targets="all-linear",
    precision="bf16",
    seq_len=2048,
    packing=True,
    padding_free="off",
    checkpointing="on",
    recipe="hf",
)
_PEFT_VERSIONS = {
    "bitsandbytes": ">=0.43.0",
    "accelerate": ">=0.28.0",
    "transformers": ">4.38.2",
    "trl": ">0.7.11",
    "peft": ">0.9.0",
}
_PEFT_COUNTER = (
    "counter: 'memory consumed per GPU' (the LoRA section's figure is an nvidia-smi screenshot): read as "
    "nvidia-smi, compared with the device total"
)
_PEFT_OPTIM = (
    "optim: the Trainer's default of March 2024 (adamw_torch, foreach; adapters only, so a few MiB); loss: the "
    "transformers of that time (4.38 to 4.40): fp32 logits returned and a shifted fp32 copy (hf_loss: model-4.45)"
)
_PEFT_QLORA = [
    "use_nested_quant / bnb_4bit_quant_storage_dtype bfloat16: the 4-bit base stored in bf16 words, sharded and "
    "gathered by FSDP and ZeRO-3 as any weight (the hf recipe's sharded QLoRA), its quantization state whole",
    "kbit_upcast: off: TRL's SFTTrainer skips prepare_model_for_kbit_training for QLoRA under FSDP / ZeRO-3 "
    "(is_sharded_qlora, trl/trainer/sft_trainer.py), so the model keeps the torch_dtype the example loads it in "
    "(bf16, the quant storage dtype)",
]


_ACCELERATE_ZERO3_NOTE = (
    "deepspeed: the guides' accelerate config (zero_stage 3, zero3_init_flag) writes no bucket sizes, so DeepSpeed's "
    "defaults hold: reduce_bucket_size 5e8, stage3_prefetch_bucket_size 5e7, stage3_param_persistence_threshold 1e5, "
    "stage3_max_live_parameters and stage3_max_reuse_distance 1e9"
)


def _llama2_70b() -> dict:
    catalog = Path(__file__).parent.parent / "src" / "memfit" / "models" / "catalog" / "llama-2-7b.json"
    return dict(json.loads(catalog.read_text()), **LLAMA2_70B_SHAPES)


def _peft_case(what: str, source: dict, gib: float, knobs: dict, args: dict, unplannable: list[str]) -> dict:
    reentrant = args.get("use_reentrant", True)
    plan = {
        "model": _llama2_70b(),
        # The script passes its use_reentrant to the Trainer's gradient_checkpointing_kwargs.
        "knobs": dict(_PEFT_SFT, **knobs, use_reentrant="on" if reentrant else "off", hf_loss="model-4.45")
        | ({"kbit_upcast": False} if knobs["method"] == "qlora" else {}),
    }
    if knobs["shard"] == "zero3":
        plan |= {
            "deepspeed_source": "accelerate's DeepSpeed plugin (zero_stage 3, no config file)",
            "deepspeed": ACCELERATE_ZERO3,
        }
    return dict(
        id=f"peft docs llama-2-70b {what}",
        tool="peft",
        source=source,
        counter="nvidia-smi",
        published_gib=gib,
        versions=_PEFT_VERSIONS,
        config={
            "script": "examples/sft/train.py",
            "max_seq_len": 2048,
            "packing": True,
            "use_flash_attn": True,
            "lora_r": 8,
            "lora_alpha": 16,
            **args,
        },
        plan=plan,
        assumed=[_PEFT_COUNTER, _PEFT_OPTIM]
        + (_PEFT_QLORA if knobs["method"] == "qlora" else [])
        + ([_ACCELERATE_ZERO3_NOTE] if knobs["shard"] == "zero3" else []),
        unplannable=unplannable,
    )


def _peft_cases() -> list[dict]:
    fsdp1 = "fsdp_use_orig_params false: the Trainer's FSDP1 with flat parameters (memfit plans FSDP2)"
    return [
        _peft_case(
            "lora r8, deepspeed zero3 on 8 h100",
            PEFT_DEEPSPEED_LORA,
            64,
            dict(method="lora", batch_size=8, gpus=8, shard="zero3"),
            {"zero_stage": 3, "num_processes": 8, "per_device_train_batch_size": 8, "use_reentrant": False},
            [],
        ),
        _peft_case(
            "qlora r8, deepspeed zero3 on 2 gpus",
            PEFT_DEEPSPEED,
            36.6,
            dict(method="qlora", batch_size=2, gpus=2, shard="zero3"),
            {"zero_stage": 3, "num_processes": 2, "per_device_train_batch_size": 2, "use_reentrant": True},
            [],
        ),
        _peft_case(
            "qlora r8, fsdp with cpu offload on 2 gpus",
            PEFT_FSDP,
            19.6,
            dict(method="qlora", batch_size=2, gpus=2, shard="fsdp-offload"),
            {"fsdp_offload_params": True, "num_processes": 2, "per_device_train_batch_size": 2, "use_reentrant": True},
            [fsdp1],
        ),
        _peft_case(
            "qlora r8, fsdp on 2 gpus",
            PEFT_FSDP,
            35.6,
            dict(method="qlora", batch_size=2, gpus=2, shard="fsdp"),
            {"fsdp_offload_params": False, "num_processes": 2, "per_device_train_batch_size": 2, "use_reentrant": True},
            [fsdp1],
        ),
    ]


# --- planning ------------------------------------------------------------------------------------

#: The plan's figure each counter is compared with.
COMPARED = {
    "reserved": "reserved_bytes",
    "allocated": "allocated_bytes",
    "card": "device_total_bytes",
    "nvidia-smi": "device_total_bytes",
}


def _zero(case: dict):
    """The case's DeepSpeed config as memfit reads a DeepSpeed JSON (None: the case names none)."""
    from memfit.interop.deepspeed import read_zero

    data = case["plan"].get("deepspeed")
    return None if data is None else read_zero(data, case["plan"]["deepspeed_source"])


def run_case(case: dict, folder: Path) -> dict:
    """Plan one case; its planned figures beside the published one."""
    import memfit
    from memfit.planner.errors import PlanError

    started = time.perf_counter()
    try:
        if "plan" in case:
            plan = memfit.plan(case["plan"]["model"], deepspeed=_zero(case), **case["plan"]["knobs"])
        else:
            suffix = ".yml" if case["tool"] == "axolotl" else ".yaml"
            path = folder / ("".join(c if c.isalnum() else "-" for c in case["id"])[:60] + suffix)
            path.write_text(case["config"])
            plan = memfit.plan(str(path), **case.get("plan_options", {}))
    except PlanError as err:
        # A run memfit refuses to plan: listed, with the refusal as its unplannable key.
        return {
            "id": case["id"],
            "tool": case["tool"],
            "source": case["source"],
            "counter": case["counter"],
            "versions": case.get("versions", {}),
            "config": case["config"],
            "published_bytes": int(case["published_gib"] * GIB),
            "planned_bytes": None,
            "error": None,
            "assumed": case.get("assumed", []),
            "unplannable": case.get("unplannable", []) + [f"refused: {err}"],
            "approximated": [],
        }
    data = plan.to_dict()
    planned = getattr(plan, COMPARED[case["counter"]])
    published = int(case["published_gib"] * GIB)
    config = data["details"].get("config") or {"not_modelled": [], "approximated": []}
    return {
        "id": case["id"],
        "tool": case["tool"],
        "source": case["source"],
        "counter": case["counter"],
        "versions": case.get("versions", {}),
        "config": case["config"],
        "planned_as": data["spec"],
        "model": data["model"],
        "published_bytes": published,
        "planned_bytes": int(planned),
        "planned": {k: getattr(plan, k) for k in ("allocated_bytes", "reserved_bytes", "device_total_bytes")},
        "error": round(planned / published - 1, 4),
        "assumed": case.get("assumed", []),
        "unplannable": case.get("unplannable", []) + [f"{f['key']}: {f['why']}" for f in config["not_modelled"]],
        "approximated": [f"{f['key']}: {f['why']}" for f in config["approximated"]],
        "plan_seconds": round(time.perf_counter() - started, 1),
    }


def summary(rows: list[dict]) -> dict:
    """Cases, tools, median and p95 of |error|, and the worst case under its measurement (that of
    a case with an unplannable key apart)."""

    def p95(values: list[float]) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]

    refused = [r for r in rows if r["planned_bytes"] is None]
    rows = [r for r in rows if r["planned_bytes"] is not None]
    errors = [abs(r["error"]) for r in rows]
    plannable = [r for r in rows if not r["unplannable"]]
    worst = min(plannable, key=lambda r: r["error"], default=None)
    worst_any = min(rows, key=lambda r: r["error"], default=None)
    return {
        "cases": len(rows),
        "tools": sorted({r["tool"] for r in rows}),
        "median_abs_error": round(statistics.median(errors), 4) if errors else None,
        "p95_abs_error": round(p95(errors), 4) if errors else None,
        "worst_under": {"id": worst["id"], "error": worst["error"]} if worst else None,
        "worst_under_any": {"id": worst_any["id"], "error": worst_any["error"]} if worst_any else None,
        # How far under (a fraction, never negative), for the docs' figures.
        "worst_under_by": max(-worst["error"], 0.0) if worst else None,
        "worst_under_any_by": max(-worst_any["error"], 0.0) if worst_any else None,
        "fully_plannable_cases": len(plannable),
        "median_abs_error_fully_plannable": round(statistics.median([abs(r["error"]) for r in plannable]), 4)
        if plannable
        else None,
        "under_by_more_than_5_percent": [r["id"] for r in plannable if r["error"] < -0.05],
        "refused": [r["id"] for r in refused],
    }


def summary_block(result: dict) -> str:
    """The README's and docs/plan.md's lines: the summary, then one row a case."""
    s = result["summary"]
    lines = [
        f"{s['cases']} published runs from {len(s['tools'])} tools ({', '.join(s['tools'])}): median |planned / "
        f"published - 1| {s['median_abs_error']:.1%}, p95 {s['p95_abs_error']:.1%}; the furthest under its measurement "
        f"of the cases memfit plans whole: {s['worst_under']['error']:+.1%} ({s['worst_under']['id']}).",
        "",
        "| case | tool | counter | published | planned | error | left open |",
        "| --- | --- | --- | ---: | ---: | ---: | --- |",
    ]
    for r in result["cases"]:
        src = r["source"]
        link = f"https://github.com/{src['repository']}/blob/{src['commit'] or 'main'}/{src['path']}"
        open_keys = "; ".join(item.split(":")[0] for item in r["unplannable"])
        planned = "refused" if r["planned_bytes"] is None else f"{r['planned_bytes'] / GIB:.2f} GiB"
        error = "" if r["error"] is None else f"{r['error']:+.1%}"
        lines.append(
            f"| [{r['id']}]({link}) | {r['tool']} | {r['counter']} | {r['published_bytes'] / GIB:.2f} GiB | "
            f"{planned} | {error} | {open_keys} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", type=int, default=None, help="plan the first N cases only")
    parser.add_argument("--list", action="store_true", help="list the cases, plan nothing")
    parser.add_argument(
        "--case", action="append", default=[], help="plan only the cases whose id holds this text (repeatable)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    if args.list:
        for case in cases():
            print(f"{case['tool']:10s} {case['counter']:10s} {case['published_gib']:>7} GiB  {case['id']}")
        return 0
    from _machine import describe_machine

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        chosen = [c for c in cases() if not args.case or any(text in c["id"] for text in args.case)]
        for case in chosen[: args.only]:
            row = run_case(case, Path(folder))
            shown = "refused" if row["error"] is None else f"{row['error']:+7.1%}"
            print(
                f"{shown}  {row['id']} (published {row['published_bytes'] / GIB:.2f} GiB, planned "
                f"{(row['planned_bytes'] or 0) / GIB:.2f} GiB, {row['counter']})",
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
