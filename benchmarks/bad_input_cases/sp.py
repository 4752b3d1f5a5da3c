"""Sequence parallelism's bad inputs: heads that do not split, rows too short to cut, a degree that
does not divide the GPUs, a configuration whose rows are padded."""

from __future__ import annotations

from pathlib import Path

from ._case import Case

_PLAN = "plan llama-3.1-8b --method lora --shard fsdp"

CASES: list[Case] = [
    Case(
        f"{_PLAN} --gpus 3 --sequence-parallel 3 --seq-len 3072",
        2,
        fast=True,
        says=("--sequence-parallel 3", "32 attention heads", "divides 32"),
    ),
    Case(f"{_PLAN} --gpus 8 --sequence-parallel 8 --seq-len 4", 2, says=("--seq-len 4", "cannot be cut into 8")),
    Case(f"{_PLAN} --gpus 4 --sequence-parallel 4 --seq-len 4098", 2, says=("--seq-len 4098", "multiple of 4")),
    Case(f"{_PLAN} --gpus 6 --sequence-parallel 4", 2, says=("--sequence-parallel 4", "does not divide --gpus 6")),
    Case("plan llama-3.1-8b --method lora --sequence-parallel 2", 2, says=("--sequence-parallel 2", "--gpus 1")),
    Case(
        f"{_PLAN} --gpus 2 --sequence-parallel 2 --padding-free off",
        2,
        says=("--sequence-parallel 2", "--padding-free off"),
    ),
    Case(
        f"{_PLAN} --gpus 2 --sequence-parallel 2 --objective dpo", 2, says=("--sequence-parallel 2", "--objective dpo")
    ),
    Case(f"{_PLAN} --gpus 2 --sequence-parallel 0", 2, says=("--sequence-parallel", "0")),
    Case(
        "plan gemma-2-9b --method lora --shard fsdp --gpus 2 --sequence-parallel 2",
        2,
        says=("--sequence-parallel 2", "one row"),
    ),
    Case(
        "fit llama-3.1-8b --gpu h100 --method lora --gpus 6 --sequence-parallel 4",
        2,
        says=("--sequence-parallel 4", "--gpus 6"),
    ),
    Case(
        "train {d}/sp-heads.yaml",
        2,
        says=("sequence_parallel: 3", "seq_len: 64"),
        keeps=("sp-heads.yaml",),
    ),
]


def make_inputs(root: Path) -> None:
    """A training config whose rows of 64 tokens do not cut into 3 shards, and its data."""
    (root / "sp-data.jsonl").write_text('{"text": "a short example"}\n' * 4)
    (root / "sp-heads.yaml").write_text(
        "model: smollm2-135m\ninit: random\nmodel_overrides: {num_hidden_layers: 1, num_attention_heads: 4, "
        "num_key_value_heads: 2, hidden_size: 32, intermediate_size: 64}\n"
        f"data: [{root / 'sp-data.jsonl'}]\ngpus: 3\nshard: fsdp\nsequence_parallel: 3\nseq_len: 64\ndevice: cpu\nmax_steps: 1\n"
        f"output_dir: {root / 'sp-heads-run'}\n"
    )
