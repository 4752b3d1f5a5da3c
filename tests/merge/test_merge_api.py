"""memfit's streamed merge gives the same tensors, bit for bit, as PEFT's merge_and_unload."""

from __future__ import annotations

import json
import warnings

import pytest
from merge_helpers import (
    assert_same_tensors,
    gpt2_config,
    llama_config,
    peft_merge,
    qwen2_config,
    save_adapter,
    save_base,
)

from memfit.merge import MergeError, merge

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _compare(tmp_path, base, adapter, dtype, **merge_kwargs):
    ours = tmp_path / "ours"
    result = merge(base, adapter, ours, progress=False, **merge_kwargs)
    reference = peft_merge(base, adapter, tmp_path / "peft", dtype)
    assert_same_tensors(ours, reference)
    return result, ours, reference


def test_plain_lora_bf16_sharded_matches_peft_and_loads(tmp_path, llama_bf16, plain_adapter):
    result, ours, reference = _compare(tmp_path, llama_bf16, plain_adapter, torch.bfloat16)
    assert result.shard_count > 2
    assert result.merged_tensor_count == 3 * 2  # q, v, down in 2 layers
    index = json.loads((ours / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in ours.glob("*.safetensors")}
    assert (ours / "tokenizer_config.json").is_file() and (ours / "chat_template.jinja").is_file()
    assert (ours / "generation_config.json").is_file()
    assert not list(tmp_path.glob("*.partial-*"))

    # the merged folder loads with transformers and computes what PEFT's merged model computes
    ids = torch.tensor([[1, 5, 9, 200, 3]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(ours, dtype=torch.bfloat16)
        want = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.bfloat16)
        import peft

        unmerged = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(llama_bf16, dtype=torch.bfloat16), plain_adapter
        )
    with torch.no_grad():
        logits = model(ids).logits
        assert torch.equal(logits, want(ids).logits)
        # against the unmerged adapter only up to bf16 rounding of the merged weights
        assert torch.allclose(logits.float(), unmerged(ids).logits.float(), atol=0.1, rtol=0.05)


def test_fp32_base_matches_peft(tmp_path, llama_fp32):
    adapter = save_adapter(
        llama_fp32, tmp_path / "adapter", torch.float32, r=8, lora_alpha=16, target_modules="all-linear"
    )
    _compare(tmp_path, llama_fp32, adapter, torch.float32)


def test_rslora_with_rank_and_alpha_patterns(tmp_path, llama_bf16):
    adapter = save_adapter(
        llama_bf16,
        tmp_path / "adapter",
        torch.bfloat16,
        r=4,
        lora_alpha=8,
        use_rslora=True,
        target_modules=["q_proj", "k_proj", "o_proj", "gate_proj"],
        # a suffix key, a full-path key and a regex key, as PEFT matches them
        rank_pattern={"o_proj": 2, "model.layers.1.self_attn.q_proj": 6, r"layers\.0\.mlp\..*_proj": 3},
        alpha_pattern={"k_proj": 3, "model.layers.0.self_attn.q_proj": 5},
    )
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["use_rslora"] and config["rank_pattern"]
    result, _, _ = _compare(tmp_path, llama_bf16, adapter, torch.bfloat16)
    assert result.merged_tensor_count == 8


def test_qwen2_attention_bias(tmp_path):
    base = save_base(qwen2_config(), tmp_path / "base", torch.bfloat16)
    adapter = save_adapter(base, tmp_path / "adapter", torch.bfloat16, r=4, lora_alpha=4, target_modules="all-linear")
    _compare(tmp_path, base, adapter, torch.bfloat16)


def test_gpt2_conv1d_fan_in_fan_out(tmp_path):
    base = save_base(gpt2_config(), tmp_path / "base", torch.float32, max_shard_size="100KB")
    adapter = save_adapter(
        base,
        tmp_path / "adapter",
        torch.float32,
        r=4,
        lora_alpha=8,
        fan_in_fan_out=True,
        target_modules=["c_attn", "c_proj", "c_fc"],
    )
    result, _, _ = _compare(tmp_path, base, adapter, torch.float32)
    assert result.merged_tensor_count == 2 * 4  # attn c_attn, attn c_proj, mlp c_fc, mlp c_proj


def test_bf16_adapter_weights(tmp_path, llama_fp32):
    """Adapter tensors saved in bf16 are upcast exactly as PEFT's loader does."""
    adapter = save_adapter(
        llama_fp32, tmp_path / "adapter", torch.float32, r=4, lora_alpha=8, target_modules=["q_proj"]
    )
    from safetensors.torch import load_file, save_file

    path = adapter / "adapter_model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(path).items()}, path, metadata={"format": "pt"})
    _compare(tmp_path, llama_fp32, adapter, torch.float32)


def test_untied_modules_to_save(tmp_path, llama_bf16):
    adapter = save_adapter(
        llama_bf16,
        tmp_path / "adapter",
        torch.bfloat16,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj"],
        modules_to_save=["lm_head"],
    )
    result, _, _ = _compare(tmp_path, llama_bf16, adapter, torch.bfloat16)
    assert result.replaced_tensor_count == 1 and not result.untied_embeddings


@pytest.mark.parametrize(
    "lora_kwargs, untied",
    [
        (dict(target_modules=["q_proj", "lm_head"]), False),  # LoRA on the tied head changes the shared tensor
        (dict(target_modules=["q_proj", "embed_tokens"]), False),  # embedding LoRA
        (dict(target_modules=["embed_tokens", "lm_head"]), False),  # both deltas on one tensor, in PEFT's order
        (dict(target_modules=["q_proj", "embed_tokens"], ensure_weight_tying=True), False),
        (dict(target_modules=["q_proj"], modules_to_save=["lm_head"]), True),  # the head gets its own tensor
        (dict(target_modules=["q_proj"], modules_to_save=["embed_tokens"]), True),
        (dict(target_modules=["q_proj"], modules_to_save=["embed_tokens"], ensure_weight_tying=True), False),
    ],
    ids=["lora-lm_head", "lora-embed", "lora-both", "lora-embed-tying", "mts-lm_head", "mts-embed", "mts-embed-tying"],
)
def test_tied_embeddings(tmp_path, llama_tied, lora_kwargs, untied):
    adapter = save_adapter(llama_tied, tmp_path / "adapter", torch.bfloat16, r=4, lora_alpha=8, **lora_kwargs)
    result, ours, reference = _compare(tmp_path, llama_tied, adapter, torch.bfloat16)
    assert result.untied_embeddings is untied
    ours_config = json.loads((ours / "config.json").read_text())
    want_config = json.loads((reference / "config.json").read_text())
    assert ours_config["tie_word_embeddings"] == want_config["tie_word_embeddings"] == (not untied)


def test_single_file_base(tmp_path):
    base = save_base(llama_config(), tmp_path / "base", torch.bfloat16, max_shard_size="50MB")
    assert (base / "model.safetensors").is_file()
    adapter = save_adapter(base, tmp_path / "adapter", torch.bfloat16, r=4, lora_alpha=8, target_modules=["v_proj"])
    result, ours, _ = _compare(tmp_path, base, adapter, torch.bfloat16)
    assert result.shard_count == 1 and not (ours / "model.safetensors.index.json").exists()


def test_dtype_cast_down_equals_peft_then_cast(tmp_path, llama_fp32):
    adapter = save_adapter(
        llama_fp32, tmp_path / "adapter", torch.float32, r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"]
    )
    ours = tmp_path / "ours"
    result = merge(llama_fp32, adapter, ours, dtype="bf16", progress=False)
    assert result.dtype == "BF16"
    reference = peft_merge(llama_fp32, adapter, tmp_path / "peft", torch.float32)
    assert_same_tensors(ours, reference, cast=torch.bfloat16)
    assert json.loads((ours / "config.json").read_text())["dtype"] == "bfloat16"


def test_dtype_cast_up_equals_peft_loaded_wide(tmp_path, llama_bf16, plain_adapter):
    ours = tmp_path / "ours"
    merge(llama_bf16, plain_adapter, ours, dtype="fp32", progress=False)
    reference = peft_merge(llama_bf16, plain_adapter, tmp_path / "peft", torch.float32)
    assert_same_tensors(ours, reference)


def test_tokenizer_files_come_from_adapter_when_it_has_them(tmp_path, llama_bf16, plain_adapter):
    import shutil

    adapter = tmp_path / "adapter"
    shutil.copytree(plain_adapter, adapter)
    (adapter / "tokenizer_config.json").write_text(json.dumps({"from": "adapter"}))
    result = merge(llama_bf16, adapter, tmp_path / "out", progress=False)
    assert result.tokenizer_from == adapter
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text()) == {"from": "adapter"}
    # files are not mixed: the base's chat template stays behind
    assert not (tmp_path / "out" / "chat_template.jinja").exists()


