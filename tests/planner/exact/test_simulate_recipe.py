"""``--recipe hf``: the planner simulates the plain Hugging Face + PEFT step next to memfit's."""

from __future__ import annotations

import pytest
import torch

from memfit.models.build import DTYPES, build_meta_model, make_config
from memfit.planner.exact.simulate import simulate
from memfit.spec import make_spec
from memfit.step.prepare import prepare_like_hf


def _largest_allocation(result) -> int:
    return max(a.nbytes for a in result.allocations)


def test_hf_qlora_upcasts_every_non_4bit_parameter_to_fp32(tiny_llama):
    spec = make_spec(method="qlora", recipe="hf")
    model = prepare_like_hf(build_meta_model(make_config(tiny_llama), DTYPES[spec.weight_precision]), spec)
    dtypes = {type(p).__name__ == "Params4bit": set() for p in model.parameters()}
    for p in model.parameters():
        dtypes[type(p).__name__ == "Params4bit"].add(p.dtype)
    assert dtypes[True] == {torch.uint8}
    # Embeddings, norms and the output head: fp32, as PEFT's prepare_model_for_kbit_training leaves
    # them; the adapters are fp32 in both recipes.
    assert dtypes[False] == {torch.float32}


def test_hf_qlora_without_kbit_preparation_keeps_the_compute_dtype(tiny_llama):
    spec = make_spec(method="qlora", recipe="hf", kbit_upcast=False)
    model = prepare_like_hf(build_meta_model(make_config(tiny_llama), DTYPES[spec.precision]), spec)
    frozen = {p.dtype for p in model.parameters() if type(p).__name__ != "Params4bit" and not p.requires_grad}
    assert frozen == {torch.bfloat16}  # embeddings, norms and head as loaded (LLaMA-Factory, TRL since 0.22)
    upcast = simulate(tiny_llama, make_spec(method="qlora", recipe="hf", seq_len=64)).tracker
    kept = simulate(tiny_llama, make_spec(method="qlora", recipe="hf", seq_len=64, kbit_upcast=False)).tracker
    assert kept.peak.categories["weights"] < upcast.peak.categories["weights"]


def test_kbit_upcast_off_is_the_hf_recipe_s_choice():
    from memfit.spec import SpecError

    with pytest.raises(SpecError, match="--kbit-upcast: off is a choice of the hf recipe"):
        make_spec(method="qlora", kbit_upcast=False)


def test_hf_recipe_materialises_the_whole_fp32_logits(tiny_llama):
    config = dict(tiny_llama, vocab_size=32768)  # a vocabulary large enough for logits to matter
    tokens = 2048
    logits_bytes = tokens * config["vocab_size"] * 4
    hf = simulate(config, make_spec(method="lora", seq_len=tokens, recipe="hf")).tracker
    memfit = simulate(config, make_spec(method="lora", seq_len=tokens)).tracker
    assert _largest_allocation(hf) >= logits_bytes
    # memfit's fused loss holds one chunk of 1,024 tokens' logits at a time.
    assert _largest_allocation(memfit) < logits_bytes
    assert memfit.peak.allocated_bytes < hf.peak.allocated_bytes


@pytest.mark.parametrize(
    "knobs",
    [dict(method="lora", checkpointing="on"), dict(method="full", checkpointing="off", precision="fp32")],
    ids=lambda k: f"{k['method']}-{k['checkpointing']}",
)
def test_hf_recipe_fake_run_counts_the_same_bytes_as_a_real_run(tiny_llama, knobs):
    spec = make_spec(seq_len=64, batch_size=2, recipe="hf", **knobs)
    fake = simulate(tiny_llama, spec, fake=True).tracker
    real = simulate(tiny_llama, spec, fake=False).tracker
    assert fake.peak.allocated_bytes == real.peak.allocated_bytes
    assert fake.peak.categories == real.peak.categories


def test_hf_recipe_steps_in_backward_as_memfit_s_step_does(tiny_llama):
    # torchtune's optimizer_in_bwd on the hf recipe's model (its row: bf16, checkpointing, its compiled
    # chunked loss): each parameter's own optimizer runs from its gradient hook, so the gradients never
    # all exist; a fake run counts what a real one does.
    config = dict(tiny_llama, num_hidden_layers=4)
    knobs = dict(method="full", seq_len=64, recipe="hf", checkpointing="on", hf_loss="chunked-output-compiled")
    spec = make_spec(**knobs, step_in_backward=True, max_grad_norm=None)
    fake = simulate(config, spec, fake=True).tracker
    real = simulate(config, spec, fake=False).tracker
    assert fake.peak.allocated_bytes == real.peak.allocated_bytes
    assert fake.peak.categories == real.peak.categories
    normal = simulate(config, make_spec(**knobs)).tracker
    gradients = [max(r.categories_at(i)["gradients"] for i in range(len(r.events))) for r in (fake, normal)]
    assert gradients[0] <= gradients[1] // 4


