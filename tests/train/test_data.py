"""Tests for memfit.train.data: formats, validation, masking, packing, batching, shipped assets."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from memfit.step.labels import IGNORE_INDEX
from memfit.step.batch import collate
from memfit.train.data import (
    BatchIterator,
    DataError,
    load_records,
    pack_examples,
    render_chat,
    tiny_tokenizer_path,
    tokenize_records,
)
from memfit.train.data.tokenization import mask_outside_spans

ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = ROOT / "examples" / "data"
#: The demo dataset ships inside the package (memfit fit --write points at the installed copy).
DEMO_FILE = ROOT / "src" / "memfit" / "assets" / "data" / "tiny-instruct.jsonl"
SHIPPED = {
    "tiny-instruct.jsonl": ("messages", 320),
    "alpaca-example.json": ("alpaca", 7),
    "alpaca-example.csv": ("alpaca", 7),
    "sharegpt-example.jsonl": ("sharegpt", 6),
    "text-example.jsonl": ("text", 6),
}

ALPACA = [
    {"instruction": "What is 2 + 3?", "input": "", "output": "2 + 3 = 5."},
    {"instruction": "Reverse the word.", "input": "tiger", "output": "regit"},
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "3 + 3 = 6."},
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_path())


@pytest.fixture()
def plain_tokenizer():
    """The tiny tokenizer without its chat template, so the default template is used."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_path())
    tok.chat_template = None
    return tok


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def labelled_runs(labels: list[int]) -> list[list[int]]:
    """Contiguous runs of trained label ids."""
    runs: list[list[int]] = []
    previous = IGNORE_INDEX
    for label in labels:
        if label != IGNORE_INDEX:
            if previous == IGNORE_INDEX:
                runs.append([])
            runs[-1].append(label)
        previous = label
    return runs


def data_error(paths, format="auto") -> str:
    with pytest.raises(DataError) as info:
        load_records(paths, format)
    return str(info.value)


# ---------------------------------------------------------------- formats


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_dataset_files_validate(name):
    records, fmt = load_records(DEMO_FILE if name == DEMO_FILE.name else DATA_DIR / name)
    assert (fmt, len(records)) == SHIPPED[name]


def test_shipped_datasets_are_what_the_script_writes():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_tiny_dataset.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_alpaca_loads_the_same_from_json_jsonl_csv_and_parquet(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(ALPACA), encoding="utf-8")
    write_jsonl(tmp_path / "a.jsonl", ALPACA)
    with open(tmp_path / "a.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=["instruction", "input", "output"])
        writer.writeheader()
        writer.writerows(ALPACA)
    paths = ["a.json", "a.jsonl", "a.csv"]
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(ALPACA), tmp_path / "a.parquet")
        paths.append("a.parquet")
    except ImportError:
        pass
    expected = [
        [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5."}],
        [{"role": "user", "content": "Reverse the word.\n\ntiger"}, {"role": "assistant", "content": "regit"}],
    ]
    for name in paths:
        records, fmt = load_records(tmp_path / name)
        assert fmt == "alpaca"
        assert [r["messages"] for r in records] == expected, name
    assert load_records(tmp_path / "a.jsonl")[0][1]["source"] == f"{tmp_path / 'a.jsonl'}, line 2"


def test_parquet_chat_records_load(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"messages": CHAT}]), tmp_path / "c.parquet")
    records, fmt = load_records(tmp_path / "c.parquet")
    assert fmt == "messages" and records[0]["messages"] == CHAT


