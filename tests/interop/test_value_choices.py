"""A value another tool would refuse (a loss it does not have, a stage, a scheduler) is refused, in one
line naming the key, the value, the tool and the closest value it takes; the values it takes plan on."""

from __future__ import annotations

import pytest

from memfit.interop import TOOLS, read_tool_config
from memfit.interop.reading import ToolConfigError

AXOLOTL = "base_model: org/model\nadapter: lora\n"
LLAMA_FACTORY = "model_name_or_path: org/model\nfinetuning_type: lora\n"
TRL = "model_name_or_path: org/model\nuse_peft: true\n"


def _refusal(write_config, text: str) -> str:
    with pytest.raises(ToolConfigError) as info:
        read_tool_config(write_config("run.yaml", text))
    return str(info.value)


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            AXOLOTL + "rl: dpoo\n",
            "rl: 'dpoo' is not an RL trainer Axolotl knows (dpo, gdpo, grpo, ipo, orpo, kto, simpo, ebft). "
            "Did you mean 'dpo'?",
        ),
        (
            AXOLOTL + "rl: dpo\ndpo_loss_type: [sigmoid, ipoo]\n",
            "dpo_loss_type: 'ipoo' is not a DPO loss_type TRL's DPOConfig takes",
        ),
        (AXOLOTL + "lr_scheduler: cosin\n", "lr_scheduler: 'cosin' is not a learning-rate scheduler Axolotl knows"),
        (
            AXOLOTL + "attn_implementation: flash\n",
            "attn_implementation: 'flash' is not an attention implementation Axolotl takes",
        ),
        (
            LLAMA_FACTORY + "stage: dpo\npref_loss: unknownloss\n",
            "pref_loss: 'unknownloss' is not a pref_loss LLaMA-Factory "
            "knows (sigmoid, hinge, ipo, kto_pair, orpo, simpo). Did you "
            "mean 'orpo'?",
        ),
        (
            LLAMA_FACTORY + "stage: sftt\n",
            "stage: 'sftt' is not a stage LLaMA-Factory knows (pt, sft, rm, ppo, dpo, kto). Did you mean 'sft'?",
        ),
        (
            LLAMA_FACTORY + "flash_attn: flash_attention_2\n",
            "flash_attn: 'flash_attention_2' is not an attention LLaMA-Factory knows (auto, disabled, sdpa, fa2, fa3).",
        ),
        (
            LLAMA_FACTORY + "quantization_bit: 4\nquantization_method: bitsandbytes\n",
            "quantization_method: 'bitsandbytes' is not a quantization method LLaMA-Factory knows",
        ),
        (
            LLAMA_FACTORY + "finetuning_type: lor\n",
            "finetuning_type: 'lor' is not a finetuning_type LLaMA-Factory knows",
        ),
        (
            LLAMA_FACTORY + "lr_scheduler_type: cosin\n",
            "lr_scheduler_type: 'cosin' is not a learning-rate scheduler the Trainer knows",
        ),
        (
            TRL + "loss_type: bogus\n",
            "loss_type: 'bogus' is not a loss_type TRL's SFTConfig, DPOConfig or CPOConfig takes. Did you mean",
        ),
        (
            TRL + "beta: 0.1\nprecompute_ref_log_probs: true\nloss_type: [sigmoid, simpo]\n",
            "loss_type: 'simpo' is not a loss_type TRL's DPOConfig takes",
        ),
        (
            TRL + "simpo_gamma: 0.5\nloss_type: sigmod\n",
            "loss_type: 'sigmod' is not a loss_type TRL's CPOConfig takes (sigmoid, "
            "hinge, ipo, simpo, alphapo). Did you mean 'sigmoid'?",
        ),
        (
            TRL + "beta: 0.1\nf_divergence_type: kl\n",
            "f_divergence_type: 'kl' is not an f-divergence TRL's DPOConfig takes",
        ),
        (
            TRL + "packing: true\npacking_strategy: ffd\n",
            "packing_strategy: 'ffd' is not a packing strategy TRL's SFTConfig "
            "takes (bfd, bfd_split, wrapped). Did you mean 'bfd'?",
        ),
        (
            TRL + "optim: adamw_torhc\n",
            "optim: 'adamw_torhc' is not an optimizer name the Trainer knows. Did you mean 'adamw_torch'?",
        ),
        (
            TRL + "attn_implementation: flash_attn_2\n",
            "attn_implementation: 'flash_attn_2' is not an attention implementation transformers knows",
        ),
    ],
    ids=[
        "axolotl-rl",
        "axolotl-dpo-loss",
        "axolotl-scheduler",
        "axolotl-attention",
        "lf-pref-loss",
        "lf-stage",
        "lf-flash-attn",
        "lf-quantization",
        "lf-finetuning-type",
        "lf-scheduler",
        "trl-sft-loss",
        "trl-dpo-loss",
        "trl-cpo-loss",
        "trl-f-divergence",
        "trl-packing",
        "trl-optim",
        "trl-attention",
    ],
)
def test_a_value_the_tool_would_refuse_is_refused_with_the_closest_it_takes(write_config, text, expected):
    message = _refusal(write_config, text)
    assert message.startswith(f"cannot plan {write_config('run.yaml', text)}: ") and "\n" not in message
    assert expected in message


