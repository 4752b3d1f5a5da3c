"""Shared pieces of the trainer tests: a tiny Llama config, a tiny saved model, quick configs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DEMO_DATA = REPO / "src" / "memfit" / "assets" / "data" / "tiny-instruct.jsonl"

#: A Llama-shaped model small enough to train a few steps on 2 CPU cores in about a second.
TINY_OVERRIDES: dict[str, Any] = {
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}


def tiny_model_dict(**changes: Any) -> dict[str, Any]:
    from memfit.models.catalog import load_catalog_config

    data = load_catalog_config("smollm2-135m")
    data.update(TINY_OVERRIDES)
    data.update(changes)
    return data


def save_tiny_pretrained(folder: Path, *, tie: bool = True, max_shard_size: str | None = None, seed: int = 0) -> Path:
    """A tiny Llama saved with save_pretrained (safetensors) plus the shipped tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memfit.models.build import make_config
    from memfit.train.data import tiny_tokenizer_path

    config = make_config(tiny_model_dict(tie_word_embeddings=tie))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(folder), **kwargs)
    AutoTokenizer.from_pretrained(str(tiny_tokenizer_path())).save_pretrained(str(folder))
    return folder


def tiny_settings(out: Path, **changes: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "model": "smollm2-135m",
        "init": "random",
        "model_overrides": dict(TINY_OVERRIDES),
        "data": [str(DEMO_DATA)],
        "method": "lora",
        "rank": 4,
        "precision": "fp32",
        "batch_size": 4,
        "seq_len": 64,
        "checkpointing": "on",
        "max_steps": 6,
        "lr": 5e-3,
        "warmup_steps": 2,
        "device": "cpu",
        "output_dir": str(out),
        "seed": 0,
    }
    settings.update(changes)
    return settings


def tiny_config(out: Path, **changes: Any):
    from memfit.train.config import validate_config

    return validate_config(tiny_settings(out, **changes))


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}
