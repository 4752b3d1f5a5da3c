"""Data sources in a training config (memfit.train.data.sources and the data fields of TrainConfig):
paths, Hub dataset ids, mappings with options, mixes, streaming; every problem named before any
data is read."""

from __future__ import annotations

import pytest
import yaml
from trainer_helpers import DEMO_DATA, tiny_settings

from memfit.train.config import ConfigError, load_config, total_steps, validate_config
from memfit.train.data.sources import DataSource, as_sources, is_dataset_id


def problems(**changes) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(tiny_settings("/tmp/unused", **changes))
    return str(info.value)


def test_a_path_a_hub_id_and_a_mapping_are_sources():
    config = validate_config(
        tiny_settings(
            "/tmp/unused",
            data=[
                str(DEMO_DATA),
                "org/chat",
                {"path": "org/pairs", "split": "train_sft", "columns": {"prompt": "question"}},
            ],
        )
    )
    assert config.data[:2] == [str(DEMO_DATA), "org/chat"]  # a path stays text
    sources = as_sources(config.data)
    assert [s.is_hub for s in sources] == [False, True, True]
    assert sources[2] == DataSource(path="org/pairs", split="train_sft", columns={"prompt": "question"})
    assert sources[2].label() == "org/pairs (split train_sft)"
    assert (
        as_sources(validate_config(tiny_settings("/tmp/unused", eval_data="org/chat")).eval_data)[0].path == "org/chat"
    )


def test_what_is_a_dataset_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_dataset_id("HuggingFaceH4/ultrachat_200k") and is_dataset_id("org/name.v2")
    for text in ("data/train.jsonl", "out/rows.parquet", "train.jsonl", "a/b/c", "./x"):
        assert not is_dataset_id(text), text
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_dataset_id("org/name")  # a local folder of that name wins


def test_paths_in_yaml_are_relative_to_it_and_hub_ids_stay_ids(tmp_path, monkeypatch):
    (tmp_path / "cfg" / "data").mkdir(parents=True)
    (tmp_path / "cfg" / "data" / "train.jsonl").write_text(DEMO_DATA.read_text())
    settings = tiny_settings(
        "out",
        data=[{"path": "org/chat", "weight": 2}, {"path": "data/train.jsonl", "weight": 1}],
        eval_data="data/train.jsonl",
    )
    (tmp_path / "cfg" / "run.yaml").write_text(yaml.safe_dump(settings))
    monkeypatch.chdir(tmp_path)
    config = load_config("cfg/run.yaml")
    local = str(tmp_path / "cfg" / "data" / "train.jsonl")
    assert [s.path for s in as_sources(config.data)] == ["org/chat", local]
    assert config.eval_data == [local]


def test_every_source_problem_is_named_at_once():
    text = problems(data=[{"path": "org/b", "colums": {}}, 3, {"split": "x"}, {"path": "a/b", "weight": "x"}])
    assert "data[0]: unknown setting 'colums'; did you mean 'columns'?" in text
    assert "data[1]: expected a path, a Hub dataset id (org/name) or a mapping with path:, got 3" in text
    assert "data[2]: a source given as a mapping needs path:" in text
    assert "data[3].weight: 'x': Input should be a valid number" in text
    text = problems(
        data=[
            {"path": "org/b", "weight": -1, "columns": {"message": "x"}, "format": "chatml"},
            "missing.jsonl",
            {"path": "org/c", "weight": 2},
        ],
        eval_data={"path": "x/y", "weight": 1},
    )
    assert "data[0].columns: 'message' is not a field memfit reads" in text and "Did you mean 'messages'?" in text
    assert "data[0].weight: -1.0 must be a positive number" in text
    assert "data[0].format: 'chatml' is not one of alpaca, sharegpt, messages, text, prompt_completion" in text
    assert (
        "data[1]: 'missing.jsonl' does not exist: give a local file or folder, or a Hub dataset id (org/name)" in text
    )
    assert "data[1]: no weight, while other sources have one" in text
    assert "eval_data: weight mixes training sources" in text


def test_hub_options_on_a_local_file_and_a_lone_weight_are_refused():
    text = problems(data={"path": str(DEMO_DATA), "split": "train", "revision": "main", "weight": 1})
    assert (
        f"data.split: applies to a Hub dataset (org/name) or a local folder; {str(DEMO_DATA)!r} is a file. Remove split."
        in text
    )
    assert f"data.revision: applies to a Hub dataset (org/name); {str(DEMO_DATA)!r} is a file. Remove revision." in text
    assert "data: weight only means something in a list of two or more sources" in text


def test_a_local_folder_takes_a_split_and_a_subset_and_no_revision(tmp_path):
    folder = tmp_path / "repo"
    folder.mkdir()
    config = validate_config(
        tiny_settings(
            "/tmp/unused",
            data={"path": str(folder), "split": "train", "subset": "easy"},
            eval_data={"path": str(folder), "split": "test"},
        )
    )
    assert as_sources(config.eval_data)[0].split == "test"
    text = problems(data={"path": str(folder), "revision": "main"})
    assert f"data.revision: applies to a Hub dataset (org/name); {str(folder)!r} is a folder. Remove revision." in text
    (folder / "state.json").write_text("{}")  # written by save_to_disk: splits, no subsets
    text = problems(data={"path": str(folder), "subset": "easy", "split": "test"})
    assert (
        f"data.subset: applies to a Hub dataset (org/name) or a local folder; {str(folder)!r} is a folder written by save_to_disk"
        in text
    )
    assert "data.split" not in text


def test_a_stream_needs_max_steps_and_cannot_be_split():
    text = problems(data="org/chat", streaming=True, max_steps=None, eval_split=0.1, shuffle_buffer_size=-1)
    assert "streaming: true needs max_steps: a stream has no length to count epochs in. Add max_steps: N" in text
    assert "eval_split: 0.1 with streaming: true: a stream's length is not known, so it cannot be split" in text
    assert "shuffle_buffer_size: -1 must be 0 or more" in text
    config = validate_config(tiny_settings("/tmp/unused", data="org/chat", streaming=True, max_steps=5))
    assert total_steps(config, None) == 5


def test_names_other_tools_use_for_the_data_settings_are_pointed_at_memfits():
    text = problems(dataset_name="org/chat", dataset_streaming=True, buffer_size=100)
    assert "dataset_name: unknown setting. Did you mean 'data'?" in text
    assert "dataset_streaming: unknown setting. Did you mean 'streaming'?" in text
    assert "buffer_size: unknown setting. Did you mean 'shuffle_buffer_size'?" in text
