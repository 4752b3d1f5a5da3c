"""Local folders laid out as Hub dataset repositories (memfit.train.data.folders): their splits and
subsets read as ``datasets.load_dataset(folder)`` finds them, the training split by default."""

from __future__ import annotations

import json

import pytest
from data_samples import ALPACA, write_jsonl as write_file

from memfit.train.data.errors import DataError
from memfit.train.data.reading import load_sources, open_stream
from memfit.train.data.sources import DataSource

datasets = pytest.importorskip("datasets")

TRAIN = [{"text": f"train {i}"} for i in range(5)]
TEST = [{"text": f"test {i}"} for i in range(3)]

README_SUBSETS = """---
configs:
- config_name: easy
  data_files:
  - split: train
    path: easy/tr.jsonl
  - split: validation
    path: easy/va.jsonl
- config_name: hard
  data_files:
  - split: train
    path: hard/*.jsonl
---
# two subsets
"""


def parquet_repo(folder):
    """The layout push_to_hub writes: data/{split}-00000-of-00001.parquet, and a README without front matter."""
    (folder / "data").mkdir(parents=True)
    for split, rows in (("train", TRAIN), ("test", TEST)):
        datasets.Dataset.from_list(rows).to_parquet(str(folder / "data" / f"{split}-00000-of-00001.parquet"))
    (folder / "README.md").write_text("# a dataset\n")
    return folder


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_file(path, rows)


def texts(records) -> list[str]:
    return [r["text"] for r in records]


def test_a_repository_folder_trains_on_its_train_split_and_reads_the_others_when_asked(tmp_path):
    folder = parquet_repo(tmp_path / "repo")
    assert texts(load_sources([DataSource(path=str(folder))]).records) == texts(TRAIN)
    test = load_sources([DataSource(path=str(folder), split="test")], "eval_data").records
    assert texts(test) == texts(TEST)
    assert test[0]["source"] == f"{folder / 'data' / 'test-00000-of-00001.parquet'}, row 1"
    for split in ("train", "test"):  # the rows datasets reads for the same split
        assert texts(test if split == "test" else TRAIN) == datasets.load_dataset(str(folder), split=split)["text"]
    with pytest.raises(DataError) as err:
        load_sources([DataSource(path=str(folder), split="validation")])
    assert str(err.value) == f"data: {folder}: no split 'validation'; its splits are train, test: set split: train"


def test_a_stream_of_a_repository_folder_reads_its_split(tmp_path):
    folder = parquet_repo(tmp_path / "repo")
    tokenize = lambda record: {"input_ids": [1], "labels": [1], "text": record["text"]}  # noqa: E731
    assert [e["text"] for e in open_stream([DataSource(path=str(folder))], tokenize=tokenize).examples] == texts(TRAIN)
    test = open_stream([DataSource(path=str(folder), split="test")], tokenize=tokenize)
    assert [e["text"] for e in test.examples] == texts(TEST)
    with pytest.raises(DataError, match=r"^data: split: 'train\[:2\]': a stream reads whole splits"):
        open_stream([DataSource(path=str(folder), split="train[:2]")], tokenize=tokenize)


@pytest.mark.parametrize("split", ["train[:2]", "train[-40%:]", "train+test", "test[1:]+train[:1]"])
def test_slices_and_sums_of_splits_are_those_datasets_reads(tmp_path, split):
    folder = parquet_repo(tmp_path / "repo")
    assert (
        texts(load_sources([DataSource(path=str(folder), split=split)]).records)
        == datasets.load_dataset(str(folder), split=split)["text"]
    )


def test_a_readme_declares_subsets_and_their_splits(tmp_path):
    folder = tmp_path / "repo"
    write_jsonl(folder / "easy" / "tr.jsonl", ALPACA)
    write_jsonl(folder / "easy" / "va.jsonl", ALPACA[:1])
    write_jsonl(folder / "hard" / "part-0.jsonl", TRAIN)
    (folder / "README.md").write_text(README_SUBSETS)
    with pytest.raises(DataError) as err:
        load_sources([DataSource(path=str(folder))])
    assert (
        str(err.value) == f"data: {folder}: the dataset has several subsets (easy, hard); choose one, e.g. subset: easy"
    )
    valid = load_sources([DataSource(path=str(folder), subset="easy", split="validation")]).records
    assert len(valid) == 1 and valid[0]["source"] == f"{folder / 'easy' / 'va.jsonl'}, line 1"  # memfit's reader: lines
    assert texts(load_sources([DataSource(path=str(folder), subset="hard")]).records) == texts(TRAIN)
    assert len(datasets.load_dataset(str(folder), "easy", split="validation")) == 1
    with pytest.raises(DataError, match=r"no subset 'medium'; its subsets are easy, hard: set subset: easy$"):
        load_sources([DataSource(path=str(folder), subset="medium")])


def test_split_files_named_by_their_split_and_a_plain_folder(tmp_path):
    named = tmp_path / "named"
    write_jsonl(named / "train.jsonl", TRAIN)
    write_jsonl(named / "test.jsonl", TEST)
    assert texts(load_sources([DataSource(path=str(named))]).records) == texts(TRAIN)
    plain = tmp_path / "plain"  # files that name no split: the folder is its train split, every file of it
    write_jsonl(plain / "a.jsonl", TRAIN)
    write_jsonl(plain / "b.jsonl", TEST)
    assert texts(load_sources([DataSource(path=str(plain), split="train")]).records) == texts(TRAIN + TEST)
    with pytest.raises(DataError, match=r"no split 'test'; its splits are train: set split: train$"):
        load_sources([DataSource(path=str(plain), split="test")])
    with pytest.raises(DataError, match=r"subset: 'x': .* declares no subsets"):
        load_sources([DataSource(path=str(plain), subset="x")])


def test_a_run_takes_its_eval_data_from_a_split_of_the_same_folder(tmp_path):
    from memfit.train.config import validate_config
    from memfit.train.examples import load_tokenizer, prepare_data

    folder = tmp_path / "repo"
    rows = [
        {"messages": [{"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": f"A{i}"}]}
        for i in range(6)
    ]
    write_jsonl(folder / "data" / "train.jsonl", rows[:4])
    write_jsonl(folder / "data" / "validation.jsonl", rows[4:])
    config = validate_config(
        {
            "model": "smollm2-135m",
            "init": "random",
            "data": str(folder),
            "eval_data": {"path": str(folder), "split": "validation"},
        }
    )
    data = prepare_data(config, load_tokenizer(config))
    assert (len(data.train_examples), len(data.eval_examples)) == (4, 2)
    assert json.loads(json.dumps(data.record["eval_data"]))[0]["split"] == "validation"
