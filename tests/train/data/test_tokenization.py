"""Tokenization, label masks, truncation and packing (memfit.train.data.tokenization, .chat)."""

from __future__ import annotations

import pytest
from data_samples import CHAT, DEMO_FILE, labelled_runs, tiny_llama

from memfit.step.batch import collate
from memfit.step.labels import IGNORE_INDEX
from memfit.train.data import DataError, load_records, pack_examples, render_chat, tiny_tokenizer_path, tokenize_records
from memfit.train.data.tokenization import mask_outside_spans


def test_only_assistant_turns_are_trained_by_default(tokenizer):
    records, _ = load_records(DEMO_FILE)
    examples = tokenize_records(records, tokenizer, seq_len=256)
    assert len(examples) == len(records)
    for record, example in zip(records, examples):
        replies = [m["content"] + "<|end|>" for m in record["messages"] if m["role"] == "assistant"]
        runs = [tokenizer.decode(run) for run in labelled_runs(example["labels"])]
        assert runs == replies, record["source"]
        trained = [i for i, label in zip(example["input_ids"], example["labels"]) if label != IGNORE_INDEX]
        assert trained == [label for label in example["labels"] if label != IGNORE_INDEX]


def test_default_template_masks_by_turn(plain_tokenizer):
    text, spans = render_chat(plain_tokenizer, CHAT)
    assert text == (
        "<|bos|><|system|>\nBe brief.<|eos|><|user|>\nWhat is 2 + 2?<|eos|><|assistant|>\n2 + 2 = 4.<|eos|>"
        "<|user|>\nAnd 3 + 3?<|eos|><|assistant|>\n3 + 3 = 6.<|eos|>"
    )
    assert [text[a:b] for a, b in spans] == ["2 + 2 = 4.<|eos|>", "3 + 3 = 6.<|eos|>"]
    example = tokenize_records([{"messages": CHAT}], plain_tokenizer, seq_len=128)[0]
    assert [plain_tokenizer.decode(r) for r in labelled_runs(example["labels"])] == [
        "2 + 2 = 4.<|eos|>",
        "3 + 3 = 6.<|eos|>",
    ]


def test_plain_text_markers_mask_the_same_way(plain_tokenizer):
    # Markers that are ordinary text (no special tokens) with the response right after a space.
    plain_tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}Assistant: {% endif %}"
    )
    example = tokenize_records([{"messages": CHAT[1:3]}], plain_tokenizer, seq_len=128)[0]
    runs = [plain_tokenizer.decode(r) for r in labelled_runs(example["labels"])]
    assert runs == ["2 + 2 = 4.\n"]


def test_a_token_straddling_the_response_start_is_trained():
    # Character spans: prompt [0, 10), response [10, 20); token 2 covers characters 8..12.
    offsets = [(0, 4), (4, 8), (8, 12), (12, 20), (20, 24)]
    labels = mask_outside_spans([5, 6, 7, 8, 9], offsets, [(10, 20)])
    assert labels == [IGNORE_INDEX, IGNORE_INDEX, 7, 8, IGNORE_INDEX]


def test_templates_that_rewrite_past_turns_are_refused(tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_path())
    # Past assistant turns lose their content, as templates that drop old reasoning do.
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n"
        "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}<|end|>"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    with pytest.raises(DataError, match="conv.jsonl, line 4: the chat template renders turn 2 differently"):
        tokenize_records([{"messages": CHAT, "source": "conv.jsonl, line 4"}], tok, seq_len=128)
    # Without masking there is no boundary to find.
    example = tokenize_records([{"messages": CHAT}], tok, seq_len=128, train_on_inputs=True)[0]
    assert example["labels"] == example["input_ids"]


def test_train_on_inputs_trains_every_token(tokenizer):
    example = tokenize_records([{"messages": CHAT}], tokenizer, seq_len=128, train_on_inputs=True)[0]
    assert example["labels"] == example["input_ids"]
    assert tokenizer.decode(example["input_ids"]) == tokenizer.apply_chat_template(CHAT, tokenize=False)


def test_text_records_train_every_token_and_end_with_eos(tokenizer):
    example = tokenize_records([{"text": "hello world"}], tokenizer, seq_len=64)[0]
    assert example["input_ids"][0] == tokenizer.bos_token_id
    assert example["input_ids"][-1] == tokenizer.eos_token_id
    assert example["labels"] == example["input_ids"]
    assert tokenizer.decode(example["input_ids"], skip_special_tokens=True) == "hello world"


def test_truncation_keeps_the_start(tokenizer):
    full = tokenize_records([{"messages": CHAT}], tokenizer, seq_len=512)[0]
    seq_len = len(full["input_ids"]) - 5
    cut = tokenize_records([{"messages": CHAT}], tokenizer, seq_len=seq_len)[0]
    assert cut["input_ids"] == full["input_ids"][:seq_len]
    assert cut["labels"] == full["labels"][:seq_len]


def test_examples_without_trained_tokens_after_truncation_are_dropped(tokenizer):
    long_prompt = [{"role": "user", "content": "word " * 60}, {"role": "assistant", "content": "ok"}]
    records = [{"messages": long_prompt, "source": "long.jsonl, line 1"}, {"messages": CHAT[1:3]}]
    with pytest.warns(UserWarning, match=r"dropped 1 of 2 examples .* \(first: long.jsonl, line 1\)"):
        examples = tokenize_records(records, tokenizer, seq_len=32)
    assert len(examples) == 1
    with pytest.raises(DataError, match="no example has a trained token within seq_len=32"), pytest.warns(UserWarning):
        tokenize_records(records[:1], tokenizer, seq_len=32)