def test_step_in_backward_keeps_the_foreach_adamw_it_is_given():
    from memfit.step.optim import build_optimizer

    params = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2))]
    inner = build_optimizer(params, "adamw", step_in_backward=True, adamw_impl="foreach").inner_optimizers
    assert [o.defaults["fused"] for o in inner] == [None, None]
    fused = build_optimizer(params, "adamw", step_in_backward=True).inner_optimizers
    assert [o.defaults["fused"] for o in fused] == [True, True]


def test_hf_recipe_with_flash_attention_keeps_attention_inside_each_example(tiny_llama):
    # padding_free: on is transformers with flash attention: packed or padded, each example's
    # attention runs on its own tokens (varlen), no [seq x seq] mask or scores.
    tokens, batch = 1024, 2
    # Every other tensor grows with the tokens, a mask with their square: long enough to tell apart.
    tiny_llama = dict(tiny_llama, vocab_size=64, max_position_embeddings=tokens)
    masked = simulate(tiny_llama, make_spec(method="lora", seq_len=tokens, batch_size=batch, recipe="hf", packing=True))
    varlen = simulate(
        tiny_llama,
        make_spec(method="lora", seq_len=tokens, batch_size=batch, recipe="hf", packing=True, padding_free="on"),
    )
    assert varlen.batch_layout == "documents" and varlen.attention == "memfit_documents"
    square = batch * tokens * tokens  # one byte a [seq x seq] element: the smallest a mask can be
    forward = lambda result: max(a.nbytes for a in result.tracker.allocations if a.phase == "forward")  # noqa: E731
    assert forward(masked) >= square
    assert forward(varlen) < square
    assert varlen.tracker.peak.allocated_bytes < masked.tracker.peak.allocated_bytes


def test_hf_recipe_with_flash_attention_fake_run_counts_the_same_bytes_as_a_real_run(tiny_llama):
    spec = make_spec(method="lora", seq_len=64, batch_size=2, recipe="hf", padding_free="on", precision="fp32")
    fake = simulate(tiny_llama, spec, fake=True).tracker
    real = simulate(tiny_llama, spec, fake=False).tracker
    assert fake.peak.allocated_bytes == real.peak.allocated_bytes
    assert fake.peak.categories == real.peak.categories


def test_use_reentrant_auto_follows_how_the_hf_recipe_prepares_the_model():
    # PEFT's prepare_model_for_kbit_training leaves the variant to torch, whose default is reentrant;
    # transformers 5 checkpoints non-reentrant; memfit's step always does.
    assert make_spec(method="qlora", recipe="hf").reentrant_checkpointing
    assert not make_spec(method="qlora", recipe="hf", kbit_upcast=False).reentrant_checkpointing
    assert not make_spec(method="lora", recipe="hf").reentrant_checkpointing
    assert make_spec(method="lora", recipe="hf", use_reentrant="on").reentrant_checkpointing
    assert not make_spec(method="lora-8bit", recipe="hf", use_reentrant="off").reentrant_checkpointing
    assert not make_spec(method="lora", recipe="hf", use_reentrant="on", checkpointing="off").reentrant_checkpointing
    assert not make_spec(method="lora").reentrant_checkpointing


def test_use_reentrant_on_is_the_hf_recipe_s_choice():
    from memfit.spec import SpecError

    with pytest.raises(SpecError, match="--use-reentrant on is a choice of the hf recipe"):
        make_spec(method="lora", use_reentrant="on")


def _checkpointed_functions(model) -> set[bool]:
    """The ``use_reentrant`` of each decoder layer's checkpoint function."""
    return {
        module._gradient_checkpointing_func.keywords.get("use_reentrant")
        for module in model.modules()
        if getattr(module, "gradient_checkpointing", False)
    }


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_hf_recipe_checkpoints_with_the_variant_named(tiny_llama, method):
    for setting, expected in (("on", True), ("off", False)):
        spec = make_spec(method=method, recipe="hf", use_reentrant=setting)
        model = prepare_like_hf(build_meta_model(make_config(tiny_llama), DTYPES[spec.weight_precision]), spec)
        assert _checkpointed_functions(model) == {expected}


