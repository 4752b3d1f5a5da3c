"""model_overrides that transformers refuses: one line naming the key, its value, transformers'
reason and the fix, from the config's validation (before any data is read or weights made)."""

from __future__ import annotations

import pytest
import yaml
from trainer_helpers import TINY_OVERRIDES, tiny_settings
from typer.testing import CliRunner

from memfit.cli import app
from memfit.train.config import ConfigError, validate_config
from memfit.train.overrides import override_problems


def _problems(tmp_path, **changes) -> list[str]:
    settings = tiny_settings(tmp_path / "run", model_overrides=dict(TINY_OVERRIDES, **changes))
    with pytest.raises(ConfigError) as info:
        validate_config(settings)
    assert info.value.exit_code == 2
    return info.value.problems


@pytest.mark.parametrize(
    ("changes", "key", "reason"),
    [
        (
            {"hidden_size": 63},
            "hidden_size: 63",
            "not a multiple of the number of attention heads",
        ),  # the config's check
        ({"hidden_size": "big"}, "hidden_size: 'big'", "expected int"),  # a field's type
        ({"hidden_act": "nope"}, "hidden_act: 'nope'", "KeyError: 'nope'"),  # refused only when the layer is made
        ({"intermediate_size": -5}, "intermediate_size: -5", "negative dimension"),
    ],
)
def test_a_refused_override_is_named_with_its_value_and_reason(tmp_path, changes, key, reason):
    (problem,) = _problems(tmp_path, **changes)
    assert problem.startswith(f"model_overrides.{key}: transformers refuses it ("), problem
    assert reason in problem
    assert "remove it from model_overrides" in problem


def test_overrides_that_only_fail_together_are_named_together(tmp_path):
    # The catalog model is 576 wide with 9 heads: 36 goes with its 9 heads, 8 heads with its 576,
    # but 36 is not a multiple of 8. Either change alone builds.
    (problem,) = _problems(tmp_path, hidden_size=36, num_attention_heads=8, num_key_value_heads=1)
    assert problem.startswith("model_overrides.hidden_size: 36 with model_overrides.num_attention_heads: 8:"), problem
    assert "Change one so that they agree" in problem


def test_overrides_that_build_are_taken(tmp_path):
    config = validate_config(tiny_settings(tmp_path / "run"))
    assert config.model_overrides["hidden_size"] == TINY_OVERRIDES["hidden_size"]
    assert override_problems({"model_type": "llama"}, {}) == []


def test_the_command_line_gets_one_error_line_before_any_work(tmp_path, monkeypatch):
    import memfit.train.recipe as recipe

    def no_training(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(recipe, "train", no_training)
    settings = tiny_settings(tmp_path / "run", model_overrides=dict(TINY_OVERRIDES, hidden_size=63))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(settings, sort_keys=False))
    result = CliRunner().invoke(app, ["train", str(path)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    text = " ".join(result.stderr.split())
    assert text.count("error:") == 1 and "model_overrides.hidden_size: 63" in text
    assert not (tmp_path / "run").exists()
