"""memfit fit of a vision-language model: the largest image its fastest fit takes, on the ladder of
square sides the family's processor lays out differently."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vision_configs import vision_config

import memfit
from memfit.planner.errors import PlanError
from memfit.planner.search.driver import fit
from memfit.planner.search.report import largest_image_line
from memfit.planner.search.request import FitRequest


def _fit(model_type: str, budget: str, seq_len: int):
    request = FitRequest(
        vision_config(model_type),
        budget=budget,
        batch_size=1,
        seq_len=seq_len,
        methods=("lora",),
        max_seq_len=False,
        workers=1,
        knobs={"image_max_pixels": 64 * 64},
    )
    return fit(request)


def _fits_at(result, side: int) -> bool:
    spec = {k: v for k, v in result.fits[0].spec.items() if k not in ("gpus", "shard")}
    try:
        return memfit.plan(
            vision_config("qwen2_5_vl"), budget="600MiB", **dict(spec, image_max_pixels=side * side)
        ).fits
    except PlanError:
        return False


def test_the_largest_image_is_the_last_rung_that_fits_the_memory():
    result = _fit("qwen2_5_vl", "600MiB", 4096)
    found = result.max_image
    assert found["limited_by"] == "memory" and found["method"] == "lora"
    side = found["image_size"][0]
    assert side % 28 == 0 and found["image_max_pixels"] == side * side
    assert found["tokens_per_image"] == (side // 28) ** 2
    assert _fits_at(result, side) and not _fits_at(result, side + 28)  # the next rung is over
    assert result.to_dict()["max_image"] == found
    assert largest_image_line(found).endswith("a larger one is over the memory")


def test_a_larger_image_whose_tokens_seq_len_cannot_hold_is_the_limit():
    found = _fit("qwen2_5_vl", "4GiB", 1024).max_image
    # 868 / 28 = 31: 961 image tokens and their two markers in 1,024; 32 x 32 would not be.
    assert (found["image_size"], found["tokens_per_image"], found["limited_by"]) == ([868, 868], 961, "seq_len")
    assert "868x868 pixels (image_max_pixels 753,424, 961 tokens each)" in largest_image_line(found)


def test_a_family_that_resizes_every_image_to_one_size_has_nothing_to_search():
    result = _fit("gemma3", "4GiB", 1024)
    found = result.max_image
    assert found["limited_by"] == "processor" and found["image_size"] == [64, 64]


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "llama4", "idefics3"])
def test_each_rung_is_a_new_layout(model_type):
    from memfit.models.build import make_config
    from memfit.models.vision import image_layout, image_sides

    config = make_config(vision_config(model_type))
    sides = image_sides(config)
    layouts = [image_layout(config, side * side) for side in sides]
    assert len({(lay.tokens, lay.pixel_shape) for lay in layouts}) == len(sides) > 1
    assert [lay.tokens for lay in layouts] == sorted(lay.tokens for lay in layouts)
