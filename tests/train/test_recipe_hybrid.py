"""A hybrid (Falcon-H1: attention and Mamba side by side in every layer) trains on the CPU with LoRA."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from trainer_helpers import read_metrics, tiny_config  # noqa: E402

from memfit.train.recipe import train  # noqa: E402

FALCON_H1 = {
    "model_type": "falcon_h1",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "mamba_d_ssm": 64,
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_d_state": 8,
    "mamba_chunk_size": 16,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}


def test_falcon_h1_trains_two_steps_with_lora(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(FALCON_H1))
    config = tiny_config(
        tmp_path / "run", model=str(tmp_path / "config.json"), model_overrides={}, max_steps=2, batch_size=2
    )
    result = train(config, progress=False)
    assert result.status == "completed" and result.step == 2
    losses = [r["loss"] for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["setup"]["trainable_params"] == run["setup"]["expected_trainable_params"]
    saved = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    # all-linear: the Mamba mixer's in_proj beside attention and MLP; PEFT keeps LoRA off out_proj here.
    assert saved["exclude_modules"] == ["out_proj"]


def test_falcon_h1_mamba_buffers_get_their_values(tmp_path):
    """Falcon-H1's mixers hold a non-persistent mup_vector that the model's initializer (not the
    mixer's) computes: a run builds it as transformers does, never leaves it empty."""
    from transformers.models.falcon_h1.modeling_falcon_h1 import compute_mup_vector

    from memfit.models.build import make_config
    from memfit.spec import make_spec
    from memfit.train.loading import load_model

    loaded = load_model(FALCON_H1, make_spec(method="lora", precision="fp32"), torch.device("cpu"), init="random")
    expected = compute_mup_vector(make_config(FALCON_H1))
    for layer in loaded.model.get_base_model().model.layers:
        assert torch.equal(layer.mamba.mup_vector, expected)
