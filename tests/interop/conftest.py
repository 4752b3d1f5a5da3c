"""Configs of other tools, written in each tool's documented format, and a tiny model to plan them on."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest


@pytest.fixture
def tiny_model(tmp_path, tiny_llama) -> Path:
    """A model folder holding only a tiny Llama's config.json (a planner needs nothing else)."""
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(tiny_llama, architectures=["LlamaForCausalLM"])))
    return folder


@pytest.fixture
def write_config(tmp_path):
    """Write a config file: ``write_config("name.yml", text)`` (text dedented) or a dict as JSON."""

    def write(name: str, content: str | dict) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, dict):
            path.write_text(json.dumps(content, indent=2) + "\n")
        else:
            path.write_text(textwrap.dedent(content).lstrip("\n"))
        return path

    return write
