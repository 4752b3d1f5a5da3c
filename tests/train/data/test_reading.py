"""A config's sources into records or a stream (memfit.train.data.reading): each source with its own
format and columns, mixes by weight, a stream's first rows checked before the run starts."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest
from data_samples import ALPACA, CHAT, DEMO_FILE, write_jsonl

from memfit.train.data.errors import DataError
from memfit.train.data.reading import load_sources, open_stream
from memfit.train.data.sources import DataSource


def test_sources_of_different_formats_are_read_each_in_its_own(tmp_path):
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", ALPACA)
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"q": "2 + 2?", "a": "4"}])
    loaded = load_sources(
        [DataSource(path=str(alpaca)), DataSource(path=str(pairs), columns={"prompt": "q", "completion": "a"})]
    )
    assert loaded.formats == ["alpaca", "prompt_completion"] and loaded.commits == [None, None]
    assert [("messages" in r, "prompt" in r) for r in loaded.records] == [(True, False), (True, False), (False, True)]
    explicit = load_sources(
        [DataSource(path=str(write_jsonl(tmp_path / "both.jsonl", [{"text": "t", "messages": CHAT}])), format="text")]
    )
    assert explicit.formats == ["text"]


def test_weighted_sources_are_mixed_by_the_seed(tmp_path):
    texts = write_jsonl(tmp_path / "texts.jsonl", [{"text": f"t{i}"} for i in range(60)])
    chats = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT} for _ in range(10)])
    sources = [DataSource(path=str(texts), weight=3), DataSource(path=str(chats), weight=1)]
    pytest.importorskip("datasets")
    mixed = load_sources(sources, seed=0).records
    assert mixed == load_sources(sources, seed=0).records and mixed != load_sources(sources, seed=1).records
    kinds = Counter("text" if "text" in r else "chat" for r in mixed)
    assert {r["text"] for r in mixed if "text" in r} == {f"t{i}" for i in range(60)}  # all_exhausted: every row
    assert 0.15 < kinds["chat"] / len(mixed) < 0.35  # weights 3 : 1
    first = load_sources(sources, seed=0, stopping_strategy="first_exhausted").records
    assert Counter("text" if "text" in r else "chat" for r in first)["chat"] == 10 and len(first) < len(mixed)


def test_the_first_source_with_problems_lists_them_all(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "bot", "content": "x"}]}, {"messages": "x"}])
    with pytest.raises(DataError) as info:
        load_sources([DataSource(path=str(DEMO_FILE)), DataSource(path=str(bad))])
    assert "found 2 problems" in str(info.value) and "bad.jsonl, line 2: messages: expected a list of turns" in str(
        info.value
    )


def stream_of(*sources: DataSource, **kwargs):
    return open_stream(
        list(sources), "data", tokenize=lambda record: {"input_ids": [len(json.dumps(record))], "labels": [1]}, **kwargs
    )


def test_a_local_file_streams_and_its_first_rows_are_checked(tmp_path):
    pytest.importorskip("datasets")
    stream = stream_of(DataSource(path=str(DEMO_FILE)))
    assert stream.formats == ["messages"] and len(stream.examples) == 16
    rows = [json.dumps([0, {"messages": CHAT}]), json.dumps([0, {"messages": [{"role": "bot", "content": "x"}]}])]
    assert stream.to_example(rows[0])[1] is None
    example, problem = stream.to_example(rows[1])
    assert example is None and problem.startswith(
        f"{DEMO_FILE}, a row of the stream: messages[0].role: unknown role 'bot'"
    )
    bad = write_jsonl(
        tmp_path / "bad.jsonl", [{"messages": CHAT}, {"text": "x"}, {"messages": [{"role": "user", "content": "u"}]}]
    )
    with pytest.raises(DataError) as info:
        stream_of(DataSource(path=str(bad)))
    message = str(info.value)
    assert message.startswith("found 2 problems in the first 3 rows of")
    # datasets gives every row every column (null where a row has none): row 2's null messages is missing.
    assert "bad.jsonl, row 2: messages: missing (required)" in message
    assert "bad.jsonl, row 3: messages: conversation has no assistant turn" in message


def test_reading_local_json_files_does_not_import_datasets():
    code = (
        "import sys; from memfit.train.data.reading import load_sources; from memfit.train.data.sources import DataSource; "
        f"load_sources([DataSource(path={str(DEMO_FILE)!r})]); print('datasets' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_a_folder_written_by_save_to_disk_is_read_with_its_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ALPACA), "test": datasets.Dataset.from_list(ALPACA[:1])}
    )
    splits.save_to_disk(str(tmp_path / "saved"))
    loaded = load_sources([DataSource(path=str(tmp_path / "saved"), split="test")])
    assert loaded.formats == ["alpaca"] and len(loaded.records) == 1
    assert loaded.records[0]["source"] == f"{tmp_path / 'saved'} (split test), row 1"
    with pytest.raises(DataError, match=r"saved: no split 'train_sft'; its splits are train, test: set split: train"):
        load_sources([DataSource(path=str(tmp_path / "saved"), split="train_sft")])
    stream = stream_of(DataSource(path=str(tmp_path / "saved")))
    assert stream.formats == ["alpaca"] and len(stream.examples) == 2


def _empty_parquet(path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)


@pytest.mark.parametrize(
    "name, make, problem",
    [
        (
            "empty.parquet",
            _empty_parquet,
            "no records (a Parquet file of 0 rows): give a file with records, or leave it out of data",
        ),
        (
            "empty.jsonl",
            lambda path: path.write_bytes(b""),
            "empty file (0 bytes): give a file with records, or leave it out of data",
        ),
        (
            "blank.jsonl",
            lambda path: path.write_text("\n \n"),
            "no records: give a source that holds records, or leave it out of data",
        ),
    ],
)
def test_an_empty_file_is_named_in_one_line_streamed_or_not(tmp_path, name, make, problem):
    pytest.importorskip("datasets")
    path = tmp_path / name
    make(path)
    with pytest.raises(DataError) as info:
        stream_of(DataSource(path=str(path)))
    assert str(info.value) == f"data: {path}: {problem}"
    with pytest.raises(DataError) as info:
        load_sources([DataSource(path=str(path))])
    assert (
        str(info.value)
        == f"{path}: "
        + {
            "empty.parquet": "no records (a Parquet file of 0 rows)",
            "empty.jsonl": "empty file (0 bytes)",
            "blank.jsonl": "empty file",
        }[name]
    )
