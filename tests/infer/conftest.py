"""The demo run the chat tests talk to, trained once per test session (see chat_helpers)."""

from __future__ import annotations

from pathlib import Path

import pytest
from chat_helpers import train_demo


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> Path:
    """A finished demo run folder (run.json, metrics.jsonl, adapter/); tests must not change it."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    return train_demo(tmp_path_factory.mktemp("demo") / "run")
