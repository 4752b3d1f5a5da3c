"""Plans of vision-language models: the language model, the vision tower and the projector, with
images laid out by each family's processor rules."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner
from vision_configs import VISION_CONFIGS, vision_config

import memfit
from memfit.cli import app
from memfit.planner.errors import PlanError
from memfit.units import format_bytes

_KNOBS = {"seq_len": 128, "batch_size": 2, "image_max_pixels": 64 * 64, "cache": False}


@pytest.mark.parametrize("method", ["lora", "qlora"])
@pytest.mark.parametrize("model_type", sorted(VISION_CONFIGS))
def test_every_vision_family_plans_lora_and_qlora(model_type, method):
    one = memfit.plan(vision_config(model_type), method=method, images=1, **_KNOBS)
    two = memfit.plan(vision_config(model_type), method=method, images=2, **_KNOBS)
    assert one.details["num_layers"] == VISION_CONFIGS[model_type]["text_config"]["num_hidden_layers"]
    assert two.allocated_bytes > one.allocated_bytes  # a second image: its pixels and the tower's work
    assert one.details["vision"]["images"] == 1


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "gemma3", "mllama"])
def test_the_shortcuts_plan_a_vision_model_as_the_exact_simulation_does(model_type):
    config = vision_config(model_type, layers=6)
    knobs = dict(_KNOBS, method="lora", images=2)
    shortcut, exact = memfit.plan(config, **knobs), memfit.plan(config, exact=True, **knobs)
    assert shortcut.details["simulated_layers"] != [6]
    assert (shortcut.reserved_bytes, shortcut.categories) == (exact.reserved_bytes, exact.categories)
    assert shortcut.details["vision"]["tower_activation_bytes"] == exact.details["vision"]["tower_activation_bytes"]


def test_lora_adapts_the_language_model_and_the_tower_only_when_it_trains():
    config = vision_config("gemma3")  # its SigLIP tower's attention is q_proj, k_proj, v_proj too
    frozen = memfit.plan(config, method="lora", images=1, **_KNOBS)
    trained = memfit.plan(config, method="lora", images=1, freeze_vision=False, **_KNOBS)
    assert trained.details["trainable_params"] > frozen.details["trainable_params"]
    full = memfit.plan(config, method="full", images=1, **_KNOBS)
    full_tower = memfit.plan(config, method="full", images=1, freeze_vision=False, **_KNOBS)
    assert full_tower.details["trainable_params"] - full.details["trainable_params"] == (
        full.details["vision"]["tower_params"] + full.details["vision"]["projector_params"]
    )


def test_checkpointing_the_tower_saves_its_activations():
    config = vision_config("qwen2_5_vl")
    knobs = dict(_KNOBS, method="lora", images=2)
    kept = memfit.plan(config, vision_checkpointing="off", **knobs)
    checkpointed = memfit.plan(config, vision_checkpointing="on", **knobs)
    assert checkpointed.categories["activations"] < kept.categories["activations"]
    # Checkpointing the tower changes what the tower keeps, and nothing else: the plan names that part.
    tower = [p.details["vision"]["tower_activation_bytes"] for p in (kept, checkpointed)]
    assert tower[0] - tower[1] == kept.categories["activations"] - checkpointed.categories["activations"] > 0


def test_more_image_tokens_than_seq_len_holds_is_one_clear_refusal():
    with pytest.raises(PlanError) as err:
        memfit.plan(vision_config("gemma3"), method="lora", images=40, seq_len=128, cache=False)
    message = str(err.value)
    assert "--images: 40 image(s)" in message and "--seq-len 241" in message


def test_qwen2_5_vl_7b_plans_more_with_four_images_than_one_and_names_its_tower():
    knobs = {"method": "lora", "seq_len": 4096, "cache": False}
    one = memfit.plan("qwen2.5-vl-7b", images=1, **knobs)
    four = memfit.plan("qwen2.5-vl-7b", images=4, **knobs)
    assert four.device_total_bytes > one.device_total_bytes
    assert one.details["num_layers"] == 28  # the language model's, not the tower's 32 blocks
    assert one.details["vision"]["tower_blocks"] == 32
    assert one.details["vision"]["tower_weight_bytes"] > 1_000_000_000  # 670 M parameters in bf16
    assert four.details["vision"]["tokens_per_image"] == (756 // 28) ** 2  # 768 x 768 under max_pixels: 756 x 756


def test_without_a_seq_len_the_rows_hold_the_images_beside_the_default_text():
    one = memfit.plan(vision_config("gemma3"), method="lora", images=1, image_max_pixels=64 * 64, cache=False)
    two = memfit.plan(vision_config("gemma3"), method="lora", images=2, image_max_pixels=64 * 64, cache=False)
    per_image = one.details["vision"]["sequence_tokens_per_image"]
    assert one.spec["seq_len"] == 2048 + per_image and two.spec["seq_len"] == 2048 + 2 * per_image
    assert any(note.startswith(f"seq_len {2048 + per_image:,}: the images'") for note in one.details["notes"])
    given = memfit.plan(vision_config("gemma3"), method="lora", images=1, seq_len=512, cache=False)
    assert given.spec["seq_len"] == 512 and not any(n.startswith("seq_len") for n in given.details["notes"])


def test_the_report_names_the_tower_and_the_images():
    result = CliRunner().invoke(app, ["plan", "qwen2.5-vl-7b", "--method", "lora", "--images", "4", "--no-cache"])
    assert result.exit_code == 0, result.output
    assert "vision tower: 32 blocks" in result.output and "frozen" in result.output
    assert "images: 4 an example, up to 756x756 pixels" in result.output
    assert "batch 1 x 4972 tokens" in result.output  # 2048 of text beside 4 x 731


def test_the_categories_name_the_towers_share():
    plan = memfit.plan(vision_config("qwen2_5_vl"), method="lora", images=2, vision_checkpointing="off", **_KNOBS)
    vision, helps = plan.details["vision"], plan.details["category_help"]
    assert 0 < vision["tower_activation_bytes"] <= plan.categories["activations"]
    assert helps["weights"].endswith(
        f"{format_bytes(vision['tower_weight_bytes'])} of them the vision tower's and projector's"
    )
    assert helps["activations"].endswith(f"{format_bytes(vision['tower_activation_bytes'])} of them the vision tower's")