def test_bad_tokenization_settings_are_reported_together(tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_path())
    tok.eos_token = None
    with pytest.raises(DataError) as info:
        tokenize_records([{"text": "x"}], tok, seq_len=1)
    assert "seq_len: must be an integer of at least 2, got 1" in str(info.value)
    assert "tokenizer: has no EOS token" in str(info.value)


# ---------------------------------------------------------------- packing


def test_packing_fills_rows_and_keeps_labels_masked(tokenizer):
    records, _ = load_records(DEMO_FILE)
    records = records[:40]
    seq_len = 64
    examples = tokenize_records(records, tokenizer, seq_len=seq_len)
    rows = tokenize_records(records, tokenizer, seq_len=seq_len, packing=True)
    assert all(len(r["input_ids"]) == seq_len for r in rows[:-1]) and 0 < len(rows[-1]["input_ids"]) <= seq_len
    eos = tokenizer.eos_token_id
    # Rebuild the expected stream: each example, its first label masked, then an untrained EOS.
    expected_ids, expected_labels, expected_positions = [], [], []
    for example in examples:
        expected_ids += example["input_ids"] + [eos]
        expected_labels += [IGNORE_INDEX] + example["labels"][1:] + [IGNORE_INDEX]
        expected_positions += list(range(len(example["input_ids"]) + 1))
    assert [t for r in rows for t in r["input_ids"]] == expected_ids
    assert [t for r in rows for t in r["labels"]] == expected_labels
    assert [t for r in rows for t in r["position_ids"]] == expected_positions
    # The trained tokens are the (truncated) assistant replies, nothing from prompts or separators.
    trained = [label for r in rows for label in r["labels"] if label != IGNORE_INDEX]
    replies = [label for e in examples for label in e["labels"] if label != IGNORE_INDEX]
    assert trained == replies
    assert tokenizer.decode(trained).startswith(records[0]["messages"][-1]["content"] + "<|end|>")


def test_packing_text_documents_uses_their_own_eos(tokenizer):
    docs = [{"input_ids": [0, 10, 11, 1], "labels": [0, 10, 11, 1]}, {"input_ids": [0, 12, 1], "labels": [0, 12, 1]}]
    rows = pack_examples(docs, seq_len=4, eos_id=1)
    assert [r["input_ids"] for r in rows] == [[0, 10, 11, 1], [0, 12, 1]]
    assert [r["labels"] for r in rows] == [[IGNORE_INDEX, 10, 11, 1], [IGNORE_INDEX, 12, 1]]
    assert [r["position_ids"] for r in rows] == [[0, 1, 2, 3], [0, 1, 2]]


def test_packed_rows_with_position_ids_keep_attention_inside_examples(tokenizer):
    import torch

    records, _ = load_records(DEMO_FILE)
    examples = tokenize_records(records[:3], tokenizer, seq_len=256)
    rows = tokenize_records(records[:3], tokenizer, seq_len=256, packing=True)
    assert len(rows) == 1
    model = tiny_llama(len(tokenizer)).eval()
    batch = collate(rows, tokenizer.pad_token_id)
    with torch.no_grad():
        # use_cache=False matters: with a cache present, transformers does not look for packed sequences.
        isolated = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
        crossing = model(input_ids=batch["input_ids"]).logits[0]
        start = 0
        for example in examples:
            alone = model(input_ids=torch.tensor([example["input_ids"]])).logits[0]
            length = len(example["input_ids"])
            torch.testing.assert_close(isolated[start : start + length], alone, atol=1e-5, rtol=1e-4)
            start += length + 1  # + the EOS separator
    second = len(examples[0]["input_ids"]) + 1
    # Without the positions (plain causal attention over the row) the second example sees the first.
    assert not torch.allclose(crossing[second : second + 5], isolated[second : second + 5], atol=1e-4)


# ---------------------------------------------------------------- prompt-completion


def test_a_text_completion_is_trained_with_the_eos_after_it(tokenizer):
    record = {"prompt": "What is 2 + 2? ", "completion": "2 + 2 = 4."}
    example = tokenize_records([record], tokenizer, seq_len=64)[0]
    # Tokenized in one piece, as the model sees the text at inference.
    assert example["input_ids"] == tokenizer("What is 2 + 2? 2 + 2 = 4.")["input_ids"] + [tokenizer.eos_token_id]
    runs = labelled_runs(example["labels"])
    assert len(runs) == 1 and tokenizer.decode(runs[0]).strip() == "2 + 2 = 4.<|eos|>"
    every = tokenize_records([record], tokenizer, seq_len=64, train_on_inputs=True)[0]
    assert every["labels"] == every["input_ids"]


def test_a_conversational_completion_trains_only_its_own_assistant_turns(tokenizer):
    record = {"messages": CHAT, "train_from": 4}  # the completion: the last assistant turn
    example = tokenize_records([record], tokenizer, seq_len=256)[0]
    assert [tokenizer.decode(run) for run in labelled_runs(example["labels"])] == ["3 + 3 = 6.<|end|>"]
    whole = tokenize_records([{"messages": CHAT}], tokenizer, seq_len=256)[0]
    assert example["input_ids"] == whole["input_ids"]


def test_packing_one_example_at_a_time_gives_the_same_rows():
    from memfit.train.data.tokenization import Packer

    examples = [{"input_ids": [0, 10 + i, 11 + i, 1], "labels": [0, 10 + i, 11 + i, 1]} for i in range(7)]
    packer = Packer(seq_len=5, eos_id=1)
    rows = []
    for example in examples:
        rows += packer.add(example)
        state = packer.state_dict()
        packer = Packer(seq_len=5, eos_id=1)
        packer.load_state_dict(state)  # the waiting tokens survive a checkpoint
    assert rows + packer.flush() == pack_examples(examples, seq_len=5, eos_id=1)
