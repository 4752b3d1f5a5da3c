"""Pure rules of adapter_config.json: scaling, pattern matching, refused options."""

from __future__ import annotations

import math

import pytest

from memfit.merge.adapter import config_problems, lora_scale, pattern_key


def test_scale_plain_and_rslora():
    assert lora_scale(16, 8, use_rslora=False) == 2.0
    assert lora_scale(16, 8, use_rslora=True) == 16 / math.sqrt(8)
    assert lora_scale(7, 3, use_rslora=False) == 7 / 3


@pytest.mark.parametrize(
    "patterns, module, expected",
    [
        ({"q_proj": 2}, "model.layers.0.self_attn.q_proj", "q_proj"),
        ({"proj": 2}, "model.layers.0.self_attn.q_proj", None),  # matches at a dot boundary only
        ({"model.layers.0.self_attn.q_proj": 2}, "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.q_proj"),
        ({"model.layers.0.self_attn.q_proj": 2}, "model.layers.10.self_attn.q_proj", None),
        ({r"layers\.[01]\..*_proj": 2}, "model.layers.1.mlp.up_proj", r"layers\.[01]\..*_proj"),
        ({"q_proj": 2, "self_attn.q_proj": 3}, "model.layers.0.self_attn.q_proj", "q_proj"),  # first match wins
        ({}, "model.layers.0.self_attn.q_proj", None),
    ],
)
def test_pattern_key_follows_peft(patterns, module, expected):
    assert pattern_key(patterns, module) == expected


def test_pattern_key_agrees_with_peft_itself():
    peft_other = pytest.importorskip("peft.utils.other")
    patterns = ["q_proj", r"layers\.1\..*", "mlp.up_proj"]
    for module in [
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.mlp.down_proj",
        "model.layers.0.mlp.up_proj",
        "lm_head",
    ]:
        ours = pattern_key(patterns, module)
        assert (ours if ours is not None else module) == peft_other.get_pattern_key(patterns, module)


def test_plain_config_has_no_problems():
    assert config_problems({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "bias": "none", "use_dora": False}) == []


def test_all_problems_reported_at_once():
    problems = config_problems({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "lora_bias": True, "bias": "lora_only"})
    assert len(problems) == 2
    assert any("lora_bias=True" in p for p in problems) and any("bias='lora_only'" in p for p in problems)


def test_dora_is_merged_not_refused():
    assert config_problems({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_dora": True}) == []
