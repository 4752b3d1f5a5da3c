"""Fixtures for the watch tests: a tiny llama config (runs a training step in milliseconds on a CPU)."""

from __future__ import annotations

import pytest


@pytest.fixture
def tiny_llama_config():
    """The transformers config of a tiny llama (runs a training step in milliseconds on a CPU)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from several threads, and on a busy machine OpenMP threads waiting
    for each other make a millisecond step take tens of milliseconds."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
