"""Hub datasets through the datasets library (memfit.train.data.hf_datasets), against the local Hub:
ids, subsets, splits, revisions, columns, gated datasets, the cache offline, and each failure as
one line that names the dataset and the fix."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("datasets")

from hub_datasets import CHAT, GATED_DATA, GRANTED_TOKEN, PAIRS, demo_rows, jsonl, set_datasets_offline

from memfit.train.data.errors import DataError
from memfit.train.data.reading import load_sources, open_stream
from memfit.train.data.sources import DataSource


def load(*sources: DataSource, **kwargs):
    return load_sources(list(sources), "data", **kwargs)


def refusal(*sources: DataSource, **kwargs) -> str:
    with pytest.raises(DataError) as info:
        load(*sources, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message  # one line
    return message


def test_a_dataset_id_is_read_at_the_commit_main_is_at(data_hub):
    loaded = load(DataSource(path=CHAT))
    assert loaded.formats == ["messages"] and loaded.commits == [data_hub.commits[CHAT]]
    assert [r["messages"] for r in loaded.records] == [r["messages"] for r in demo_rows(64)]
    assert loaded.records[3]["source"] == f"{CHAT}, row 4"
    test = load(DataSource(path=CHAT, split="test"))
    assert [r["messages"] for r in test.records] == [r["messages"] for r in demo_rows(8, start=64)]
    files = [r.path for r in data_hub.server.data_requests(CHAT) if "/resolve/" in r.path and r.method == "GET"]
    assert files and all(f"/resolve/{data_hub.commits[CHAT]}/" in path for path in files)  # every file from one commit


def test_a_subset_a_split_and_columns(data_hub):
    source = DataSource(
        path=PAIRS, subset="hard", split="train_sft", columns={"prompt": "question", "completion": "answer"}
    )
    loaded = load(source)
    assert loaded.formats == ["prompt_completion"] and len(loaded.records) == 40
    assert (
        loaded.records[0]["prompt"].startswith("Think hard: ")
        and loaded.records[0]["source"] == f"{PAIRS} (subset hard, split train_sft), row 1"
    )


def test_a_revision_is_read_at_its_commit_and_a_resumed_run_at_the_recorded_one(data_hub):
    first = load(DataSource(path=CHAT))
    newer = data_hub.server.add_commit(CHAT, {"data/train.jsonl": jsonl(demo_rows(5, start=100))}, repo_type="dataset")
    assert len(load(DataSource(path=CHAT)).records) == 5  # main moved
    assert len(load(DataSource(path=CHAT), commits=first.commits).records) == 64  # the commit a run recorded
    assert load(DataSource(path=CHAT, revision=first.commits[0])).commits == first.commits
    assert load(DataSource(path=CHAT)).commits == [newer]


def test_an_unknown_dataset(data_hub):
    message = refusal(DataSource(path="memfit-test/no-such-data"))
    assert message.startswith(
        f"data: 'memfit-test/no-such-data' is not a dataset on {data_hub.server.endpoint}: check the id"
    )
    assert "HF_TOKEN" in message


def test_a_split_the_dataset_does_not_have(data_hub):
    assert refusal(DataSource(path=CHAT, split="train_sft")) == (
        f"data: {CHAT}: no split 'train_sft'; its splits are train, test: set split: train"
    )
    assert refusal(DataSource(path=PAIRS, subset="easy")) == (
        f"data: {PAIRS}: no split 'train'; its splits are train_sft: set split: train_sft"
    )


def test_a_subset_missing_or_unknown(data_hub):
    assert refusal(DataSource(path=PAIRS, split="train_sft")) == (
        f"data: {PAIRS}: the dataset has several subsets (easy, hard); choose one, e.g. subset: easy"
    )
    assert refusal(DataSource(path=PAIRS, subset="medium", split="train_sft")) == (
        f"data: {PAIRS}: no subset 'medium'; its subsets are easy, hard: set subset: easy"
    )


def test_a_column_the_dataset_does_not_have(data_hub):
    message = refusal(DataSource(path=CHAT, columns={"messages": "conversation"}))
    assert message == (
        f"data: {CHAT}: columns: messages: no column 'conversation' in the dataset (its columns: messages); "
        "remove the entry to read its own 'messages' column, or map messages to another column"
    )


def test_a_revision_that_does_not_exist(data_hub):
    message = refusal(DataSource(path=CHAT, revision="v9"))
    assert message.startswith(f"data: {CHAT}: revision 'v9' does not exist: give a branch, a tag or a full commit sha")


def test_a_gated_dataset_without_a_token_then_with_one(data_hub, monkeypatch):
    message = refusal(DataSource(path=GATED_DATA))
    assert message == (
        f"data: {GATED_DATA} is gated: accept its terms at {data_hub.server.endpoint}/datasets/{GATED_DATA} with your "
        "Hugging Face account, then set HF_TOKEN to a token of that account (or run `hf auth login`)."
    )
    monkeypatch.setenv("HF_TOKEN", "hf_other_token")
    assert "the token in use (HF_TOKEN or `hf auth login`) has no access yet" in refusal(DataSource(path=GATED_DATA))
    monkeypatch.setenv("HF_TOKEN", GRANTED_TOKEN)
    assert len(load(DataSource(path=GATED_DATA)).records) == 64


def test_offline_after_one_online_load_reads_the_cache(data_hub, monkeypatch):
    online = load(DataSource(path=CHAT))
    data_hub.server.down()
    set_datasets_offline(monkeypatch)
    offline = load(DataSource(path=CHAT))
    assert [r["messages"] for r in offline.records] == [r["messages"] for r in online.records]
    assert offline.commits == [None]  # the Hub was not asked


def test_offline_without_the_dataset_in_the_cache(data_hub, monkeypatch):
    set_datasets_offline(monkeypatch)
    message = refusal(DataSource(path=CHAT))
    assert message.startswith(
        f"data: {CHAT}: HF_HUB_OFFLINE=1 is set, and the dataset is not in the datasets cache at "
    )
    assert message.endswith("unset HF_HUB_OFFLINE to download it once.")


def test_no_network_and_nothing_cached(data_hub):
    data_hub.server.down()
    message = refusal(DataSource(path=CHAT))
    assert message.startswith(f"data: {CHAT}: cannot reach the Hub at {data_hub.server.endpoint} (ConnectError: ")
    assert "and the dataset is not in the datasets cache at " in message
    assert message.endswith(
        "connect to the network and run again; or load it once where there is network, copy that cache "
        "here and set HF_HUB_OFFLINE=1 (or HF_DATASETS_OFFLINE=1) to read it without asking the Hub; or "
        "give a local path (the dataset's files, or a folder of them)."
    )


@pytest.mark.parametrize("mode", ["503", "drop"])
def test_a_hub_that_does_not_answer_is_asked_once(data_hub, monkeypatch, mode):
    """Asked once, then the datasets cache only: datasets alone would ask again for each file, five
    times with waits between, before it read its cache."""
    from hub_datasets import FailingHub, point_datasets_at

    online = load(DataSource(path=CHAT))
    failing = FailingHub(mode)
    try:
        point_datasets_at(monkeypatch, failing.endpoint, data_hub.home)
        message = refusal(DataSource(path=PAIRS, subset="easy", split="train_sft"))  # never loaded: not cached
        assert failing.connections == 1
        assert message.startswith(f"data: {PAIRS}: cannot reach the Hub at {failing.endpoint} (")
        cached = load(DataSource(path=CHAT))  # loaded once before: read from the cache, and said so
        assert failing.connections == 2
        stream = open_stream([DataSource(path=CHAT)], "data", tokenize=lambda record: {"input_ids": [1], "labels": [1]})
        assert failing.connections == 3 and len(stream.examples) == 16 and stream.notes == cached.notes
    finally:
        failing.close()
    assert [r["messages"] for r in cached.records] == [r["messages"] for r in online.records]
    assert cached.commits == [None] and len(cached.notes) == 1
    assert cached.notes[0].startswith(f"data: {CHAT}: cannot reach the Hub at {failing.endpoint} (")
    assert cached.notes[0].endswith(": reading the copy in the datasets cache")


def test_datasets_offline_alone_is_named_as_the_reason(data_hub, monkeypatch):
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # what datasets reads from it at import
    message = refusal(DataSource(path=CHAT))
    assert message.startswith(
        f"data: {CHAT}: HF_DATASETS_OFFLINE=1 is set, and the dataset is not in the datasets cache at "
    )
    assert message.endswith("unset HF_DATASETS_OFFLINE to download it once.")
    assert data_hub.server.data_requests(CHAT) == []  # the Hub was not asked


def test_a_stream_from_the_hub_is_not_downloaded_first(data_hub):
    from memfit.train.data.tokenization import tokenize_record  # noqa: F401 - the stream tokenizes with it

    stream = open_stream(
        [DataSource(path=CHAT)], "data", tokenize=lambda record: {"input_ids": [1, 2], "labels": [1, 2]}
    )
    assert stream.formats == ["messages"] and stream.commits == [data_hub.commits[CHAT]] and len(stream.examples) == 16
    example, problem = stream.to_example(json.dumps([0, demo_rows(1)[0]]))
    assert problem is None and example == {"input_ids": [1, 2], "labels": [1, 2]}
    assert not list((data_hub.home / "datasets").rglob("*.arrow"))  # nothing prepared in the datasets cache
