"""Preference pairs: the formats people have, detected like the SFT formats; bad pairs named; cut to seq_len."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from memfit.step.labels import IGNORE_INDEX
from memfit.train.data import DataError, load_records, tiny_tokenizer_path
from memfit.train.data.pairs import fit_pair, tokenize_pairs


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_path()))


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


USER = {"role": "user", "content": "What is 2 + 2?"}
GOOD = {"role": "assistant", "content": "2 + 2 = 4."}
BAD = {"role": "assistant", "content": "No idea."}


@pytest.mark.parametrize(
    "row, prompt, chat",
    [
        ({"prompt": "Q: 2 + 2?\nA:", "chosen": " 4", "rejected": " 5"}, "Q: 2 + 2?\nA:", False),
        (
            {"chosen": "Q: 2 + 2?\nA: 4", "rejected": "Q: 2 + 2?\nA: 5"},
            "Q: 2 + 2?\nA:",
            False,
        ),  # implicit: the shared text
        ({"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]}, [USER], True),
        (
            {"prompt": "What is 2 + 2?", "chosen": [GOOD], "rejected": [BAD]},
            [USER],
            True,
        ),  # a string prompt is a user turn
        ({"chosen": [USER, GOOD], "rejected": [USER, BAD]}, [USER], True),  # whole conversations: the shared turns
        ({"prompt": "What is 2 + 2?", "chosen": [USER, GOOD], "rejected": [USER, BAD]}, [USER], True),
    ],
    ids=["text", "text implicit", "chat", "chat string prompt", "conversations", "conversations with their prompt"],
)
def test_pair_formats_are_detected_and_normalized(tmp_path, row, prompt, chat):
    records, fmt = load_records(_write(tmp_path / "pairs.jsonl", [row]))
    assert fmt == "preference"
    pair = records[0]["pair"]
    assert pair["prompt"] == prompt and pair["chat"] is chat
    assert records[0]["source"].endswith("pairs.jsonl, line 1")


def test_a_broken_pair_names_the_file_line_and_field(tmp_path):
    rows = [
        {"prompt": "Hi", "chosen": " a", "rejected": " b"},
        {"prompt": "Hi", "chosen": " a", "rejected": 7},
        {"prompt": [USER], "chosen": [GOOD], "rejected": [{"role": "bot", "content": "x"}]},
        {"prompt": "Hi", "chosen": " same", "rejected": " same"},
        {"chosen": [USER, GOOD], "rejected": [USER, BAD], "prompt": "Something else"},
        {"prompt": [USER], "chosen": [USER], "rejected": [BAD]},
    ]
    with pytest.raises(DataError) as err:
        load_records(_write(tmp_path / "d.jsonl", rows))
    text = str(err.value)
    assert "found 5 problems" in text
    assert "d.jsonl, line 2: rejected: expected a string or a list of messages, got a number" in text
    assert "d.jsonl, line 3: rejected[0].role: unknown role 'bot'" in text
    assert "d.jsonl, line 4: rejected: chosen and rejected are the same answer" in text
    assert "d.jsonl, line 5: prompt: differs from the turns chosen and rejected start with" in text
    assert "d.jsonl, line 6: chosen: the answer must start with an assistant turn" in text


def test_a_prompt_that_ends_with_an_assistant_turn_is_refused_as_generate_refuses_it(tmp_path):
    from memfit.train.generation import prompt_problem

    rows = [
        {"prompt": [USER, GOOD], "chosen": [GOOD], "rejected": [BAD]},  # two assistant turns in a row
        {"prompt": [USER, GOOD, USER], "chosen": [GOOD], "rejected": [BAD]},
    ]  # an earlier assistant turn is context
    with pytest.raises(DataError) as err:
        load_records(_write(tmp_path / "p.jsonl", rows))
    assert str(err.value) == f"{tmp_path / 'p.jsonl'}, line 1: prompt: {prompt_problem([USER, GOOD])}"
    assert prompt_problem([USER, GOOD]).startswith(
        "ends with an assistant message, so the reply would be a second assistant turn"
    )


@pytest.mark.parametrize(
    "row, what",
    [
        ({"chosen": "Yes, it is.", "rejected": "No."}, "chosen and rejected start with no text in common"),
        (
            {"chosen": [USER, GOOD], "rejected": [{"role": "user", "content": "What is 3 + 3?"}, BAD]},
            "the conversations chosen and rejected start with no turn in common",
        ),
    ],
    ids=["text", "conversations"],
)
def test_an_implicit_prompt_with_nothing_in_common_is_refused(tmp_path, row, what):
    """TRL's extract_prompt takes an empty prompt here (and DPO then trains answers to nothing)."""
    with pytest.raises(DataError) as err:
        load_records(_write(tmp_path / "p.jsonl", [{"chosen": "Q: 2 + 2? A: 4", "rejected": "Q: 2 + 2? A: 5"}, row]))
    assert str(err.value) == (
        f"{tmp_path / 'p.jsonl'}, line 2: prompt: missing, and {what} to take as "
        "the prompt (the implicit prompt); give the prompt, or start both "
        + ("answers with it" if isinstance(row["chosen"], str) else "with its turns")
    )


