"""Every config shipped in examples/interop reads, as the tool's own config, with nothing unknown."""

from __future__ import annotations

from pathlib import Path

import pytest

from memfit.interop import is_tool_config, read_tool_config

EXAMPLES = sorted(
    p
    for p in (Path(__file__).resolve().parents[2] / "examples" / "interop").iterdir()
    if p.suffix in (".yml", ".yaml") or p.name.startswith(("trl", "hf"))
)
TOOLS = {
    "axolotl-qlora-8b.yml": "axolotl",
    "llama-factory-full-zero3.yaml": "llama-factory",
    "trl-sft-lora.yaml": "trl",
}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_each_example_reads(path):
    assert is_tool_config(path)
    config = read_tool_config(path)
    assert config.tool == TOOLS[path.name]
    assert config.unknown_keys == []


def test_one_example_of_each_tool():
    assert sorted(TOOLS) == [p.name for p in EXAMPLES]
    zero3 = read_tool_config(next(p for p in EXAMPLES if "zero3" in p.name))
    assert zero3.shard == "zero3" and zero3.zero.stage == 3 and zero3.zero.reduce_bucket_elements is None  # "auto"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_each_example_s_model_is_planned_without_network(path, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from memfit.models.catalog import resolve_model

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))  # nothing cached
    source = resolve_model(read_tool_config(path).model)
    assert source.origin == "catalog" and "shipped copy" in source.note