def test_8bit_layers_keep_their_inputs_only_under_non_reentrant_checkpointing(tiny_llama):
    # bitsandbytes' MatMul8bitLt keeps its input as an attribute of its autograd context, which
    # non-reentrant checkpointing's hooks do not see: every 8-bit layer's input lives until its
    # backward. Reentrant checkpointing runs the layer's forward under no_grad: no context at all.
    tokens = 512
    knobs = dict(method="lora-8bit", recipe="hf", seq_len=tokens, kbit_upcast=False)
    kept = simulate(tiny_llama, make_spec(**knobs, use_reentrant="off")).tracker
    dropped = simulate(tiny_llama, make_spec(**knobs, use_reentrant="on")).tracker
    # Per layer at least the inputs of the attention's and the MLP's projections (two hidden-size
    # tensors in bf16, q/k/v sharing one) stay under non-reentrant checkpointing.
    floor = tiny_llama["num_hidden_layers"] * 2 * tokens * tiny_llama["hidden_size"] * 2
    assert kept.peak.allocated_bytes - dropped.peak.allocated_bytes >= floor


@pytest.mark.parametrize("method", ["lora", "full"])
def test_hf_recipe_reentrant_fake_run_counts_the_same_bytes_as_a_real_run(tiny_llama, method):
    spec = make_spec(method=method, seq_len=64, batch_size=2, recipe="hf", use_reentrant="on", precision="fp32")
    fake = simulate(tiny_llama, spec, fake=True).tracker
    real = simulate(tiny_llama, spec, fake=False).tracker
    assert fake.peak.allocated_bytes == real.peak.allocated_bytes
    assert fake.peak.categories == real.peak.categories


def test_adapters_in_the_compute_dtype_halve_what_they_and_their_states_take(tiny_llama):
    # torchtune builds its adapters in bf16 (TRL casts a quantized model's to bf16 too): the
    # adapters, their gradients and AdamW's two states take half of PEFT's fp32.
    knobs = dict(method="lora", seq_len=64, recipe="hf", precision="bf16")
    fp32 = simulate(tiny_llama, make_spec(**knobs)).tracker
    spec = make_spec(**knobs, adapter_dtype="compute")
    half = simulate(tiny_llama, spec, fake=True).tracker
    ours, peft = half.categories_at(len(half.events) - 1), fp32.categories_at(len(fp32.events) - 1)
    assert 2 * ours["trainable"] == peft["trainable"]
    # AdamW's two states at half size: together as much less as the fp32 adapters take (the step
    # counters stay fp32).
    assert peft["optimizer"] - ours["optimizer"] == peft["trainable"]
    real = simulate(tiny_llama, spec, fake=False).tracker
    assert half.peak.allocated_bytes == real.peak.allocated_bytes
    assert half.peak.categories == real.peak.categories


def test_adapter_dtype_compute_is_a_choice_of_the_hf_recipe_s_adapters():
    from memfit.spec import SpecError

    for knobs in (dict(method="lora"), dict(method="full", recipe="hf")):
        with pytest.raises(SpecError, match="--adapter-dtype compute is a choice of the hf recipe's adapters"):
            make_spec(adapter_dtype="compute", **knobs)
    assert "bf16 adapters" in make_spec(method="qlora", recipe="hf", adapter_dtype="compute").precision_regime
    assert "other weights fp32" not in make_spec(method="qlora", recipe="hf", kbit_upcast=False).precision_regime


@pytest.mark.parametrize("layers", [2, 4])
def test_what_the_math_kernel_keeps_goes_with_a_checkpointed_forward(tiny_llama, layers):
    # fp32 with grouped-query heads and no padding mask: CUDA's SDPA runs its math kernel, which keeps
    # the softmax for backward. A non-reentrant checkpoint's first forward keeps nothing, so that
    # goes with the layer's output; only the recomputation's is there for backward.
    config = dict(tiny_llama, num_hidden_layers=layers)
    spec = make_spec(method="full", precision="fp32", seq_len=64, batch_size=1, recipe="hf", checkpointing="on")
    fake = simulate(config, spec, fake=True)
    real = simulate(config, spec, fake=False).tracker
    assert "math" in fake.attention_kernels
    assert fake.tracker.peak.allocated_bytes == real.peak.allocated_bytes
    assert fake.tracker.peak.categories == real.peak.categories
    # What forward keeps grows by a checkpointed layer's input per layer, not by a softmax.
    kept = [simulate(dict(config, num_hidden_layers=n), spec).tracker for n in (layers, layers + 1)]
    growth = kept[1].peak.categories["activations"] - kept[0].peak.categories["activations"]
    assert growth <= 64 * config["hidden_size"] * 4 + 512