def test_each_bad_value_is_named_once_even_where_a_rule_reads_it_too(write_config):
    # flash_attn is read by the attention rule too, which would refuse 'fa9' in words of its own.
    message = _refusal(write_config, LLAMA_FACTORY + "flash_attn: fa9\nstage: sfft\n")
    assert message.count("flash_attn:") == 1 and message.count("stage:") == 1


@pytest.mark.parametrize(
    "text",
    [
        AXOLOTL + "rl: ipo\nlr_scheduler: one_cycle\nattn_implementation: kernels-community/flash-attn3\n",
        AXOLOTL + "rl: dpo\ndpo_loss_type: [sigmoid, sft]\nlr_scheduler: cosine_with_min_lr\n",
        LLAMA_FACTORY + "stage: dpo\npref_loss: kto_pair\nflash_attn: disabled\nlr_scheduler_type: cosine\n",
        LLAMA_FACTORY + "quantization_bit: 4\nquantization_method: hqq\n",
        TRL + "loss_type: dft\npacking: true\npacking_strategy: bfd_split\nlr_scheduler_type: warmup_stable_decay\n",
        TRL + "beta: 0.1\nloss_type: [sigmoid, sft]\nf_divergence_type: js_divergence\n",
        TRL + "beta: 0.1\nloss_type: simpo\n",  # beta alone: a CPOConfig too
        TRL + "cpo_alpha: 1.0\nloss_type: alphapo\n",
        TRL + "attn_implementation: kernels-community/flash-attn3\n",
        TRL + "attn_implementation: paged|eager\n",
    ],
    ids=[
        "axolotl",
        "axolotl-dpo",
        "lf-dpo",
        "lf-hqq",
        "trl-sft",
        "trl-dpo",
        "trl-beta-simpo",
        "trl-cpo",
        "trl-hub-kernel",
        "trl-paged",
    ],
)
def test_the_values_each_tool_takes_are_read(write_config, text):
    read_tool_config(write_config("run.yaml", text))


def test_axolotl_s_fp8_attention_is_planned_as_sdpa_and_listed(write_config):
    config = read_tool_config(write_config("run.yaml", AXOLOTL + "attn_implementation: fp8\n"))
    assert "padding_free" not in config.knobs
    assert [f.key for f in config.not_modelled] == ["attn_implementation"] and "fp8" in config.not_modelled[0].why


@pytest.mark.parametrize("keymap", TOOLS, ids=lambda k: k.tool)
def test_every_checked_key_is_a_key_of_the_tool(keymap):
    assert {check.key for check in keymap.choices} <= keymap.all_keys
