"""Other tools' mixture-of-experts keys, read as they train: LLaMA-Factory's moe_aux_loss_coef, Axolotl's
routing fields in overrides_of_model_config, TRL's lora_target_parameters and model_init_kwargs."""

from __future__ import annotations

import json

import pytest

import memfit
from memfit.interop import read_tool_config
from memfit.interop.reading import ToolConfigError
from memfit.train.conformance import TINY_MODELS


@pytest.fixture
def moe_model(tmp_path):
    folder = tmp_path / "tiny-mixtral"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_MODELS["mixtral"]))
    return folder


def test_llama_factory_moe_aux_loss_coef_turns_the_routing_loss_on(write_config, moe_model):
    path = write_config(
        "lf.yaml",
        f"model_name_or_path: {moe_model}\nstage: sft\nmoe_aux_loss_coef: 0.05\ncutoff_len: 64\n"
        "per_device_train_batch_size: 1\n",
    )
    config = read_tool_config(path)
    assert config.model_config == {"output_router_logits": True, "router_aux_loss_coef": 0.05}
    assert config.to_dict()["model_config"] == config.model_config
    plan = memfit.plan(str(path), cache=False)
    assert plan.details["experts"]["router_aux_loss"] == {"coef": 0.05, "on": True, "asked": True}
    off = read_tool_config(write_config("off.yaml", f"model_name_or_path: {moe_model}\nstage: sft\n"))
    assert off.model_config == {}


def test_axolotl_reads_the_routing_fields_of_its_model_config_overrides(write_config):
    path = write_config(
        "ax.yaml",
        """
        base_model: org/model
        datasets: [{path: data.jsonl, type: alpaca}]
        overrides_of_model_config:
          output_router_logits: true
          router_aux_loss_coef: 0.02
          rope_theta: 10000
    """,
    )
    config = read_tool_config(path)
    assert config.model_config == {"output_router_logits": True, "router_aux_loss_coef": 0.02}
    assert any(f.key.startswith("overrides_of_model_config") for f in config.not_modelled)  # rope_theta is not read


def test_trl_target_parameters_name_the_experts_and_model_init_kwargs_the_routing_loss(write_config):
    path = write_config(
        "trl.yaml",
        """
        model_name_or_path: org/model
        use_peft: true
        lora_target_modules: [q_proj, v_proj]
        lora_target_parameters: [mlp.experts.gate_up_proj, mlp.experts.down_proj, mlp.gate.weight]
        model_init_kwargs: {output_router_logits: true}
        max_length: 512
    """,
    )
    config = read_tool_config(path)
    assert config.knobs["targets"] == ("q_proj", "v_proj", "experts.gate_up_proj", "experts.down_proj", "gate")
    assert config.model_config == {"output_router_logits": True}


def test_a_target_parameter_that_is_no_expert_or_module_weight_is_named(write_config):
    path = write_config(
        "trl.yaml", "model_name_or_path: org/model\nuse_peft: true\nlora_target_parameters: [mlp.down_proj.bias]\n"
    )
    with pytest.raises(ToolConfigError, match=r"lora_target_parameters: 'mlp\.down_proj\.bias' names no expert weight"):
        read_tool_config(path)
