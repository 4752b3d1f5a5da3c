"""grpo's reward functions: named as TRL takes them, loaded and checked before the model loads,
each problem one line naming the entry."""

from __future__ import annotations

import math

import pytest

from memfit.train.rewards import (
    BUILTINS,
    RewardError,
    check_rewards,
    length,
    load_rewards,
    score,
    spec_problems,
    think_format,
)


def test_the_built_in_rewards_score_text_and_conversational_completions():
    assert think_format(["<think>a</think> b", "no", [{"role": "assistant", "content": "<think>x</think>"}]]) == [
        1.0,
        0.0,
        1.0,
    ]
    assert length(["x" * 32, "x" * 16, "", "x" * 64]) == [1.0, 0.5, 0.0, 0.0]
    assert length(["abcd"], target_length=[8]) == [0.5]
    assert set(BUILTINS) == {"think_format", "length"}


def test_a_file_function_and_a_module_function_load_with_their_names_and_weights(tmp_path):
    (tmp_path / "my_rewards.py").write_text(
        "def shout(prompts, completions, **kwargs):\n    return [float(c.isupper()) for c in completions]\n"
    )
    rewards = load_rewards(
        [f"{tmp_path / 'my_rewards.py'}:shout", "memfit.train.rewards:length", "think_format"], [2.0, 1.0, 0.5]
    )
    assert [(r.name, r.weight) for r in rewards] == [("shout", 2.0), ("length", 1.0), ("think_format", 0.5)]
    table = score(rewards, ["p", "p"], ["ABC", "abc"], [[1], [2]], {})
    assert table.shape == (2, 3) and table[:, 0].tolist() == [1.0, 0.0]


@pytest.mark.parametrize(
    "entry, says",
    [
        ("missing.py:f", "is not a file"),
        ("nope", "is not a built-in reward"),
        ("memfit.train.rewards:not_there", "defines no 'not_there'"),
        ("memfit.train.rewards:DEFAULT_TARGET_CHARS", "is a int, not a function"),
        ("no_such_package_xyz:f", "importing no_such_package_xyz failed: ModuleNotFoundError"),
        ("file.py:1bad", "is not a function name"),
    ],
)
def test_a_bad_entry_is_one_line_naming_it(tmp_path, entry, says):
    with pytest.raises(RewardError) as err:
        load_rewards([entry], base_dir=tmp_path)
    assert str(err.value).startswith("reward_funcs[0]: ") and says in str(err.value) and "\n" not in str(err.value)


def test_weights_must_match_and_be_numbers():
    assert spec_problems(["length", "think_format"], [1.0]) == [
        "reward_weights: 1 weights for 2 reward_funcs: give one weight each"
    ]
    assert spec_problems(["length"], [True])[0].startswith("reward_weights[0]: True is not a number")


@pytest.mark.parametrize(
    "body, says",
    [
        ("return 1.0", "returned a float: return a list of 1 numbers"),
        ("return [1.0, 2.0]", "returned 2 rewards for 1 completions"),
        ("return ['high']", "returned 'high' among its rewards"),
        ("return [float('nan')]", "returned nan among its rewards"),
        ("raise KeyError('answer')", "raised KeyError: 'answer'"),
    ],
)
def test_a_wrong_return_is_found_by_calling_it_once_before_training(tmp_path, body, says):
    (tmp_path / "bad.py").write_text(f"def reward(prompts, completions, **kwargs):\n    {body}\n")
    rewards = load_rewards([f"{tmp_path / 'bad.py'}:reward"])
    with pytest.raises(RewardError, match="^reward_funcs\\[0\\]") as err:
        check_rewards(rewards, {"prompt": "Hi", "columns": {"answer": 3}})
    assert says in str(err.value)


def test_none_is_not_scored_and_the_columns_reach_the_function(tmp_path):
    (tmp_path / "cols.py").write_text(
        "def r(prompts, completions, answer, **kw):\n    return [None if a is None else float(a) for a in answer]\n"
    )
    rewards = load_rewards([f"{tmp_path / 'cols.py'}:r"])
    table = score(rewards, ["a", "b"], ["x", "y"], [[], []], {"answer": [None, 2]})
    assert math.isnan(table[0, 0]) and table[1, 0] == 2.0
