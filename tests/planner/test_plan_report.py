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
    assert "attention: memfit: each micro-batch's examples in one row, attention inside each example" in text
    assert (
        "memory-lean step: fused chunked loss, padding-free batches (attention inside each example), offloaded" in text
    )
    padded = _rendered(memfit.plan("smollm2-135m", seq_len=256, padding_free="off"))
    assert "attention: sdpa: flash kernel, no [seq x seq] attention matrix kept" in padded
    assert "padding-free" not in padded


def test_plan_flags_the_math_kernel_with_its_cost_and_the_fix():
    # fp32 with grouped-query heads: transformers asks SDPA for them as such; CUDA has no flash
    # kernel for fp32 and its memory-efficient kernel does not take them: the math kernel runs.
    plan = memfit.plan("llama-3.2-1b", seq_len=1024, precision="fp32", padding_free="off", gpu="a100-80gb")
    assert plan.details["attention_kernels"] == ["math"]
    note = next(n for n in plan.details["notes"] if "math kernel" in n)
    assert "128.0 MiB of [batch x heads x seq x seq] scores a layer" in note and "--padding-free auto" in note
    lean = memfit.plan("llama-3.2-1b", seq_len=1024, precision="fp32", gpu="a100-80gb")
    assert lean.details["attention_kernels"] == [] and lean.details["batch_layout"] == "documents"
    # Checkpointed, a layer's scores exist only while it is recomputed; kept by every layer, they add up.
    kept = [
        memfit.plan("llama-3.2-1b", seq_len=1024, precision="fp32", gpu="a100-80gb", checkpointing="off", **extra)
        for extra in ({"padding_free": "off"}, {})
    ]
    assert kept[1].device_total_bytes < kept[0].device_total_bytes
    # bf16 on an Ampere card: flash; on a Turing card (no flash), fp16 with grouped-query heads: math.
    assert memfit.plan("llama-3.2-1b", seq_len=512, padding_free="off", gpu="a100-80gb").details[
        "attention_kernels"
    ] == ["flash"]
    assert memfit.plan("llama-3.2-1b", seq_len=512, padding_free="off", precision="fp16", gpu="t4").details[
        "attention_kernels"
    ] == ["math"]


def test_hf_recipe_plan_says_so_and_lists_no_lean_technique():
    text = _rendered(memfit.plan("smollm2-135m", seq_len=256, recipe="hf"))
    assert "recipe hf" in text
    assert "memory-lean step" not in text
    assert "loss" not in text.splitlines()[0]  # the model's own loss goes unsaid
    chunked = _rendered(memfit.plan("smollm2-135m", seq_len=256, recipe="hf", hf_loss="chunked-ce"))
    assert "recipe hf (plain Hugging Face + PEFT step), loss chunked-ce" in chunked.splitlines()[0]


def test_features_follow_the_knobs():
    base = dict(
        method="full",
        rank=16,
        alpha=None,
        dropout=0.0,
        targets=["all-linear"],
        precision="bf16",
        optimizer="adamw",
        batch_size=1,
        seq_len=16384,
        grad_accum=1,
        checkpointing="on",
        gpus=1,
        shard="none",
        tiling="auto",
        step_in_backward=True,
        recipe="memfit",
    )
    assert step_features(base) == ["fused chunked loss", "tiled MLP and norms", "optimizer step in backward"]
    assert "tiled MLP and norms" not in step_features(dict(base, seq_len=1024))
    assert "--step-in-backward --max-grad-norm none" in suggestions(dict(base, step_in_backward=False))


def test_plan_says_what_its_precision_means_on_a_line_of_its_own(tiny_llama):
    for knobs, regime in (
        (dict(method="full", precision="bf16"), "pure bf16: weights, gradients and optimizer states in bf16"),
        (
            dict(method="full", precision="bf16-mixed"),
            "bf16 mixed: fp32 weights, gradients and optimizer states, bf16 autocast",
        ),
        (dict(method="lora", precision="bf16"), "bf16 base, fp32 adapters"),
    ):
        plan = memfit.plan(tiny_llama, seq_len=64, **knobs)
        assert plan.to_dict()["details"]["precision_regime"] == regime
        console = Console(record=True, width=80)  # a terminal's width: the line is not wrapped
        plan.render(console)
        lines = console.export_text().splitlines()
        assert f" · {knobs['precision']} · " in lines[0]
        assert lines[1].strip() == regime


def test_a_mixed_precision_full_plan_that_does_not_fit_suggests_pure_bf16():
    base = dict(
        method="full",
        precision="bf16-mixed",
        optimizer="adamw",
        batch_size=1,
        seq_len=2048,
        grad_accum=1,
        checkpointing="on",
        tiling="auto",
    )
    assert any(tip.startswith("--precision bf16 ") for tip in suggestions(base))
    assert not any(tip.startswith("--precision") for tip in suggestions(dict(base, precision="bf16")))


def test_a_hybrid_plan_counts_its_kinds_of_layer_and_names_its_mixers_path():
    from memfit.planner.report import layer_lines

    details = {
        "layer_kinds": [{"kind": "linear_attention", "layers": 36}, {"kind": "full_attention", "layers": 4}],
        "simulated_layers": [3, 4, 4],
        "sequence_mixers": {
            "simulated": "pytorch",
            "run": "pytorch",
            "packages": ["causal-conv1d", "mamba-ssm"],
            "installed": [],
        },
    }
    assert layer_lines(details) == [
        "decoder layers: 36 linear_attention, 4 full_attention (simulated 3, 4, 4 layers, each kind counted by its number)",
        "sequence mixers: simulated on transformers' PyTorch path (causal-conv1d, mamba-ssm not installed)",
    ]
    installed = dict(details["sequence_mixers"], run="fused kernels", installed=["causal-conv1d", "mamba-ssm"])
    assert layer_lines({"sequence_mixers": installed}) == [
        "sequence mixers: simulated on transformers' PyTorch path (the run calls causal-conv1d, mamba-ssm's kernels)"
    ]
    assert layer_lines({"layer_kinds": [{"kind": "LlamaDecoderLayer", "layers": 16}], "sequence_mixers": None}) == []


def test_an_8bit_plan_says_what_its_checkpointing_variant_keeps(tiny_llama):
    knobs = dict(method="lora-8bit", recipe="hf", kbit_upcast=False, seq_len=64)
    kept = memfit.plan(tiny_llama, use_reentrant="off", **knobs)
    reentrant = memfit.plan(tiny_llama, use_reentrant="on", **knobs)
    assert "8-bit layers keep their inputs even under checkpointing" in kept.details["category_help"]["activations"]
    assert "8-bit layers" not in reentrant.details["category_help"]["activations"]
    assert "checkpointing on (reentrant)" in _rendered(reentrant)
    assert "(reentrant)" not in _rendered(kept) and "reentrant_checkpointing" not in kept.details
