"""Shared fixtures: tiny model configs (nothing is downloaded) and a quiet environment."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One CPU thread for torch here and in every process a test starts (set before torch is imported):
# the models are tiny, so a second thread gains nothing, and on a busy machine OpenMP threads that
# wait for each other make a millisecond step take tens of milliseconds (tests/step/test_tiling.py
# and test_losses.py on a busy 2-core machine: 360 s with torch's default threads, 182 s with one).
# An OMP_NUM_THREADS of your own is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", os.environ["OMP_NUM_THREADS"])
# Plans are made, never read from the on-disk plan cache (nor written into the user's): a test that
# patches memfit or a library in-process changes what a plan would be without changing its cache
# key. The cache's own tests turn it on, in a temporary folder (tests/planner/test_cache.py).
os.environ["MEMFIT_PLAN_CACHE"] = "0"

#: A llama-shaped model small enough to run for real on a CPU in milliseconds.
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


@pytest.fixture
def tiny_llama() -> dict:
    return dict(TINY_LLAMA)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
