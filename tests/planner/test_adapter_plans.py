"""Plans of the adapter options: DoRA, rsLoRA, modules trained whole, an 8-bit base.

Each is planned through the same simulated step as the trainer runs; here the plan of the plain
Hugging Face + PEFT step (``recipe: hf``) is set against that step run for real on the CPU, with
the model made by transformers and PEFT themselves (not by memfit), and the plan's categories say
what each option adds.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from memfit.planner.api import plan
from memfit.planner.exact.cuda_parity import CudaParityMode
from memfit.planner.exact.simulate import simulate
from memfit.planner.exact.tracker import MemoryTracker
from memfit.spec import make_spec
from memfit.step.builder import build_step
from memfit.step.optim import build_optimizer

TINY_QWEN2_TIED = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
}


def _peft_model(config: dict, spec, tmp_path):
    """The model the plain stack trains: transformers builds it (8-bit through ``load_in_8bit`` from a
    saved checkpoint), PEFT prepares and wraps it, with the spec's LoRA settings."""
    import peft
    import transformers

    from memfit.models.build import DTYPES, make_config

    dtype = DTYPES[spec.weight_precision]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make_config(config), dtype=dtype, attn_implementation="sdpa")
    if spec.base_bits == 8:
        model.save_pretrained(tmp_path / "base")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "base",
            dtype=dtype,
            device_map="cpu",
            attn_implementation="sdpa",
            quantization_config=transformers.BitsAndBytesConfig(load_in_8bit=True),
        )
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=spec.checkpointing != "off")
    elif spec.checkpointing != "off":
        model.activation_checkpointing_enable()
    model.config.use_cache = False
    tied = bool(config.get("tie_word_embeddings")) and bool(spec.modules_to_save)
    lora = peft.LoraConfig(
        r=spec.rank,
        lora_alpha=spec.lora_alpha,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
        use_dora=spec.dora,
        use_rslora=spec.rslora,
        modules_to_save=list(spec.modules_to_save) or None,
        ensure_weight_tying=tied,
    )
    return peft.get_peft_model(model, lora)


def _measured_peak(model, spec) -> tuple[int, dict[str, int]]:
    """Two steps of the plan's step on the real model, counted as the planner counts (its tracker,
    its CUDA rewrites), from the first step on."""
    step = build_step(spec, model.get_base_model().config)
    ids = list(range(3, 3 + spec.seq_len))
    tracker = MemoryTracker()
    with tracker, CudaParityMode(tracker):
        model.train()
        tracker.mark_model(model)
        hooks = tracker.watch_gradients(model)
        optimizer = build_optimizer(model.parameters(), spec.optimizer)
        tracker.reset_peak()
        for _ in range(2):
            batches = [step.collate([{"input_ids": ids, "labels": ids}] * spec.batch_size, 0)]
            step(model, batches, optimizer, observer=tracker)
            del batches
            tracker.mark_optimizer(optimizer)
        for hook in hooks:
            hook.remove()
    result = tracker.result()
    return result.peak.allocated_bytes, result.peak.categories


CASES = {
    "dora": (None, dict(dora=True)),
    "rslora": (None, dict(rslora=True)),
    "embed+head untied": (None, dict(modules_to_save="embed_tokens,lm_head")),
    "head of a tied model": (TINY_QWEN2_TIED, dict(modules_to_save="lm_head")),
    "8-bit base": (None, dict(method="lora-8bit")),
}


@pytest.mark.parametrize("name", CASES)
def test_the_plan_of_the_plain_peft_step_equals_that_step_run_on_the_cpu(tiny_llama, tmp_path, name):
    if CASES[name][1].get("method") == "lora-8bit":
        pytest.importorskip("bitsandbytes")
    config, knobs = CASES[name]
    config = config or tiny_llama
    spec = make_spec(recipe="hf", seq_len=48, rank=8, **knobs)
    planned = simulate(config, spec).tracker.peak
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        measured_bytes, measured_categories = _measured_peak(_peft_model(config, spec, tmp_path), spec)
    assert measured_bytes == planned.allocated_bytes, (measured_categories, planned.categories)
    assert measured_categories == planned.categories


