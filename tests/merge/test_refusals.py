"""Every bad input is refused with one clear MergeError, before anything is written."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from merge_helpers import llama_config, save_adapter, save_base

from memfit.merge import MergeError, merge

torch = pytest.importorskip("torch")


def _copy_adapter(src, tmp_path, **config_changes):
    adapter = tmp_path / "adapter"
    shutil.copytree(src, adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config.update(config_changes)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    return adapter


def _refused(tmp_path, base, adapter, match, out=None, **kwargs):
    out = tmp_path / "out" if out is None else out
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(MergeError, match=match):
        merge(base, adapter, out, progress=False, **kwargs)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


@pytest.mark.parametrize(
    "change, match",
    [
        (
            {"use_dora": True},
            r"has no DoRA magnitude \(lora_magnitude_vector\) but adapter_config.json says use_dora=true",
        ),
        ({"peft_type": "IA3"}, r"peft_type is 'IA3'"),
        ({"bias": "all"}, r"bias='all'"),
        ({"lora_bias": True}, r"lora_bias=True"),
        ({"init_lora_weights": "pissa"}, r"init_lora_weights='pissa'"),
        ({"trainable_token_indices": [1, 2]}, r"trainable_token_indices"),
        ({"layer_replication": [[0, 2]]}, r"layer_replication"),
        ({"r": 0}, r"r=0 must be a positive number"),
    ],
)
def test_unsupported_adapter_options(tmp_path, llama_bf16, plain_adapter, change, match):
    adapter = _copy_adapter(plain_adapter, tmp_path, **change)
    _refused(tmp_path, llama_bf16, adapter, match)


def test_rank_in_config_disagrees_with_weights(tmp_path, llama_bf16, plain_adapter):
    adapter = _copy_adapter(plain_adapter, tmp_path, rank_pattern={"v_proj": 8})
    _refused(tmp_path, llama_bf16, adapter, r"v_proj'.*r=8.*rank 4")


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path, llama_bf16):
    other = save_base(llama_config(hidden_size=32, intermediate_size=64), tmp_path / "other", torch.bfloat16)
    adapter = save_adapter(other, tmp_path / "adapter", torch.bfloat16, r=4, lora_alpha=8, target_modules=["q_proj"])
    shutil.rmtree(other)
    _refused(
        tmp_path,
        llama_bf16,
        adapter,
        r"shape mismatch: adapter module 'model\.layers\.0\.self_attn\.q_proj'.*\[32, 32\].*'model\.layers\.0\.self_attn\.q_proj\.weight' is \[64, 64\]",
    )


def test_adapter_module_missing_from_base(tmp_path, llama_bf16):
    deeper = save_base(llama_config(num_hidden_layers=3), tmp_path / "deeper", torch.bfloat16)
    adapter = save_adapter(deeper, tmp_path / "adapter", torch.bfloat16, r=4, lora_alpha=8, target_modules=["q_proj"])
    shutil.rmtree(deeper)
    _refused(tmp_path, llama_bf16, adapter, r"'model\.layers\.2\.self_attn\.q_proj' matches no base tensor")


def test_unknown_adapter_tensor(tmp_path, llama_bf16, plain_adapter):
    from safetensors.torch import load_file, save_file

    adapter = _copy_adapter(plain_adapter, tmp_path)
    tensors = load_file(adapter / "adapter_model.safetensors")
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_scaler.weight"] = torch.ones(64)
    save_file(tensors, adapter / "adapter_model.safetensors")
    _refused(tmp_path, llama_bf16, adapter, r"lora_scaler.weight' is neither a LoRA weight")


def test_a_dora_magnitude_in_an_adapter_without_dora(tmp_path, llama_bf16, plain_adapter):
    from safetensors.torch import load_file, save_file

    adapter = _copy_adapter(plain_adapter, tmp_path)
    tensors = load_file(adapter / "adapter_model.safetensors")
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"] = torch.ones(64)
    save_file(tensors, adapter / "adapter_model.safetensors")
    _refused(tmp_path, llama_bf16, adapter, r"q_proj' has a DoRA magnitude but adapter_config.json says use_dora=false")


def test_a_dora_magnitude_of_the_wrong_length(tmp_path, llama_bf16, plain_adapter):
    from safetensors.torch import load_file, save_file

    adapter = _copy_adapter(plain_adapter, tmp_path, use_dora=True)
    tensors = load_file(adapter / "adapter_model.safetensors")
    for key in [k for k in tensors if k.endswith(".lora_A.weight")]:
        module = key.removesuffix(".lora_A.weight")
        tensors[f"{module}.lora_magnitude_vector"] = torch.ones(
            7 if "layers.1.self_attn.q_proj" in module else tensors[f"{module}.lora_B.weight"].shape[0]
        )
    save_file(tensors, adapter / "adapter_model.safetensors")
    _refused(
        tmp_path,
        llama_bf16,
        adapter,
        r"DoRA magnitude .*layers.1.self_attn.q_proj.lora_magnitude_vector' is \[7\] but base tensor "
        r"'model.layers.1.self_attn.q_proj.weight' has 64 output rows",
    )


@pytest.mark.parametrize("where", ["same", "inside", "symlink", "parent"])
def test_out_must_not_overlap_base(tmp_path, llama_bf16, plain_adapter, where):
    base = tmp_path / "base"
    shutil.copytree(llama_bf16, base)
    out = {"same": base, "inside": base / "merged", "symlink": tmp_path / "link", "parent": tmp_path}[where]
    if where == "symlink":
        os.symlink(base, out)
    listing = sorted(p.name for p in base.iterdir())
    with pytest.raises(MergeError, match="--base"):
        merge(base, plain_adapter, out, overwrite=True, progress=False)
    assert sorted(p.name for p in base.iterdir()) == listing


def test_out_must_not_be_the_adapter(tmp_path, llama_bf16, plain_adapter):
    adapter = _copy_adapter(plain_adapter, tmp_path)
    with pytest.raises(MergeError, match="--adapter"):
        merge(llama_bf16, adapter, adapter, overwrite=True, progress=False)
    assert (adapter / "adapter_model.safetensors").is_file()


def test_non_empty_out_without_overwrite(tmp_path, llama_bf16, plain_adapter):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    _refused(tmp_path, llama_bf16, plain_adapter, "is not empty: pass --overwrite", out=out)
    assert (out / "keep.txt").read_text() == "x"


def test_out_is_a_file(tmp_path, llama_bf16, plain_adapter):
    (tmp_path / "out").write_text("x")
    _refused(tmp_path, llama_bf16, plain_adapter, "not a folder")


@pytest.mark.parametrize("dtype", ["bf8", "int8", "float64x"])
def test_bad_dtype(tmp_path, llama_bf16, plain_adapter, dtype):
    _refused(tmp_path, llama_bf16, plain_adapter, rf"--dtype '{dtype}' is not supported", dtype=dtype)


@pytest.mark.parametrize("device", ["graphics", "cuda:x", "tpu:0"])
def test_bad_device(tmp_path, llama_bf16, plain_adapter, device):
    _refused(tmp_path, llama_bf16, plain_adapter, rf"--device '{device}' is not supported", device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_when_none_is_visible(tmp_path, llama_bf16, plain_adapter):
    _refused(tmp_path, llama_bf16, plain_adapter, "no CUDA GPU", device="cuda:0")


def test_missing_base_and_adapter_folders(tmp_path, llama_bf16, plain_adapter):
    _refused(tmp_path, tmp_path / "nope", plain_adapter, r"--base .*nope is not a folder")
    _refused(tmp_path, llama_bf16, tmp_path / "nope", r"--adapter .*nope is not a folder")


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda d: (d / "config.json").unlink(), "has no config.json"),
        (lambda d: [p.unlink() for p in d.glob("model*.safetensors*")], "neither model.safetensors nor"),
        (lambda d: sorted(d.glob("model-*.safetensors"))[1].unlink(), "names shard 'model-00002"),
        (
            lambda d: sorted(d.glob("model-*.safetensors"))[0].write_bytes(
                b"\x10\x00\x00\x00\x00\x00\x00\x00{not json"
            ),
            "cannot read safetensors shard",
        ),
        (lambda d: (d / "model.safetensors.index.json").write_text("{"), "cannot read .*index.json"),
        (
            lambda d: (d / "config.json").write_text(
                json.dumps({"quantization_config": {"quant_method": "bitsandbytes"}})
            ),
            "is quantized",
        ),
    ],
    ids=["no-config", "no-weights", "missing-shard", "corrupt-shard", "bad-index", "quantized"],
)
def test_broken_base(tmp_path, llama_bf16, plain_adapter, damage, match):
    base = tmp_path / "base"
    shutil.copytree(llama_bf16, base)
    damage(base)
    _refused(tmp_path, base, plain_adapter, match)


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda d: (d / "adapter_config.json").unlink(), "has no adapter_config.json"),
        (lambda d: (d / "adapter_model.safetensors").rename(d / "adapter_model.bin"), r"found adapter_model\.bin"),
        (lambda d: (d / "adapter_config.json").write_text("[1"), "cannot read .*adapter_config.json"),
        (lambda d: (d / "adapter_model.safetensors").write_bytes(b"junk"), "cannot read .*adapter_model.safetensors"),
    ],
    ids=["no-config", "bin-only", "bad-config", "corrupt-weights"],
)
def test_broken_adapter(tmp_path, llama_bf16, plain_adapter, damage, match):
    adapter = _copy_adapter(plain_adapter, tmp_path)
    damage(adapter)
    _refused(tmp_path, llama_bf16, adapter, match)


def test_not_enough_disk_space(tmp_path, llama_bf16, plain_adapter, monkeypatch):
    import collections

    import memfit.merge.outdir as outdir

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(outdir.shutil, "disk_usage", lambda path: usage(10, 10, 1000))
    _refused(tmp_path, llama_bf16, plain_adapter, "GiB needed for the merged model")


def test_target_modules_that_match_nothing_in_the_base_are_refused_as_peft_refuses_them(
    tmp_path, llama_bf16, plain_adapter
):
    import transformers
    from peft import PeftModel

    adapter = _copy_adapter(plain_adapter, tmp_path, target_modules=["c_attn", "c_proj"])  # GPT-2's names
    with pytest.raises(ValueError):  # the reference: PEFT will not load it
        PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(llama_bf16), adapter)
    _refused(tmp_path, llama_bf16, adapter, r"target_modules=\['c_attn', 'c_proj'\] match no module of the base model")


# ------------------------------------------------------------------------------------------------
# --overwrite and leftovers: nothing the user owns is deleted


def test_overwrite_never_deletes_a_folder_memfit_did_not_write(tmp_path, llama_bf16, plain_adapter):
    out = tmp_path / "out"
    (out / ".ssh").mkdir(parents=True)
    (out / ".ssh" / "id_ed25519").write_text("secret\n")
    (out / "main.py").write_text("print('mine')\n")
    with pytest.raises(MergeError, match="--overwrite replaces only a folder memfit merge wrote.*no memfit-merge.json"):
        merge(llama_bf16, plain_adapter, out, overwrite=True, progress=False)
    assert (out / ".ssh" / "id_ed25519").read_text() == "secret\n" and (out / "main.py").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_overwrite_keeps_an_earlier_merge_that_now_holds_a_users_file(tmp_path, llama_bf16, plain_adapter):
    out = tmp_path / "out"
    merge(llama_bf16, plain_adapter, out, progress=False)
    (out / "notes.md").write_text("my evaluation notes\n")  # added by the user since
    with pytest.raises(MergeError, match=r"also holds what a merge does not write \('notes.md'\)"):
        merge(llama_bf16, plain_adapter, out, overwrite=True, progress=False)
    assert (out / "notes.md").read_text() == "my evaluation notes\n"
    (out / "notes.md").unlink()
    merge(llama_bf16, plain_adapter, out, overwrite=True, progress=False)  # a plain earlier merge is replaced


def test_leftovers_of_killed_merges_are_removed_when_provably_abandoned(tmp_path, llama_bf16, plain_adapter):
    out = tmp_path / "out"
    dead = tmp_path / "out.partial-999999999-abcd1234"  # no process has this id
    live = tmp_path / f"out.partial-{os.getppid()}-abcd1234"  # a running process: maybe a merge in progress
    unsure = tmp_path / "out.partial-k2j4h5g6"  # an older memfit's name, no process id
    other = tmp_path / "outer.partial-999999999-x"  # another --out's
    for folder in (dead, live, unsure, other):
        folder.mkdir()
        (folder / "model.safetensors.tmp").write_bytes(b"half a shard")
    result = merge(llama_bf16, plain_adapter, out, progress=False)
    assert result.removed_leftovers == (dead,)
    assert not dead.exists() and live.exists() and unsure.exists() and other.exists()
    assert len(result.notes) == 1 and str(unsure) in result.notes[0]


def test_merged_files_get_the_permissions_of_the_umask(tmp_path, llama_bf16, plain_adapter):
    previous = os.umask(0o022)
    try:
        merge(llama_bf16, plain_adapter, tmp_path / "out", progress=False)
    finally:
        os.umask(previous)
    out = tmp_path / "out"
    assert oct(out.stat().st_mode & 0o777) == oct(0o755)  # not mkdtemp's 0700
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {oct(0o644)}
