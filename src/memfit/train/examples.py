"""The run's data, made ready before any weight is read: tokenizer, examples, the evaluation split.

Everything that can fail on the user's data fails here, first (a bad file, a tokenizer that does
not match the model), so that no model is loaded for a run that cannot start.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

from memfit.train.config import TrainConfig, tokenizer_path
from memfit.train.errors import TrainError


def seed_everything(seed: int) -> None:
    """Seed python, numpy (when loaded) and torch (CPU and every CUDA device)."""
    random.seed(seed)
    if "numpy" in sys.modules:
        import numpy as np

        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def load_tokenizer(config: TrainConfig):
    """The run's tokenizer (see :func:`memfit.train.config.tokenizer_path`)."""
    from transformers import AutoTokenizer

    path = tokenizer_path(config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as err:
        raise TrainError(f"tokenizer: cannot load a tokenizer from {str(path)!r}: {err}") from None
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise TrainError(f"tokenizer: {path} has neither a pad nor an EOS token; training batches need padding")
    return tokenizer


def pad_token_id(tokenizer) -> int:
    """The id batches are padded with: the pad token, or EOS when the tokenizer has none."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def prepare_examples(config: TrainConfig, tokenizer) -> tuple[list, list]:
    """Load, validate and tokenize the training data; split off (or load) the evaluation set."""
    from memfit.train.data import load_records, tokenize_records

    records, fmt = load_records(config.data, config.data_format)
    if fmt == "preference":
        raise TrainError(
            f"data: {', '.join(config.data)} holds preference pairs (chosen and rejected), which objective: "
            f"{config.objective} does not train on. Set objective: dpo, orpo or simpo (docs/preference.md)."
        )
    eval_records: list = []
    if config.eval_data:
        eval_records, _ = load_records(config.eval_data, config.data_format)
    elif config.eval_split > 0:
        order = list(range(len(records)))
        random.Random(f"memfit-eval-{config.seed}").shuffle(order)
        n_eval = max(1, round(config.eval_split * len(records)))
        if n_eval >= len(records):
            raise TrainError(f"eval_split: {config.eval_split} of {len(records)} records leaves nothing to train on")
        held = set(order[:n_eval])
        eval_records = [records[i] for i in sorted(held)]
        records = [r for i, r in enumerate(records) if i not in held]
    kwargs = dict(seq_len=config.seq_len, train_on_inputs=config.train_on_inputs, packing=config.packing)
    train_examples = tokenize_records(records, tokenizer, **kwargs)
    eval_examples = tokenize_records(eval_records, tokenizer, **kwargs) if eval_records else []
    return train_examples, eval_examples


def prepare_pairs(config: TrainConfig, tokenizer) -> tuple[list, list, Any]:
    """Load, validate and tokenize preference pairs (a dpo, orpo or simpo run); split off (or load)
    the evaluation pairs. Returns (train pairs, eval pairs, what tokenizing to seq_len cut:
    :class:`memfit.train.data.pairs.PairStats`)."""
    from memfit.train.data import load_records
    from memfit.train.data.pairs import tokenize_pairs

    records, fmt = load_records(config.data, config.data_format)
    if fmt != "preference":
        raise TrainError(
            f"data: objective: {config.objective} trains on preference pairs (chosen and rejected, with or without a "
            f"prompt), and {', '.join(config.data)} holds {fmt} records. Give pairs (docs/preference.md), or use "
            "objective: sft for this data."
        )
    eval_records: list = []
    if config.eval_data:
        eval_records, _ = load_records(config.eval_data, config.data_format)
    elif config.eval_split > 0:
        records, eval_records = _split(records, config.eval_split, config.seed)
    train_pairs, stats = tokenize_pairs(records, tokenizer, config.seq_len)
    eval_pairs = tokenize_pairs(eval_records, tokenizer, config.seq_len)[0] if eval_records else []
    return train_pairs, eval_pairs, stats


def _split(records: list, fraction: float, seed: int) -> tuple[list, list]:
    order = list(range(len(records)))
    random.Random(f"memfit-eval-{seed}").shuffle(order)
    n_eval = max(1, round(fraction * len(records)))
    if n_eval >= len(records):
        raise TrainError(f"eval_split: {fraction} of {len(records)} records leaves nothing to train on")
    held = set(order[:n_eval])
    return [r for i, r in enumerate(records) if i not in held], [records[i] for i in sorted(held)]


def check_vocab(examples: list, vocab_size: int, tokenizer) -> None:
    """Every token id must have an embedding row; a tokenizer/model mismatch fails here, clearly."""
    if not vocab_size:
        return
    from memfit.step.preference import is_pair, pair_sequences

    sequences = [s for e in examples for s in (pair_sequences(e) if is_pair(e) else (e,))]
    largest = max((max(s["input_ids"]) for s in sequences if s["input_ids"]), default=-1)
    if largest >= vocab_size:
        raise TrainError(
            f"tokenizer: the data has token id {largest} but the model's vocab_size is {vocab_size} "
            f"(the tokenizer has {len(tokenizer)} tokens). Use the model's own tokenizer, or with init: random "
            f"set model_overrides: {{vocab_size: {len(tokenizer)}}}."
        )


def unscored(example: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``example`` whose labels are all ignored: a forward for the collectives, no loss."""
    from memfit.step.labels import IGNORE_INDEX

    return {**example, "labels": [IGNORE_INDEX] * len(example["labels"])}