def test_safe_accepts_finite_merge(tmp_path, llama_bf16, plain_adapter):
    merge(llama_bf16, plain_adapter, tmp_path / "out", safe=True, progress=False)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()


def test_safe_names_first_non_finite_tensor(tmp_path, llama_bf16, plain_adapter):
    import shutil

    from safetensors.torch import load_file, save_file

    adapter = tmp_path / "adapter"
    shutil.copytree(plain_adapter, adapter)
    tensors = load_file(adapter / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    tensors[key][0, 0] = float("inf")
    save_file(tensors, adapter / "adapter_model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MergeError, match=r"model\.layers\.1\.self_attn\.v_proj\.weight"):
        merge(llama_bf16, adapter, tmp_path / "out", safe=True, progress=False)
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob("out.partial-*"))


def test_overwrite_replaces_old_content_after_success(tmp_path, llama_bf16, plain_adapter):
    out = tmp_path / "out"
    merge(llama_bf16, plain_adapter, out, progress=False)  # an earlier merge
    marker = out / "memfit-merge.json"
    marker.write_text(json.dumps(dict(json.loads(marker.read_text()), which="the earlier merge")))
    with pytest.raises(MergeError, match="--overwrite"):
        merge(llama_bf16, plain_adapter, out, progress=False)
    assert json.loads(marker.read_text())["which"] == "the earlier merge"
    merge(llama_bf16, plain_adapter, out, overwrite=True, progress=False)
    assert "which" not in json.loads(marker.read_text())  # replaced by the new merge
    assert (out / "model.safetensors.index.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_interrupted_merge_leaves_nothing_and_keeps_old_out(tmp_path, llama_bf16, plain_adapter, monkeypatch):
    import memfit.merge.api as api

    out = tmp_path / "out"
    merge(llama_bf16, plain_adapter, out, progress=False)  # an earlier merge
    before = sorted(p.name for p in out.iterdir())
    real = api._produce
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-shard
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "_produce", failing)
    with pytest.raises(KeyboardInterrupt):
        merge(llama_bf16, plain_adapter, out, overwrite=True, progress=False)
    assert calls["n"] == 4
    assert sorted(p.name for p in out.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    fresh = tmp_path / "fresh"
    calls["n"] = 0
    with pytest.raises(KeyboardInterrupt):
        merge(llama_bf16, plain_adapter, fresh, progress=False)
    assert not fresh.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# DoRA: m * (W + s*BA) / ||W + s*BA|| per output row, as PEFT's merge_and_unload computes it.


def test_dora_bf16_sharded_matches_peft(tmp_path, llama_bf16):
    adapter = save_adapter(
        llama_bf16, tmp_path / "adapter", torch.bfloat16, r=4, lora_alpha=8, use_dora=True, target_modules="all-linear"
    )
    result, _, _ = _compare(tmp_path, llama_bf16, adapter, torch.bfloat16)
    assert result.shard_count > 2 and result.merged_tensor_count == 7 * 2


def test_dora_fp32_with_rslora_and_rank_patterns_matches_peft(tmp_path, llama_fp32):
    adapter = save_adapter(
        llama_fp32,
        tmp_path / "adapter",
        torch.float32,
        r=4,
        lora_alpha=8,
        use_dora=True,
        use_rslora=True,
        target_modules=["q_proj", "o_proj", "down_proj"],
        rank_pattern={"o_proj": 2},
        alpha_pattern={"down_proj": 3},
    )
    _compare(tmp_path, llama_fp32, adapter, torch.float32)


def test_dora_on_gpt2_conv1d_matches_peft(tmp_path):
    base = save_base(gpt2_config(), tmp_path / "base", torch.float32, max_shard_size="100KB")
    adapter = save_adapter(
        base,
        tmp_path / "adapter",
        torch.float32,
        r=4,
        lora_alpha=8,
        use_dora=True,
        fan_in_fan_out=True,
        target_modules=["c_attn", "c_proj", "c_fc"],
    )
    result, _, _ = _compare(tmp_path, base, adapter, torch.float32)
    assert result.merged_tensor_count == 2 * 4


def test_dora_cast_to_another_dtype_equals_peft_then_cast(tmp_path, llama_bf16):
    adapter = save_adapter(
        llama_bf16,
        tmp_path / "adapter",
        torch.bfloat16,
        r=4,
        lora_alpha=8,
        use_dora=True,
        target_modules=["q_proj", "v_proj"],
    )
    ours = tmp_path / "ours"
    merge(llama_bf16, adapter, ours, dtype="fp32", progress=False)
    # fp32 output: PEFT on the base loaded in fp32
    assert_same_tensors(ours, peft_merge(llama_bf16, adapter, tmp_path / "peft", torch.float32))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_dora_with_modules_to_save_matches_peft(tmp_path, llama_bf16, llama_tied, tied):
    base = llama_tied if tied else llama_bf16
    extra = dict(ensure_weight_tying=True) if tied else {}
    adapter = save_adapter(
        base,
        tmp_path / "adapter",
        torch.bfloat16,
        r=4,
        lora_alpha=8,
        use_dora=True,
        target_modules="all-linear",
        modules_to_save=["embed_tokens", "lm_head"],
        **extra,
    )
    result, ours, _ = _compare(tmp_path, base, adapter, torch.bfloat16)
    # tied: one trained copy, written once for both (the merged model stays tied)
    assert result.replaced_tensor_count == (1 if tied else 2) and not result.untied_embeddings
    assert json.loads((ours / "config.json").read_text()).get("tie_word_embeddings", True) is tied
