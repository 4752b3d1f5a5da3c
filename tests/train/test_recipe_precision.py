"""Mixed precision in the trainer: fp32 weights (a 16-bit frozen LoRA base), forward under autocast,
fp16's loss scaler; trained on the CPU, whose autocast runs bf16 and fp16."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trainer_helpers import tiny_config  # noqa: E402

from memfit.train.checkpointing import latest_checkpoint  # noqa: E402
from memfit.train.recipe import train  # noqa: E402


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _record_q_proj_outputs(monkeypatch) -> list[torch.dtype]:
    """The dtype of the first decoder layer's query projection at every forward of the run."""
    from memfit.train import recipe

    seen: list[torch.dtype] = []
    prepare = recipe.load_model

    def load_and_hook(*args, **kwargs):
        loaded = prepare(*args, **kwargs)
        base = loaded.model.get_base_model() if hasattr(loaded.model, "get_base_model") else loaded.model
        base.model.layers[0].self_attn.q_proj.register_forward_hook(lambda module, a, out: seen.append(out.dtype))
        return loaded

    monkeypatch.setattr(recipe, "load_model", load_and_hook)
    return seen


def test_bf16_mixed_full_fine_tuning_trains_fp32_weights_under_bf16_autocast(tmp_path, monkeypatch):
    seen = _record_q_proj_outputs(monkeypatch)
    config = tiny_config(tmp_path / "run", method="full", precision="bf16-mixed", max_steps=8, lr=2e-3, batch_size=8)
    result = train(config, progress=False)
    assert result.status == "completed"
    assert {p.dtype for p in result.model.parameters()} == {torch.float32}  # the master weights
    assert {p.grad for p in result.model.parameters()} == {None}  # freed after each step
    assert seen and set(seen) == {torch.bfloat16}  # forward (and its recomputation) in bf16
    state = torch.load(latest_checkpoint(tmp_path / "run") / "state.pt", weights_only=True)
    exp_avg = [s["exp_avg"] for s in state["optimizer"]["state"].values()]
    assert exp_avg and {t.dtype for t in exp_avg} == {torch.float32}  # fp32 AdamW states
    assert state["grad_scaler"] is None  # bf16 has fp32's range: no loss scaling
    losses = [loss for _, loss in result.losses]
    assert all(loss == loss for loss in losses)
    assert _mean(losses[-3:]) < _mean(losses[:3]), losses


def test_bf16_mixed_lora_keeps_the_frozen_base_in_bf16(tmp_path, monkeypatch):
    seen = _record_q_proj_outputs(monkeypatch)
    config = tiny_config(tmp_path / "run", precision="bf16-mixed", max_steps=6, lr=1e-2, batch_size=8)
    result = train(config, progress=False)
    params = list(result.model.named_parameters())
    assert {p.dtype for _, p in params if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for n, p in params if p.requires_grad} == {torch.float32} and all(
        "lora_" in n for n, p in params if p.requires_grad
    )
    assert set(seen) == {torch.bfloat16}
    losses = [loss for _, loss in result.losses]
    assert _mean(losses[-2:]) < _mean(losses[:2]), losses


def test_fp16_mixed_scales_the_loss_and_checkpoints_the_scaler(tmp_path, monkeypatch):
    seen = _record_q_proj_outputs(monkeypatch)
    config = tiny_config(tmp_path / "run", method="full", precision="fp16-mixed", max_steps=3)
    result = train(config, progress=False)
    assert result.status == "completed"
    assert {p.dtype for p in result.model.parameters()} == {torch.float32}
    assert set(seen) == {torch.float16}
    state = torch.load(latest_checkpoint(tmp_path / "run") / "state.pt", weights_only=True)
    assert state["grad_scaler"] is not None and state["grad_scaler"]["scale"] > 0
