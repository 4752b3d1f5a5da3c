"""TRL GRPOConfig's keys, at a TRL config's top level and in an Axolotl config's trl: block, read
into memfit's grpo knobs (planned with memfit's step)."""

from __future__ import annotations

import json
import textwrap

import pytest

from memfit.interop import read_tool_config
from memfit.interop.reading import ToolConfigError
from memfit.spec import make_spec


def _read(write_config, text: str, name: str = "grpo.yaml"):
    return read_tool_config(write_config(name, textwrap.dedent(text).lstrip("\n")))


def test_a_trl_grpo_config_is_grpo_with_trls_defaults(write_config):
    config = _read(
        write_config,
        """
        model_name_or_path: org/model
        use_peft: true
        num_generations: 8
        max_prompt_length: 256
        max_completion_length: 768
        beta: 0.04
    """,
    )
    knobs = config.knobs
    assert knobs["objective"] == "grpo" and knobs["recipe"] == "memfit"
    assert (knobs["num_generations"], knobs["max_completion_length"], knobs["seq_len"], knobs["beta"]) == (
        8,
        768,
        1024,
        0.04,
    )
    assert (knobs["temperature"], knobs["top_p"], knobs["num_iterations"], knobs["use_vllm"]) == (1.0, 1.0, 1, False)
    assert knobs["batch_size"] == 8 and "hf_loss" not in knobs and "kbit_upcast" not in knobs
    assert "vllm_mode" not in knobs  # vLLM's settings only with use_vllm
    make_spec(**knobs)  # a spec memfit plans
    assert any("fused LM head" in f.why for f in config.approximated)


def test_without_max_prompt_length_the_prompt_is_planned_at_trls_former_default(write_config):
    config = _read(
        write_config,
        json.dumps({"model_name_or_path": "org/model", "num_generations": 4, "per_device_train_batch_size": 4}),
        "grpo.json",
    )
    assert config.knobs["seq_len"] == 512 + 512
    assert any("TRL 1.16 does not cut prompts" in f.why for f in config.approximated)


def test_vllm_settings_are_read_with_use_vllm(write_config):
    config = _read(
        write_config,
        """
        model_name_or_path: org/model
        num_generations: 8
        use_vllm: true
        vllm_mode: server
        vllm_gpu_memory_utilization: 0.5
        vllm_enable_sleep_mode: true
    """,
    )
    assert config.knobs["use_vllm"] is True and config.knobs["vllm_mode"] == "server"
    assert config.knobs["vllm_gpu_memory_utilization"] == 0.5 and config.knobs["vllm_enable_sleep_mode"] is True


@pytest.mark.parametrize(
    "line, says",
    [
        ("vllm_mode: sideways", "vllm_mode: 'sideways' is not a vLLM mode TRL's GRPOConfig takes (colocate, server)"),
        ("loss_type: dpoo", "loss_type: 'dpoo' is not a loss_type TRL's GRPOConfig takes"),
        ("num_generations: 0", "num_generations: 0 must be 1 or more"),
    ],
)
def test_a_bad_grpo_value_is_one_line_naming_the_key(write_config, line, says):
    text = "model_name_or_path: org/model\nuse_vllm: true\nnum_iterations: 1\n" + line + "\n"
    with pytest.raises(ToolConfigError) as err:
        read_tool_config(write_config("bad.yaml", text))
    assert says in str(err.value)


def test_a_dpo_config_is_still_dpo(write_config):
    config = _read(write_config, "model_name_or_path: org/model\nbeta: 0.1\nmax_completion_length: 256\n")
    assert config.knobs["objective"] == "dpo" and config.knobs["recipe"] == "hf"


def test_axolotl_rl_grpo_reads_its_trl_block(write_config):
    config = _read(
        write_config,
        """
        base_model: org/model
        adapter: qlora
        load_in_4bit: true
        rl: grpo
        sequence_len: 384
        micro_batch_size: 16
        trl:
          beta: 0.001
          num_generations: 16
          max_completion_length: 640
          use_vllm: true
          vllm_gpu_memory_utilization: 0.4
        datasets:
          - path: org/data
    """,
        "axolotl.yml",
    )
    knobs = config.knobs
    assert knobs["objective"] == "grpo" and knobs["recipe"] == "memfit" and knobs["method"] == "qlora"
    assert (knobs["num_generations"], knobs["max_completion_length"], knobs["seq_len"]) == (16, 640, 384 + 640)
    assert knobs["beta"] == 0.001 and knobs["vllm_gpu_memory_utilization"] == 0.4 and knobs["batch_size"] == 16
    make_spec(**knobs)
