"""Fixtures for the Hub tests: the tiny repos built once, a local Hub per test with huggingface_hub pointed at it."""

from __future__ import annotations

import json

import pytest
from hub_repos import (
    ADAPTER,
    CATALOG_SOURCE,
    GATED,
    GRANTED_TOKEN,
    MODEL,
    PICKLED,
    REMOTE_CODE,
    Built,
    HubFixture,
    build_repos,
    point_at,
)
from local_hub import LocalHub


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> Built:
    return build_repos(tmp_path_factory.mktemp("hub-repos"))


@pytest.fixture
def hub(built, tmp_path, monkeypatch) -> HubFixture:
    """A running local Hub with the tiny repos; huggingface_hub and memfit pointed at it, empty cache, no token."""
    server = LocalHub()
    files = LocalHub.folder_files(built.model)
    main = server.add_commit(MODEL, files)
    branch = server.add_commit(
        MODEL, dict(files, **{"config.json": json.dumps(built.branch_config).encode()}), refs=("long-context",)
    )
    server.add_commit(GATED, files, gated=True, granted_tokens=(GRANTED_TOKEN,))
    server.add_commit(PICKLED, LocalHub.folder_files(built.pickled))
    server.add_commit(ADAPTER, LocalHub.folder_files(built.adapter))
    custom = {
        "model_type": "memfit-custom",
        "hidden_size": 8,
        "auto_map": {
            "AutoConfig": "configuration_custom.CustomConfig",
            "AutoModelForCausalLM": "modeling_custom.CustomModel",
        },
    }
    server.add_commit(
        REMOTE_CODE, {"config.json": json.dumps(custom).encode(), "configuration_custom.py": b"raise SystemExit\n"}
    )
    server.add_commit(CATALOG_SOURCE, {"config.json": b"{}"}, gated=True)
    server.start()
    point_at(monkeypatch, server.endpoint, tmp_path / "hf-home")
    yield HubFixture(server, tmp_path / "hf-home" / "hub", main, branch)
    server.down()
