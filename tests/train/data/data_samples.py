"""What the data tests share: the shipped files, small records, and functions that read labels and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit.step.labels import IGNORE_INDEX
from memfit.train.data import DataError, load_records

ROOT = Path(__file__).resolve().parents[3]
DATA_DIR = ROOT / "examples" / "data"
#: The demo dataset ships inside the package (memfit fit --write points at the installed copy).
DEMO_FILE = ROOT / "src" / "memfit" / "assets" / "data" / "tiny-instruct.jsonl"

ALPACA = [
    {"instruction": "What is 2 + 3?", "input": "", "output": "2 + 3 = 5."},
    {"instruction": "Reverse the word.", "input": "tiger", "output": "regit"},
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "3 + 3 = 6."},
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def labelled_runs(labels: list[int]) -> list[list[int]]:
    """Contiguous runs of trained label ids."""
    runs: list[list[int]] = []
    previous = IGNORE_INDEX
    for label in labels:
        if label != IGNORE_INDEX:
            if previous == IGNORE_INDEX:
                runs.append([])
            runs[-1].append(label)
        previous = label
    return runs


def data_error(paths, format="auto", **kwargs) -> str:
    with pytest.raises(DataError) as info:
        load_records(paths, format, **kwargs)
    return str(info.value)


def tiny_llama(vocab_size: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)
