"""grpo's data: prompt-only records (TRL's format), their other fields kept, tokenized as TRL does."""

from __future__ import annotations

import json

import pytest

from memfit.train.data.errors import DataError
from memfit.train.data.formats import load_records
from memfit.train.data.prompts import tokenize_prompts


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompt_records_are_detected_and_keep_their_other_fields(tmp_path):
    path = _jsonl(
        tmp_path / "p.jsonl",
        [{"prompt": "2+2?", "answer": "4"}, {"prompt": [{"role": "user", "content": "Hi"}], "answer": "hello"}],
    )
    records, fmt = load_records(path)
    assert fmt == "prompt"
    assert records[0]["rollout"] == {"prompt": "2+2?", "columns": {"answer": "4"}}
    # A prompt with a completion is still the prompt-completion format.
    _, other = load_records(_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}]))
    assert other == "prompt_completion"


def test_a_prompt_ending_with_the_assistant_is_refused(tmp_path):
    path = _jsonl(
        tmp_path / "p.jsonl", [{"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "yo"}]}]
    )
    with pytest.raises(DataError, match="ends with an assistant turn"):
        load_records(path, format="prompt")


def test_prompts_tokenize_as_trl_does_and_keep_their_last_tokens(tmp_path, tokenizer):
    from memfit.train.generation import prompt_token_ids

    records, _ = load_records(
        _jsonl(tmp_path / "p.jsonl", [{"prompt": "abcdefghij"}, {"prompt": [{"role": "user", "content": "Hi"}]}])
    )
    examples, stats = tokenize_prompts(records, tokenizer, budget=6)
    whole = tokenizer("abcdefghij")["input_ids"]
    assert examples[0]["input_ids"] == whole[-6:] and examples[0]["prompt"] == "abcdefghij"
    chat = prompt_token_ids(tokenizer, [{"role": "user", "content": "Hi"}])
    assert examples[1]["input_ids"] == chat[-6:]
    assert stats.prompts == 2 and stats.truncated == 2 and stats.longest == max(len(whole), len(chat))
    assert "keep their last tokens" in stats.summary()