def test_missing_pyarrow_says_how_to_install_it(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow...` raise ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    assert "pip install pyarrow" in data_error(tmp_path / "d.parquet")


def test_sharegpt_roles_map_onto_chat_roles(tmp_path):
    turns = [
        {"from": "system", "value": "S"}, {"from": "human", "value": "H"}, {"from": "gpt", "value": "G"},
        {"from": "user", "value": "U"}, {"from": "assistant", "value": "A"},
    ]
    records, fmt = load_records(write_jsonl(tmp_path / "s.jsonl", [{"conversations": turns}]))
    assert fmt == "sharegpt"
    assert [m["role"] for m in records[0]["messages"]] == ["system", "user", "assistant", "user", "assistant"]


def test_a_directory_loads_its_data_files(tmp_path):
    write_jsonl(tmp_path / "1.jsonl", [{"text": "one"}])
    write_jsonl(tmp_path / "2.jsonl", [{"text": "two"}, {"text": "three"}])
    (tmp_path / "notes.md").write_text("not data")
    records, fmt = load_records(tmp_path)
    assert fmt == "text" and [r["text"] for r in records] == ["one", "two", "three"]


def test_jsonl_saved_as_json_is_read_line_by_line(tmp_path):
    path = tmp_path / "lines.json"
    write_jsonl(path, [{"text": "a"}, {"text": "b"}])
    assert [r["text"] for r in load_records(path)[0]] == ["a", "b"]


@pytest.mark.parametrize(
    "record, fmt",
    [
        ({"instruction": "i", "output": "o"}, "alpaca"),
        ({"conversations": [{"from": "human", "value": "h"}, {"from": "gpt", "value": "g"}]}, "sharegpt"),
        ({"messages": CHAT}, "messages"),
        ({"text": "t", "meta": 1}, "text"),
    ],
)
def test_auto_detects_the_format_from_the_keys(tmp_path, record, fmt):
    assert load_records(write_jsonl(tmp_path / "x.jsonl", [record]))[1] == fmt


def test_ambiguous_and_unknown_keys_are_clear_errors(tmp_path):
    both = write_jsonl(tmp_path / "both.jsonl", [{"text": "t", "messages": CHAT}])
    message = data_error(both)
    assert "both.jsonl, line 1" in message and "several formats (messages, text)" in message
    # An explicit format settles it.
    assert load_records(both, "text")[1] == "text"
    other = write_jsonl(tmp_path / "other.jsonl", [{"prompt": "p", "completion": "c"}])
    message = data_error(other)
    assert "cannot tell the format from the keys (completion, prompt)" in message
    assert "alpaca (instruction, output)" in message
    assert "unknown format 'chatml'" in data_error(other, "chatml")


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "name, content, fmt, expected",
    [
        ("bad.jsonl", '{"text": "ok"}\n{"text": "no end"\n', "auto", "bad.jsonl, line 2: invalid JSON"),
        ("conv.jsonl", '{"text": "x"}\n', "sharegpt", "conv.jsonl, line 1: conversations: missing (required)"),
        (
            "role.jsonl",
            json.dumps({"messages": [{"role": "user", "content": "u"}, {"role": "bot", "content": "b"}]}),
            "auto",
            "role.jsonl, line 1: messages[1].role: unknown role 'bot'; expected one of system, user, assistant",
        ),
        (
            "gpt.jsonl",
            json.dumps({"conversations": [{"from": "human", "value": "h"}, {"from": "model", "value": "m"}]}),
            "auto",
            "gpt.jsonl, line 1: conversations[1].from: unknown role 'model'",
        ),
        ("empty_text.jsonl", '{"text": "  "}\n', "auto", "empty_text.jsonl, line 1: text: empty text"),
        (
            "type.jsonl",
            json.dumps({"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "a"}]}),
            "auto",
            "type.jsonl, line 1: messages[0].content: expected a string, got a number",
        ),
        (
            "parts.jsonl",
            json.dumps({"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
            "auto",
            "messages[0].content: expected a string, got a list (multimodal",
        ),
        ("empty.jsonl", "\n\n", "auto", "empty.jsonl: empty file"),
        ("none.json", "[]", "auto", "none.json: no records"),
        ("obj.json", '{"text": "t"}', "auto", "obj.json: top level is an object; expected a list of records"),
        (
            "noreply.jsonl",
            json.dumps({"messages": [{"role": "user", "content": "u"}]}),
            "auto",
            "noreply.jsonl, line 1: messages: conversation has no assistant turn",
        ),
        (
            "sys.jsonl",
            json.dumps({"messages": [
                {"role": "user", "content": "u"}, {"role": "system", "content": "s"},
                {"role": "assistant", "content": "a"},
            ]}),
            "auto",
            "sys.jsonl, line 1: messages[1].role: a system turn may only come first",
        ),
        ("out.json", json.dumps([{"instruction": "i", "output": 3}]), "auto", "out.json, record 1: output: expected a string"),
        ("noout.json", json.dumps([{"instruction": "i", "output": None}]), "alpaca", "noout.json, record 1: output: missing"),
        ("list.jsonl", '["text"]\n', "text", "list.jsonl, line 1: record is a list; expected an object"),
        ("chat.csv", "messages\nhello\n", "messages", "chat.csv: CSV columns hold flat text"),
        ("rows.csv", "text,extra\na,b\n\"c\",d,e\n", "auto", "rows.csv, line 3: row has more fields than the header"),
        ("notes.txt", "hello", "auto", "notes.txt: unsupported file type '.txt'"),
    ],
)
def test_validation_errors_name_file_record_and_field(tmp_path, name, content, fmt, expected):
    (tmp_path / name).write_text(content, encoding="utf-8")
    assert expected in data_error(tmp_path / name, fmt)


def test_missing_file_is_named(tmp_path):
    assert f"{tmp_path / 'nope.jsonl'}: no such file or directory" in data_error(tmp_path / "nope.jsonl")


def test_all_problems_are_collected_then_capped(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "u"}, {"role": "bot", "content": str(i)}]} for i in range(25)]
    message = data_error(write_jsonl(tmp_path / "many.jsonl", rows))
    assert message.startswith("found 25 problems")
    assert "many.jsonl, line 20: messages[1].role" in message
    assert "line 21" not in message and "... and 5 more not listed" in message


def test_problems_in_several_files_are_reported_together(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": ""}])
    (tmp_path / "b.jsonl").write_text('{"text": \n', encoding="utf-8")
    message = data_error([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], "text")
    assert "found 2 problems" in message
    assert "a.jsonl, line 1: text: empty text" in message and "b.jsonl, line 1: invalid JSON" in message


def test_mixed_formats_across_files_are_refused(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "t"}])
    write_jsonl(tmp_path / "b.jsonl", [{"messages": CHAT}])
    assert "look like the 'messages' format" in data_error([tmp_path / "a.jsonl", tmp_path / "b.jsonl"])


# ---------------------------------------------------------------- tokenization and masking


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
        "2 + 2 = 4.<|eos|>", "3 + 3 = 6.<|eos|>"
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
    assert sum((r["input_ids"] for r in rows), []) == expected_ids
    assert sum((r["labels"] for r in rows), []) == expected_labels
    assert sum((r["position_ids"] for r in rows), []) == expected_positions
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


def _tiny_llama(vocab_size: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def test_packed_rows_with_position_ids_keep_attention_inside_examples(tokenizer):
    import torch

    records, _ = load_records(DEMO_FILE)
    examples = tokenize_records(records[:3], tokenizer, seq_len=256)
    rows = tokenize_records(records[:3], tokenizer, seq_len=256, packing=True)
    assert len(rows) == 1
    model = _tiny_llama(len(tokenizer)).eval()
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


# ---------------------------------------------------------------- batching


def test_batch_iterator_resumes_exactly_mid_epoch():
    examples = list(range(23))
    straight = BatchIterator(examples, batch_size=5, seed=7)
    expected = [next(straight) for _ in range(14)]  # 5 batches an epoch: crosses two epoch ends
    for stop in (0, 3, 5, 7):
        first = BatchIterator(examples, batch_size=5, seed=7)
        seen = [next(first) for _ in range(stop)]
        state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
        resumed = BatchIterator(examples, batch_size=5, seed=7)
        resumed.load_state_dict(state)
        assert seen + [next(resumed) for _ in range(14 - stop)] == expected
    assert first.state_dict()["epoch"] == 1 and first.state_dict()["position"] == 10


def test_batch_iterator_epochs_are_permutations_and_seeded():
    iterator = BatchIterator(list(range(10)), batch_size=4, seed=1)
    assert iterator.batches_per_epoch() == 3
    epoch0 = sum((next(iterator) for _ in range(3)), [])
    epoch1 = sum((next(iterator) for _ in range(3)), [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(10)) and epoch0 != epoch1
    assert next(BatchIterator(list(range(10)), 4, seed=2)) != epoch0[:4]
    assert next(BatchIterator(list(range(10)), 4, shuffle=False)) == [0, 1, 2, 3]
    dropping = BatchIterator(list(range(10)), batch_size=4, seed=1, drop_last=True)
    assert [len(next(dropping)) for _ in range(4)] == [4, 4, 4, 4] and dropping.state_dict()["epoch"] == 1


def test_batch_iterator_refuses_a_state_from_other_data():
    state = BatchIterator(list(range(10)), batch_size=4, seed=1).state_dict()
    with pytest.raises(ValueError, match="num_examples: saved 10, now 11; seed: saved 1, now 2|seed: saved 1, now 2; num_examples: saved 10, now 11"):
        BatchIterator(list(range(11)), batch_size=4, seed=2).load_state_dict(state)


# ---------------------------------------------------------------- the tiny tokenizer


def test_tiny_tokenizer_loads_offline_and_round_trips(tokenizer, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_path())
    assert len(tok) == 512
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    for marker in ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"):
        assert tok.convert_tokens_to_ids(marker) in tok.all_special_ids
    text = "What is 17 + 25? 17 + 25 = 42.\nUnseen: Zürich, naïve, 東京, emoji 🙂"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert "<|assistant|>" in tok.chat_template


def test_tiny_tokenizer_files_are_what_the_script_writes():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_tiny_tokenizer.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_a_tiny_model_learns_the_shipped_dataset(tokenizer):
    """The whole path (load, tokenize, pack, batch, collate) feeds a model whose loss falls."""
    import torch

    records, _ = load_records(DEMO_FILE)
    rows = tokenize_records(records, tokenizer, seq_len=128, packing=True)
    model = _tiny_llama(len(tokenizer)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = BatchIterator(rows, batch_size=8, seed=0, drop_last=True)
    losses = []
    for _ in range(40):
        batch = collate(next(batches), tokenizer.pad_token_id)
        loss = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"], use_cache=False
        ).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, losses
