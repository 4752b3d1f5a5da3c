"""Fixtures of the data tests: a local Hub serving dataset repos, with datasets pointed at it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from hub_datasets import LocalHub, add_dataset_repos, point_datasets_at


@dataclass
class DataHub:
    server: LocalHub
    home: Path  # HF_HOME: the Hub cache, the datasets cache
    commits: dict[str, str]  # repo id -> commit of main


@pytest.fixture(autouse=True)
def datasets_cache_in_the_test_folder(tmp_path, monkeypatch):
    """What datasets writes (even lock files for files it reads in place) goes to the test's folder,
    never to the user's cache."""
    try:
        import datasets
    except ImportError:
        return
    cache = tmp_path / "datasets-cache"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "DOWNLOADED_DATASETS_PATH", cache / "downloads")
    monkeypatch.setattr(datasets.config, "EXTRACTED_DATASETS_PATH", cache / "downloads" / "extracted")


@pytest.fixture
def data_hub(tmp_path, monkeypatch) -> DataHub:
    """A running local Hub with the dataset repos (tests/train/data/hub_datasets.py); huggingface_hub
    and datasets pointed at it, empty caches, no token."""
    pytest.importorskip("datasets")
    server = LocalHub()
    commits = add_dataset_repos(server)
    server.start()
    point_datasets_at(monkeypatch, server.endpoint, tmp_path / "hf-home")
    yield DataHub(server, tmp_path / "hf-home", commits)
    server.down()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from memfit.train.data import tiny_tokenizer_path

    return AutoTokenizer.from_pretrained(tiny_tokenizer_path())


@pytest.fixture()
def plain_tokenizer():
    """The tiny tokenizer without its chat template, so the default template is used."""
    from transformers import AutoTokenizer

    from memfit.train.data import tiny_tokenizer_path

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_path())
    tok.chat_template = None
    return tok
