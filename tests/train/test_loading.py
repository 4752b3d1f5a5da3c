"""Loading: meta model -> weights straight onto the device -> adapters -> checks."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch import nn  # noqa: E402
from trainer_helpers import save_tiny_pretrained, tiny_model_dict  # noqa: E402

from memfit.models.build import make_config  # noqa: E402
from memfit.spec import make_spec  # noqa: E402
from memfit.step.prepare import SetupError, refuse_wrapped_model  # noqa: E402
from memfit.train.loading import (  # noqa: E402
    LoadError,
    checkpoint_files,
    load_model,
    resolve_device,
    verify_setup,
)

CPU = torch.device("cpu")


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize(
    "tie,shards,precision",
    [(True, None, "fp32"), (False, "40KB", "fp32"), (True, "40KB", "bf16")],
    ids=["tied-single-file", "untied-sharded", "tied-sharded-bf16"],
)
def test_logits_equal_from_pretrained(tmp_path, tie, shards, precision):
    from transformers import AutoModelForCausalLM

    folder = save_tiny_pretrained(tmp_path / "m", tie=tie, max_shard_size=shards)
    assert len(checkpoint_files(folder)) == (
        1
        if shards is None
        else len(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values()))
    )
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    loaded = load_model(
        tiny_model_dict(tie_word_embeddings=tie),
        make_spec(method="full", precision=precision, checkpointing="off"),
        CPU,
        weights_dir=folder,
    )
    model = loaded.model
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(reference, ids), _logits(model, ids))
    # nothing left on meta, every tensor on the device, rotary buffers recomputed like transformers does
    assert all(t.device == CPU for t in list(model.parameters()) + list(model.buffers()))
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == tie
    assert next(model.parameters()).dtype == dtype


def test_gemma3_checkpoint_loads_with_the_buffers_transformers_computes(tmp_path):
    # Gemma-3's scaled embedding keeps its scale in a buffer no checkpoint stores, on a module built
    # from arguments rather than a config: the model's initializer computes it, the loaded weights stay.
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    shape = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Gemma3TextConfig(**shape)).save_pretrained(tmp_path / "m")
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32)
    model = load_model(
        dict(shape, model_type="gemma3_text"),
        make_spec(method="full", precision="fp32", checkpointing="off"),
        CPU,
        weights_dir=tmp_path / "m",
    ).model
    buffers = dict(model.named_buffers())
    assert buffers.keys() == dict(reference.named_buffers()).keys()
    for name, value in reference.named_buffers():
        assert torch.equal(buffers[name], value), name
    assert float(buffers["model.embed_tokens.embed_scale"]) == 8.0  # sqrt(hidden_size)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(reference, ids), _logits(model, ids))


def test_lora_setup_is_verified(tmp_path):
    folder = save_tiny_pretrained(tmp_path / "m")
    loaded = load_model(
        tiny_model_dict(),
        make_spec(method="lora", rank=4, precision="fp32", checkpointing="on"),
        CPU,
        weights_dir=folder,
    )
    setup = loaded.setup
    # 2 layers x 7 linear layers, r x (in + out) each
    cfg = make_config(tiny_model_dict())
    h, i, kv = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads),
    )
    per_layer = 4 * ((h + h) * 2 + (h + kv) * 2 + (h + i) * 2 + (i + h))
    assert setup["trainable_params"] == setup["expected_trainable_params"] == 2 * per_layer
    assert setup["checkpointed_layers"] == setup["decoder_layers"] == 2
    frozen = [n for n, p in loaded.model.named_parameters() if "lora_" not in n]
    assert frozen and not any(p.requires_grad for n, p in loaded.model.named_parameters() if "lora_" not in n)


def test_qlora_quantizes_each_layer_on_the_device(tmp_path):
    bnb = pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional as bnbf
    from safetensors.torch import load_file

    folder = save_tiny_pretrained(tmp_path / "m")
    loaded = load_model(tiny_model_dict(), make_spec(method="qlora", rank=4, precision="bf16"), CPU, weights_dir=folder)
    dense = load_file(str(folder / "model.safetensors"))
    layers = [(n, m) for n, m in loaded.model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 14
    for name, module in layers:
        weight = module.weight
        assert weight.dtype == torch.uint8 and weight.bnb_quantized and weight.quant_state is not None
        key = name.replace("base_model.model.", "").replace(".base_layer", "") + ".weight"
        # exactly what bitsandbytes makes of the checkpoint tensor with memfit's NF4 settings
        packed, state = bnbf.quantize_4bit(
            dense[key].to(torch.bfloat16),
            blocksize=64,
            compress_statistics=True,
            quant_type="nf4",
            quant_storage=torch.uint8,
        )
        assert torch.equal(weight.data, packed)
        assert torch.equal(bnbf.dequantize_4bit(weight.data, weight.quant_state), bnbf.dequantize_4bit(packed, state))
    assert loaded.setup["trainable_params"] == loaded.setup["expected_trainable_params"] > 0


def test_random_init_is_seeded_and_on_device():
    spec = make_spec(method="full", precision="fp32", checkpointing="off")
    a = load_model(tiny_model_dict(), spec, CPU, init="random", seed=3).model
    b = load_model(tiny_model_dict(), spec, CPU, init="random", seed=3).model
    c = load_model(tiny_model_dict(), spec, CPU, init="random", seed=4).model
    wa, wb, wc = (m.model.layers[0].self_attn.q_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert torch.equal(a.model.norm.weight, torch.ones_like(a.model.norm.weight))
    std = float(wa.detach().std())
    assert 0.03 < std < 0.06  # normal(0, initializer_range) with smollm2's 1/24
    assert a.lm_head.weight is a.model.embed_tokens.weight


def test_checkpoint_mismatches_are_listed(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = save_tiny_pretrained(tmp_path / "m")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.9.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(LoadError) as info:
        load_model(tiny_model_dict(), make_spec(method="lora", precision="fp32"), CPU, weights_dir=folder)
    assert "model.layers.1.mlp.up_proj.weight" in str(info.value)
    assert "model.layers.9.extra.weight" in str(info.value)


def test_shape_mismatch_and_missing_files(tmp_path):
    folder = save_tiny_pretrained(tmp_path / "m")
    with pytest.raises(LoadError, match="checkpoint shape"):
        load_model(
            tiny_model_dict(intermediate_size=96), make_spec(method="full", precision="fp32"), CPU, weights_dir=folder
        )
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(LoadError, match="no model.safetensors"):
        checkpoint_files(empty)


def test_verify_setup_catches_silent_deoptimisations(tmp_path):
    spec = make_spec(method="lora", rank=4, precision="fp32", checkpointing="on")
    model = load_model(tiny_model_dict(), spec, CPU, init="random").model
    layer = model.base_model.model.model.layers[1]
    layer.gradient_checkpointing = False
    with pytest.raises(SetupError, match="checkpointing is on in 1 of 2"):
        verify_setup(model, spec)
    layer.gradient_checkpointing = True
    layer.mlp.down_proj.base_layer.weight.requires_grad_(True)
    with pytest.raises(SetupError, match="base weights are trainable"):
        verify_setup(model, spec)


def test_wrapped_models_are_refused():
    from transformers import AutoModelForCausalLM

    inner = AutoModelForCausalLM.from_config(make_config(tiny_model_dict()))
    refuse_wrapped_model(inner)  # a plain PreTrainedModel is fine

    class Wrapper(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

    with pytest.raises(SetupError) as info:
        refuse_wrapped_model(Wrapper(inner))
    assert "Wrapper is not a transformers PreTrainedModel" in str(info.value)
    assert "It wraps a LlamaForCausalLM" in str(info.value)


def test_device_names():
    assert resolve_device("cpu") == CPU
    with pytest.raises(LoadError, match="not supported"):
        resolve_device("mps")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == CPU
        with pytest.raises(LoadError, match="no CUDA device"):
            resolve_device("cuda:1")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_loading_onto_cuda_1_leaves_cuda_0_untouched(tmp_path):
    folder = save_tiny_pretrained(tmp_path / "m")
    before = torch.cuda.memory_allocated(0)
    device = resolve_device("cuda:1")
    loaded = load_model(tiny_model_dict(), make_spec(method="lora", precision="bf16"), device, weights_dir=folder)
    assert all(p.device == device for p in loaded.model.parameters())
    assert torch.cuda.memory_allocated(0) == before


# ------------------------------------------------------------------------------------------------
# Mixture-of-experts checkpoints: experts stored apart (as transformers saves them), or in MXFP4


def _saved_moe(tmp_path, name: str):
    import transformers

    from memfit.train.conformance import TINY_MODELS

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make_config(TINY_MODELS[name]), dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "m")
    return TINY_MODELS[name], tmp_path / "m"


def _experts_of(model):
    from memfit.models.experts import expert_modules

    return list(expert_modules(model.get_base_model() if hasattr(model, "get_base_model") else model).values())


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "deepseek_v2"])
def test_experts_stored_apart_load_into_the_fused_experts_as_transformers_loads_them(tmp_path, name):
    import transformers

    config, folder = _saved_moe(tmp_path, name)
    with safe_open_keys(folder) as keys:  # one tensor an expert (Mixtral's under their old names)
        assert any(".experts.0." in key for key in keys)
    want = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    got = load_model(config, make_spec(method="lora", precision="fp32"), torch.device("cpu"), weights_dir=folder).model
    for ours, theirs in zip(_experts_of(got), _experts_of(want), strict=True):
        assert torch.equal(ours.gate_up_proj, theirs.gate_up_proj) and torch.equal(ours.down_proj, theirs.down_proj)
    x = torch.randint(3, 500, (1, 12))
    with torch.no_grad():
        got.eval()
        assert torch.allclose(got.get_base_model()(input_ids=x).logits, want(input_ids=x).logits, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_four_bit_experts_are_quantized_expert_by_expert_as_they_load(tmp_path, name):
    from memfit.models.experts_nf4 import dequantized

    config, folder = _saved_moe(tmp_path, name)
    import transformers

    want = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    got = load_model(config, make_spec(method="qlora", precision="bf16"), torch.device("cpu"), weights_dir=folder).model
    for ours, theirs in zip(_experts_of(got), _experts_of(want), strict=True):
        for weight in ours.expert_weights:
            assert torch.equal(
                dequantized(ours, weight.name),
                _nf4_round_trip(getattr(theirs, weight.name).detach(), weight.transposed),
            )


def _nf4_round_trip(stack, transposed: bool):
    """Each expert of ``stack`` quantized by bitsandbytes as a 4-bit linear layer holds it, and back."""
    import bitsandbytes.functional as bnbf

    out = []
    for expert in stack:
        dense = (expert.t() if transposed else expert).contiguous()
        packed, state = bnbf.quantize_4bit(dense, blocksize=64, compress_statistics=True, quant_type="nf4")
        restored = bnbf.dequantize_4bit(packed, state)
        out.append(restored.t() if transposed else restored)
    return torch.stack(out)


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_gpt_oss_mxfp4_experts_are_dequantized_as_transformers_dequantizes_them(tmp_path, method):
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from memfit.models.experts_nf4 import dequantized

    config, folder = _saved_moe(tmp_path, "gpt_oss")
    state = load_file(str(folder / "model.safetensors"))
    generator = torch.Generator().manual_seed(1)
    expected = {}
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inner, outer = state.pop(
            key
        ).shape  # [experts, in, out]: the checkpoint keeps [experts, out, in / 32, 16]
        blocks = torch.randint(0, 256, (experts, outer, inner // 32, 16), dtype=torch.uint8, generator=generator)
        scales = torch.randint(120, 130, (experts, outer, inner // 32), dtype=torch.uint8, generator=generator)
        state[f"{key}_blocks"], state[f"{key}_scales"] = blocks, scales
        expected[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {**config, "quantization_config": {"quant_method": "mxfp4"}}
    model = load_model(
        config, make_spec(method=method, precision="bf16"), torch.device("cpu"), weights_dir=folder
    ).model
    for index, module in enumerate(_experts_of(model)):
        for weight in ("gate_up_proj", "down_proj"):
            want = expected[f"model.layers.{index}.mlp.experts.{weight}"]
            got = dequantized(module, weight) if method == "qlora" else getattr(module, weight)
            assert torch.equal(got, want if method == "lora" else _nf4_round_trip(want, transposed=True))


def test_a_checkpoint_missing_an_expert_names_the_weight(tmp_path):
    from safetensors.torch import load_file, save_file

    config, folder = _saved_moe(tmp_path, "qwen3_moe")
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        LoadError, match=r"expert weights with some experts missing: model\.layers\.1\.mlp\.experts\.gate_up_proj"
    ):
        load_model(config, make_spec(method="lora", precision="bf16"), torch.device("cpu"), weights_dir=folder)


class safe_open_keys:
    def __init__(self, folder):
        self.folder = folder

    def __enter__(self):
        from safetensors import safe_open

        with safe_open(str(self.folder / "model.safetensors"), "pt") as handle:
            return list(handle.keys())

    def __exit__(self, *exc):
        return False
