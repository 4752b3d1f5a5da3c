"""Session-wide tiny base models and adapters for the merge tests."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from merge_helpers import llama_config, save_adapter, save_base  # noqa: E402


@pytest.fixture(scope="session")
def llama_bf16(tmp_path_factory) -> Path:
    return save_base(llama_config(), tmp_path_factory.mktemp("llama_bf16"), torch.bfloat16)


@pytest.fixture(scope="session")
def llama_fp32(tmp_path_factory) -> Path:
    return save_base(llama_config(), tmp_path_factory.mktemp("llama_fp32"), torch.float32, max_shard_size="120KB")


@pytest.fixture(scope="session")
def llama_tied(tmp_path_factory) -> Path:
    return save_base(llama_config(tie_word_embeddings=True), tmp_path_factory.mktemp("llama_tied"), torch.bfloat16)


@pytest.fixture(scope="session")
def plain_adapter(tmp_path_factory, llama_bf16) -> Path:
    return save_adapter(
        llama_bf16,
        tmp_path_factory.mktemp("plain_adapter"),
        torch.bfloat16,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "down_proj"],
    )