def test_what_each_option_adds_is_in_the_categories(tiny_llama):
    plain = simulate(tiny_llama, make_spec(seq_len=64, rank=8)).tracker.peak.categories
    dora = simulate(tiny_llama, make_spec(seq_len=64, rank=8, dora=True)).tracker.peak.categories
    saved = simulate(tiny_llama, make_spec(seq_len=64, rank=8, modules_to_save="lm_head")).tracker.peak.categories
    head_bytes = tiny_llama["vocab_size"] * tiny_llama["hidden_size"] * 2  # bf16
    # DoRA: a magnitude per output row of 7 layers x 2 (fp32), and weight-sized work in every forward
    assert dora["trainable"] > plain["trainable"] and dora["temporaries"] > plain["temporaries"]
    # the head trained whole: a bf16 copy, its gradient and two AdamW states, the frozen original kept
    assert saved["trainable"] - plain["trainable"] >= head_bytes
    assert saved["gradients"] - plain["gradients"] >= head_bytes
    assert saved["optimizer"] - plain["optimizer"] >= 2 * head_bytes
    assert saved["weights"] == plain["weights"]


def test_an_8bit_base_holds_int8_weights_with_a_scale_per_row(tiny_llama):
    pytest.importorskip("bitsandbytes")
    sixteen = simulate(tiny_llama, make_spec(seq_len=64, rank=8)).tracker.peak.categories
    eight = simulate(tiny_llama, make_spec(seq_len=64, rank=8, method="lora-8bit")).tracker.peak.categories
    h, i, kv = tiny_llama["hidden_size"], tiny_llama["intermediate_size"], 32
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i  # q, o, k, v, gate, up, down
    rows = h * 2 + kv * 2 + 2 * i + h
    layers = tiny_llama["num_hidden_layers"]
    # bf16 linear weights (2 bytes an element) became int8 (1 byte) + an fp32 scale a row, each its own 512-byte block
    linear_bf16 = layers * per_layer * 2
    assert sixteen["weights"] - eight["weights"] == pytest.approx(
        linear_bf16 / 2 - layers * 4 * rows, abs=layers * 7 * 2 * 512
    )


def test_the_plan_says_what_trains_and_how_the_base_is_stored():
    pytest.importorskip("bitsandbytes")
    result = plan(TINY_QWEN2_TIED, seq_len=64, rank=8, dora=True, modules_to_save="lm_head", rslora=True)
    adapters = result.details["adapters"]
    assert adapters == {
        "modules": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
        "dora": True,
        "rslora": True,
        "scale": 16 / 8**0.5,
        "base": "bf16",
        "modules_to_save": ["lm_head"],
        "trained_copies": [["embed_tokens", "lm_head"]],
    }
    helps = result.details["category_help"]
    assert helps["trainable"] == (
        "LoRA A/B + DoRA magnitudes (one per output row) + a trainable copy of embed_tokens = lm_head (tied: one copy)"
    )
    assert "DoRA: every adapted weight" in helps["temporaries"]
    assert any(
        "embed_tokens and lm_head are one tensor in this model (tied): one trainable copy serves both" in n
        for n in result.details["notes"]
    )
    eight = plan(TINY_QWEN2_TIED, seq_len=64, rank=8, method="lora-8bit")
    assert eight.details["category_help"]["weights"].startswith(
        "frozen base: int8 linear layers + an fp32 scale per row"
    )
    assert "8-bit layers keep their inputs even under checkpointing" in eight.details["category_help"]["activations"]
    assert any("outlier columns" in n for n in eight.details["notes"])
    assert plan(TINY_QWEN2_TIED, seq_len=64, method="full").details["adapters"] is None


def test_the_table_shows_the_options_in_its_title_and_categories():
    from rich.console import Console

    result = plan(TINY_QWEN2_TIED, seq_len=64, rank=8, dora=True, modules_to_save="lm_head")
    console = Console(record=True, width=200)
    result.render(console)
    text = console.export_text()
    assert "lora r=8 DoRA + lm_head trained whole" in text
    assert "a trainable copy of embed_tokens = lm_head (tied: one copy)" in text
    assert "LoRA inputs kept in the compute dtype" not in text  # DoRA layers keep PEFT's fp32 input


def test_8bit_layers_keep_their_inputs_under_checkpointing(tiny_llama):
    pytest.importorskip("bitsandbytes")
    # bitsandbytes' 8-bit matmul holds its input on its autograd context, not as a saved tensor, so
    # activation checkpointing cannot drop it: the plan shows it as activations.
    kept = simulate(tiny_llama, make_spec(seq_len=64, rank=8, method="lora-8bit")).tracker.peak.categories[
        "activations"
    ]
    plain = simulate(tiny_llama, make_spec(seq_len=64, rank=8)).tracker.peak.categories["activations"]
    h, i, tokens = tiny_llama["hidden_size"], tiny_llama["intermediate_size"], 64
    inputs_per_layer = (3 * h + i) * tokens * 2  # q/k/v and gate/up share their input; o and down have their own
    assert kept - plain >= inputs_per_layer