def test_pairs_tokenize_with_the_prompt_unscored_and_an_eos_after_text_answers(tmp_path, tokenizer):
    records, _ = load_records(
        _write(tmp_path / "p.jsonl", [{"prompt": "Is it?", "chosen": " Yes.", "rejected": " No."}])
    )
    (pair,), stats = tokenize_pairs(records, tokenizer, seq_len=64)
    prompt = list(tokenizer("Is it?")["input_ids"])
    for name, answer in (("chosen", " Yes."), ("rejected", " No.")):
        seq = pair[name]
        assert seq["input_ids"] == list(tokenizer("Is it?" + answer + tokenizer.eos_token)["input_ids"])
        assert seq["input_ids"][-1] == tokenizer.eos_token_id
        assert seq["labels"][: len(prompt)] == [IGNORE_INDEX] * len(prompt)
        assert seq["labels"][len(prompt) :] == seq["input_ids"][len(prompt) :]
    assert stats.pairs == 1 and stats.prompts_cut == stats.answers_cut == 0


def test_chat_pairs_are_rendered_with_the_template(tmp_path, tokenizer):
    from memfit.train.data.chat import render_messages

    records, _ = load_records(_write(tmp_path / "c.jsonl", [{"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]}]))
    (pair,), _ = tokenize_pairs(records, tokenizer, seq_len=128)
    full = list(tokenizer(render_messages(tokenizer, [USER, GOOD]), add_special_tokens=False)["input_ids"])
    assert pair["chosen"]["input_ids"] == full
    answer = [t for t in pair["chosen"]["labels"] if t != IGNORE_INDEX]
    assert tokenizer.decode(answer).strip().startswith("2 + 2 = 4.")


def test_a_pair_longer_than_seq_len_keeps_the_end_of_its_prompt_and_the_start_of_its_answers():
    prompt, chosen, rejected = list(range(100, 120)), list(range(200, 210)), list(range(300, 304))
    # The answers fit beside the prompt's last 6 tokens: the prompt is cut from the left.
    p, c, r, cut = fit_pair(prompt, chosen, rejected, 16)
    assert p == prompt[-8:] and c == chosen[:8] and r == rejected and cut == (1, 1)
    p, c, r, cut = fit_pair(prompt, chosen[:4], rejected, 16)
    assert p == prompt[-12:] and c == chosen[:4] and cut == (1, 0)
    assert fit_pair(prompt[:4], chosen, rejected, 16)[3] == (0, 0)


def test_cuts_are_counted_in_the_summary(tmp_path, tokenizer):
    long_prompt = "word " * 60
    rows = [
        {"prompt": long_prompt, "chosen": " yes " * 30, "rejected": " no"},
        {"prompt": "Hi", "chosen": " a", "rejected": " b"},
    ]
    records, _ = load_records(_write(tmp_path / "l.jsonl", rows))
    examples, stats = tokenize_pairs(records, tokenizer, seq_len=32)
    assert max(len(s["input_ids"]) for e in examples for s in (e["chosen"], e["rejected"])) <= 32
    assert (stats.pairs, stats.prompts_cut, stats.answers_cut) == (2, 1, 1)
    assert (
        "1 prompts cut from the left (their end kept), 1 with an answer cut at the end (its start kept)"
        in stats.summary(32)
    )


def test_a_preference_run_refuses_sft_data_in_one_line(tmp_path):
    from memfit.train.config import validate_config
    from memfit.train.errors import TrainError
    from memfit.train.examples import load_tokenizer, prepare_data

    data = _write(tmp_path / "sft.jsonl", [{"messages": [USER, GOOD]}])
    pairs = _write(tmp_path / "pairs.jsonl", [{"prompt": "Hi", "chosen": " a", "rejected": " b"}])
    config = validate_config({"model": "smollm2-135m", "init": "random", "data": str(data), "objective": "dpo"})
    with pytest.raises(TrainError, match=r"^data: objective: dpo trains on preference pairs .* holds messages records"):
        prepare_data(config, load_tokenizer(config))
    config = validate_config(
        {"model": "smollm2-135m", "init": "random", "data": str(pairs), "eval_data": str(data), "objective": "dpo"}
    )
    with pytest.raises(
        TrainError, match=r"^eval_data: objective: dpo trains on preference pairs .* holds messages records"
    ):
        prepare_data(config, load_tokenizer(config))


@pytest.mark.parametrize(
    "objective, left_out, other", [("sft", "data[1]", "dpo, orpo or simpo"), ("dpo", "data[0]", "sft")]
)
def test_a_mix_of_pairs_and_other_records_names_each_source_with_its_format(tmp_path, objective, left_out, other):
    from memfit.train.config import validate_config
    from memfit.train.errors import TrainError
    from memfit.train.examples import load_tokenizer, prepare_data

    sft = _write(tmp_path / "sft.jsonl", [{"messages": [USER, GOOD]}])
    pairs = _write(tmp_path / "pairs.jsonl", [{"prompt": "Hi", "chosen": " a", "rejected": " b"}])
    config = validate_config(
        {"model": "smollm2-135m", "init": "random", "data": [str(sft), str(pairs)], "objective": objective}
    )
    with pytest.raises(TrainError) as err:
        prepare_data(config, load_tokenizer(config))
    trains = "preference pairs" if objective == "dpo" else "records that are not pairs"
    assert str(err.value) == (
        f"data: data[0] ({sft}) holds messages records; data[1] ({pairs}) holds preference pairs (chosen and rejected): they "
        f"cannot be mixed in one objective, and objective: {objective} trains on {trains}. Leave out {left_out}, or train on "
        f"it in a run of its own with objective: {other}."
    )


def test_a_streamed_mix_of_pairs_and_other_records_names_each_source(tmp_path):
    from memfit.train.config import validate_config
    from memfit.train.errors import TrainError
    from memfit.train.examples import load_tokenizer, prepare_data

    sft = _write(tmp_path / "sft.jsonl", [{"messages": [USER, GOOD]}])
    pairs = _write(tmp_path / "pairs.jsonl", [{"prompt": "Hi", "chosen": " a", "rejected": " b"}])
    config = validate_config(
        {"model": "smollm2-135m", "init": "random", "data": [str(pairs), str(sft)], "streaming": True, "max_steps": 1}
    )
    with pytest.raises(
        TrainError,
        match=r"^data: data\[0\] \(.*pairs.jsonl\) holds preference pairs \(chosen and rejected\); "
        r"data\[1\] \(.*sft.jsonl\) holds messages records: they cannot be mixed",
    ):
        prepare_data(config, load_tokenizer(config))


def test_a_next_token_run_refuses_pairs_in_one_line(tmp_path):
    from memfit.train.config import validate_config
    from memfit.train.errors import TrainError
    from memfit.train.examples import load_tokenizer, prepare_examples

    data = _write(tmp_path / "pairs.jsonl", [{"prompt": "Hi", "chosen": " a", "rejected": " b"}])
    config = validate_config({"model": "smollm2-135m", "init": "random", "data": str(data)})
    with pytest.raises(
        TrainError, match=r"holds preference pairs .* objective: sft does not train on. Set objective: dpo"
    ):
        prepare_examples(config, load_tokenizer(config))


def test_a_preference_run_is_not_streamed(tmp_path):
    from memfit.train.config import ConfigError, validate_config

    pairs = _write(tmp_path / "pairs.jsonl", [{"prompt": "Hi", "chosen": " a", "rejected": " b"}])
    with pytest.raises(ConfigError, match=r"streaming: true with objective: dpo: preference pairs are read in memory"):
        validate_config(
            {
                "model": "smollm2-135m",
                "init": "random",
                "data": str(pairs),
                "objective": "dpo",
                "streaming": True,
                "max_steps": 2,
            }
        )


def test_pairs_load_from_a_hub_dataset_id(data_hub, tmp_path):
    from hub_datasets import PREFERENCES

    from memfit.train.config import validate_config
    from memfit.train.examples import load_tokenizer, prepare_data

    config = validate_config(
        {
            "model": "smollm2-135m",
            "init": "random",
            "data": PREFERENCES,
            "objective": "dpo",
            "seq_len": 96,
            "eval_split": 0.25,
        }
    )
    data = prepare_data(config, load_tokenizer(config))
    assert (len(data.train_examples), len(data.eval_examples), data.pair_stats.pairs) == (36, 12, 36)
    assert all(set(e) == {"chosen", "rejected"} for e in data.train_examples)
    assert data.record["data"][0]["commit"] == data_hub.commits[PREFERENCES]


def test_columns_map_a_files_fields_onto_a_pair_mixed_with_a_hub_dataset(data_hub, tmp_path):
    from hub_datasets import PREFERENCES

    from memfit.train.config import validate_config
    from memfit.train.examples import load_tokenizer, prepare_data

    rows = [
        {"question": f"Is {n} even?", "good": " yes" if n % 2 == 0 else " no", "bad": " no" if n % 2 == 0 else " yes"}
        for n in range(20)
    ]
    local = {
        "path": str(_write(tmp_path / "mine.jsonl", rows)),
        "columns": {"prompt": "question", "chosen": "good", "rejected": "bad"},
        "weight": 0.5,
    }
    config = validate_config(
        {
            "model": "smollm2-135m",
            "init": "random",
            "objective": "simpo",
            "seq_len": 96,
            "data": [local, {"path": PREFERENCES, "weight": 0.5}],
        }
    )
    data = prepare_data(config, load_tokenizer(config))
    assert (
        data.pair_stats.pairs == len(data.train_examples) >= 48
    )  # every pair of both drawn at least once (all_exhausted)
    tokenizer = load_tokenizer(config)
    decoded = [tokenizer.decode(e["chosen"]["input_ids"]) for e in data.train_examples]
    mine = [text for text in decoded if "even?" in text]
    assert {text.split("?")[-1].split(tokenizer.eos_token)[0] for text in mine} == {" yes", " no"}
    assert len(mine) >= 20 and len(decoded) - len(mine) >= 48


def test_a_dpo_run_trains_on_a_hub_dataset_id(data_hub, tmp_path):
    import json

    from hub_datasets import PREFERENCES
    from trainer_helpers import tiny_config

    from memfit.train.recipe import train

    result = train(
        tiny_config(tmp_path / "run", data=PREFERENCES, objective="dpo", batch_size=2, max_steps=2, seq_len=96),
        progress=False,
    )
    record = json.loads((result.run_dir / "run.json").read_text())
    assert result.status == "completed" and record["pairs"]["pairs"] == 48
    assert record["data"]["data"][0]["commit"] == data_hub.commits[PREFERENCES]
