"""A PEFT adapter named as a config's model (an alignment-handbook DPO recipe on its SFT adapter) is
planned as its base, with the adapter's settings as the method where the config names none; and
``--model`` plans another model in place of the config's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from hub_repos import point_at
from local_hub import LocalHub

from memfit.interop import ToolConfigError, read_tool_config
from memfit.interop.summary import detail_lines, headline

ADAPTER = "memfit-test/zephyr-sft-lora"
BASE = "memfit-test/tiny-base"
SETTINGS = {
    "peft_type": "LORA",
    "r": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.05,
    "use_dora": True,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "modules_to_save": None,
    "task_type": "CAUSAL_LM",
}


def _adapter_folder(folder: Path, base: str, **changes) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps(dict(SETTINGS, base_model_name_or_path=base, **changes)))
    return folder


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_llama):
    """A local Hub serving a model repo and a LoRA adapter repo on it (adapter_config.json alone)."""
    server = LocalHub()
    server.add_commit(BASE, {"config.json": json.dumps(dict(tiny_llama, architectures=["LlamaForCausalLM"])).encode()})
    settings = dict(SETTINGS, base_model_name_or_path=BASE)
    server.add_commit(
        ADAPTER, {"adapter_config.json": json.dumps(settings).encode(), "adapter_model.safetensors": b"x" * 64}
    )
    server.start()
    point_at(monkeypatch, server.endpoint, tmp_path / "hf-home")
    yield server
    server.down()


def test_an_adapter_folder_is_planned_as_its_base_with_the_adapter_s_settings(write_config, tiny_model, tmp_path):
    adapter = _adapter_folder(tmp_path / "sft-adapter", str(tiny_model))
    config = read_tool_config(write_config("dpo.yaml", "model_name_or_path: sft-adapter\ndtype: bfloat16\nbeta: 0.1\n"))
    assert config.model == str(tiny_model)
    assert config.knobs["method"] == "lora" and config.knobs["objective"] == "dpo"
    assert (config.knobs["rank"], config.knobs["alpha"], config.knobs["dropout"]) == (8, 16, 0.05)
    assert config.knobs["targets"] == ("q_proj", "k_proj", "v_proj", "o_proj") and config.knobs["dora"] is True
    assert config.knobs["precision"] == "bf16"  # LoRA on a bf16 base, as for any LoRA config of TRL
    assert config.sources["rank"] == (f"{adapter}'s adapter_config.json: r",)
    read = config.to_dict()
    assert read["adapter"]["base"] == str(tiny_model) and "rank" in read["adapter"]["taken"]
    assert f"(the base of the PEFT adapter {adapter})" in headline(read)
    assert detail_lines(read)[0].startswith(
        f"adapter: {adapter} is a PEFT adapter (adapter_config.json), which transformers loads as its base {tiny_model}"
    )


def test_the_config_s_own_lora_keys_win_over_the_adapter_s(write_config, tiny_model, tmp_path):
    _adapter_folder(tmp_path / "sft-adapter", str(tiny_model))
    text = "model_name_or_path: sft-adapter\ndtype: bfloat16\nuse_peft: true\nload_in_4bit: true\nlora_r: 32\nuse_dora: false\n"
    config = read_tool_config(write_config("dpo.yaml", text))
    assert config.knobs["method"] == "qlora" and config.knobs["rank"] == 32 and config.knobs["dora"] is False
    assert config.knobs["alpha"] == 16  # the config names no alpha: the adapter's
    full = read_tool_config(write_config("full.yaml", "model_name_or_path: sft-adapter\nuse_peft: false\n"))
    assert full.knobs["method"] == "full" and "rank" not in full.knobs


def test_an_adapter_that_is_not_lora_or_names_no_base_is_said(write_config, tiny_model, tmp_path):
    _adapter_folder(tmp_path / "ia3", str(tiny_model), peft_type="IA3")
    config = read_tool_config(write_config("sft.yaml", "model_name_or_path: ia3\nuse_peft: true\ndtype: bfloat16\n"))
    assert config.model == str(tiny_model) and config.knobs["rank"] == 16  # the config's method, TRL's defaults
    assert [f.key for f in config.not_modelled] == ["model_name_or_path"] and "IA3 adapter" in config.not_modelled[
        0
    ].why
    _adapter_folder(tmp_path / "orphan", "")
    with pytest.raises(
        ToolConfigError, match=r"model_name_or_path: '.*orphan' is a PEFT adapter .* names no base_model_name_or_path"
    ):
        read_tool_config(write_config("orphan.yaml", "model_name_or_path: orphan\nuse_peft: true\n"))


def test_an_adapter_repo_on_the_hub_is_planned_as_its_base(hub, write_config):
    from memfit.planner.api import plan

    path = write_config(
        "dpo.yaml",
        f"model_name_or_path: {ADAPTER}\ndtype: bfloat16\nbeta: 0.1\nmax_length: 64\nper_device_train_batch_size: 1\n",
    )
    config = read_tool_config(path)
    assert config.model == BASE and config.knobs["rank"] == 8 and config.knobs["dora"] is True
    assert config.chosen.adapter.hub["repo_id"] == ADAPTER
    result = plan(str(path), cache=False)
    assert result.model == BASE and result.spec["method"] == "lora" and result.spec["rank"] == 8 and result.spec["dora"]
    assert result.details["config"]["adapter"]["name"] == ADAPTER
    # A model repo is a model: planned as named.
    assert read_tool_config(write_config("sft.yaml", f"model_name_or_path: {BASE}\nuse_peft: true\n")).model == BASE


def test_model_replaces_the_config_s_model(write_config, tiny_model, tmp_path, monkeypatch):
    from memfit.planner.api import plan

    path = write_config("sft.yaml", "model_name_or_path: org/not-here\nmodel_revision: v2\nuse_peft: true\n")
    monkeypatch.chdir(tmp_path)
    config = read_tool_config(path, model=tiny_model.name)  # relative to the working directory
    assert config.model == str(tiny_model) and config.revision is None
    read = config.to_dict()
    assert read["given_model"] and read["replaced"] == "org/not-here"
    assert "(--model, in place of the config's org/not-here)" in headline(read)
    config = read_tool_config(write_config("bare.yaml", "use_peft: true\nlora_r: 4\n"), model="smollm2-135m")
    assert config.model == "smollm2-135m"  # a config without a model key takes --model
    with pytest.raises(ToolConfigError, match=r"model_name_or_path: not set; .*or --model"):
        read_tool_config(write_config("bare.yaml", "use_peft: true\nlora_r: 4\n"))
    with pytest.raises(Exception, match="--model: replaces the model of a training config"):
        plan("smollm2-135m", model_override=str(tiny_model))
