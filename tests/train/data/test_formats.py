"""Record formats, column mapping and validation (memfit.train.data.formats, .readers)."""

from __future__ import annotations

import csv
import json
import sys

import pytest
from data_samples import ALPACA, CHAT, data_error, write_jsonl

from memfit.train.data import DataError, load_records


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


def test_missing_datasets_library_says_how_to_install_it(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    assert "d.parquet: reading Parquet files needs the datasets library: pip install datasets" in data_error(
        tmp_path / "d.parquet"
    )


def test_a_damaged_parquet_file_is_named(tmp_path):
    pytest.importorskip("datasets")
    (tmp_path / "d.parquet").write_bytes(b"PAR1 not a parquet file PAR1")
    assert f"{tmp_path / 'd.parquet'}: cannot read Parquet file:" in data_error(tmp_path / "d.parquet")


def test_sharegpt_roles_map_onto_chat_roles(tmp_path):
    turns = [
        {"from": "system", "value": "S"},
        {"from": "human", "value": "H"},
        {"from": "gpt", "value": "G"},
        {"from": "user", "value": "U"},
        {"from": "assistant", "value": "A"},
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
    other = write_jsonl(tmp_path / "other.jsonl", [{"question": "q", "answer": "a"}])
    message = data_error(other)
    assert "cannot tell the format from the keys (answer, question)" in message
    assert "alpaca (instruction, output)" in message and "prompt_completion (prompt, completion)" in message
    assert "columns: {field: column}" in message
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
            "messages[0].content[0].text: expected a string, got null",
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
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": "u"},
                        {"role": "system", "content": "s"},
                        {"role": "assistant", "content": "a"},
                    ]
                }
            ),
            "auto",
            "sys.jsonl, line 1: messages[1].role: a system turn may only come first",
        ),
        (
            "out.json",
            json.dumps([{"instruction": "i", "output": 3}]),
            "auto",
            "out.json, record 1: output: expected a string",
        ),
        (
            "noout.json",
            json.dumps([{"instruction": "i", "output": None}]),
            "alpaca",
            "noout.json, record 1: output: missing",
        ),
        ("list.jsonl", '["text"]\n', "text", "list.jsonl, line 1: record is a list; expected an object"),
        ("chat.csv", "messages\nhello\n", "messages", "chat.csv: CSV columns hold flat text"),
        ("rows.csv", 'text,extra\na,b\n"c",d,e\n', "auto", "rows.csv, line 3: row has more fields than the header"),
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


# ---------------------------------------------------------------- prompt-completion and column mapping


def test_prompt_completion_text_and_conversational_records(tmp_path):
    rows = [{"prompt": "The capital of France is", "completion": " Paris."}]
    records, fmt = load_records(write_jsonl(tmp_path / "pc.jsonl", rows))
    assert fmt == "prompt_completion"
    assert records == [
        {"prompt": "The capital of France is", "completion": " Paris.", "source": f"{tmp_path / 'pc.jsonl'}, line 1"}
    ]
    chat = [{"prompt": CHAT[:4], "completion": CHAT[4:]}]
    records, fmt = load_records(write_jsonl(tmp_path / "chat.jsonl", chat))
    assert fmt == "prompt_completion"
    assert records[0]["messages"] == CHAT and records[0]["train_from"] == 4  # only the completion is trained


@pytest.mark.parametrize(
    "row, expected",
    [
        (
            {"prompt": "p", "completion": [{"role": "assistant", "content": "c"}]},
            "prompt: expected a list of messages like the other field, got a string",
        ),
        (
            {"prompt": [{"role": "user", "content": "p"}], "completion": [{"role": "user", "content": "c"}]},
            "completion: has no assistant turn",
        ),
        (
            {
                "prompt": [{"role": "user", "content": "p"}],
                "completion": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "c"}],
            },
            "completion[0].role: a system turn may only come first",
        ),
        ({"prompt": "p", "completion": 3}, "completion: expected a string, got a number"),
        ({"prompt": "", "completion": "c"}, "prompt: empty text"),
    ],
)
def test_prompt_completion_problems_name_the_field(tmp_path, row, expected):
    message = data_error(write_jsonl(tmp_path / "pc.jsonl", [row]), "prompt_completion")
    assert f"pc.jsonl, line 1: {expected}" in message


def test_columns_map_a_files_fields_onto_memfits(tmp_path):
    rows = [{"question": "What is 2 + 3?", "answer": "5", "id": 1}]
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    records, fmt = load_records(path, columns={"prompt": "question", "completion": "answer"})
    assert fmt == "prompt_completion" and (records[0]["prompt"], records[0]["completion"]) == ("What is 2 + 3?", "5")
    # The mapped column wins over a field of the same name the file also has.
    path = write_jsonl(tmp_path / "both.jsonl", [{"text": "old", "body": "new"}])
    assert load_records(path, columns={"text": "body"})[0][0]["text"] == "new"
    # A column no record of the file has: one line naming the entry, the column and the file's columns.
    message = data_error(path, "messages", columns={"messages": "conversation"})
    assert message == (
        f"{path}: columns: messages: no column 'conversation' in the file (its columns: text, body); "
        "map messages to one of them, e.g. columns: {messages: text}"
    )


@pytest.mark.parametrize(
    "row, columns, fix",
    [
        # SFT: the file's own messages would be trained, the mapping ignored.
        (
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
            {"messages": "conversation"},
            "(its columns: messages); remove the entry to read its own 'messages' column, or map messages to another column",
        ),
        # Pairs: the file's own chosen / rejected would be trained.
        (
            {"prompt": "Hi", "chosen": " a", "rejected": " b"},
            {"chosen": "good", "rejected": "bad"},
            "(its columns: prompt, chosen, rejected); remove the entry to read its own 'chosen' column, or map chosen to another column",
        ),
        # SFT without the field: the format could not be told, and the message never named the column.
        (
            {"query": "Hi", "response": "Hello"},
            {"instruction": "question", "output": "response"},
            "(its columns: query, response); map instruction to one of them, e.g. columns: {instruction: query}",
        ),
    ],
)
def test_a_column_the_mapping_names_and_the_file_lacks_is_refused_in_one_line(tmp_path, row, columns, fix):
    path = write_jsonl(tmp_path / "f.jsonl", [row, row])
    with pytest.raises(DataError) as err:
        load_records(path, columns=columns, name="data[1]")
    field, column = next((f, c) for f, c in columns.items() if c not in row)
    assert str(err.value) == f"data[1]: {path}: columns: {field}: no column {column!r} in the file {fix}"


def test_a_column_only_some_records_have_is_mapped(tmp_path):
    rows = [{"instruction": "Hi", "output": "Hello"}, {"instruction": "Hi", "output": "Hello", "persona": "Be brief."}]
    records, _ = load_records(write_jsonl(tmp_path / "f.jsonl", rows), columns={"system": "persona"})
    assert [r["messages"][0]["role"] for r in records] == ["user", "system"]


def test_arrow_files_load_like_parquet(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(ALPACA).save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    records, fmt = load_records(arrow)
    assert fmt == "alpaca" and records[1]["messages"][0]["content"] == "Reverse the word.\n\ntiger"
    assert records[1]["source"] == f"{arrow}, row 2"
