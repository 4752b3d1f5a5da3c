"""What the rendered plan says about the step it planned."""

from __future__ import annotations

from rich.console import Console

import memfit
from memfit.planner.report import step_features, suggestions


def _rendered(plan) -> str:
    console = Console(record=True, width=200)
    plan.render(console)
    return console.export_text()


def test_plan_names_the_attention_kernel_and_the_lean_techniques():
    text = _rendered(memfit.plan("smollm2-135m", seq_len=256, checkpointing="offload"))
    assert "attention: sdpa: flash / memory-efficient kernel, no [seq x seq] attention matrix kept" in text
    assert "memory-lean step: fused chunked loss, offloaded checkpointing with prefetch" in text


def test_hf_recipe_plan_says_so_and_lists_no_lean_technique():
    text = _rendered(memfit.plan("smollm2-135m", seq_len=256, recipe="hf"))
    assert "recipe hf" in text
    assert "memory-lean step" not in text


def test_features_follow_the_knobs():
    base = dict(method="full", rank=16, alpha=None, dropout=0.0, targets=["all-linear"], precision="bf16", optimizer="adamw",
                batch_size=1, seq_len=16384, grad_accum=1, checkpointing="on", gpus=1, shard="none", tiling="auto",
                step_in_backward=True, recipe="memfit")
    assert step_features(base) == ["fused chunked loss", "tiled MLP and norms", "optimizer step in backward"]
    assert "tiled MLP and norms" not in step_features(dict(base, seq_len=1024))
    assert "--step-in-backward (train with max_grad_norm: null)" in suggestions(dict(base, step_in_backward=False))
