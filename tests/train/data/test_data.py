"""The data package as shipped: the demo datasets, the tiny tokenizer, and the whole path feeding a
model that learns."""

from __future__ import annotations

import subprocess
import sys

import pytest
from data_samples import DATA_DIR, DEMO_FILE, ROOT, tiny_llama

from memfit.step.batch import collate
from memfit.train.data import BatchIterator, load_records, tiny_tokenizer_path, tokenize_records

SHIPPED = {
    "tiny-instruct.jsonl": ("messages", 320),
    "alpaca-example.json": ("alpaca", 7),
    "alpaca-example.csv": ("alpaca", 7),
    "sharegpt-example.jsonl": ("sharegpt", 6),
    "text-example.jsonl": ("text", 6),
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_dataset_files_validate(name):
    records, fmt = load_records(DEMO_FILE if name == DEMO_FILE.name else DATA_DIR / name)
    assert (fmt, len(records)) == SHIPPED[name]


def test_shipped_datasets_are_what_the_script_writes():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_tiny_dataset.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_tiny_tokenizer_loads_offline_and_round_trips(tokenizer, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_path())
    assert len(tok) == 512
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    for marker in ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"):
        assert tok.convert_tokens_to_ids(marker) in tok.all_special_ids
    text = "What is 17 + 25? 17 + 25 = 42.\nUnseen: Zürich, naïve, 東京, emoji 🙂"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert "<|assistant|>" in tok.chat_template


def test_tiny_tokenizer_files_are_what_the_script_writes():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_tiny_tokenizer.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_a_tiny_model_learns_the_shipped_dataset(tokenizer):
    """The whole path (load, tokenize, pack, batch, collate) feeds a model whose loss falls."""
    import torch

    records, _ = load_records(DEMO_FILE)
    rows = tokenize_records(records, tokenizer, seq_len=128, packing=True)
    model = tiny_llama(len(tokenizer)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = BatchIterator(rows, batch_size=8, seed=0, drop_last=True)
    losses = []
    for _ in range(40):
        batch = collate(next(batches), tokenizer.pad_token_id)
        loss = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"], use_cache=False
        ).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, losses
