"""The shipped catalog resolves, builds and has the published parameter counts."""

import json
import re

import pytest
import torch

from memfit.models.build import build_meta_model, make_config
from memfit.models.catalog import (
    ModelNotFoundError,
    catalog_names,
    load_catalog_config,
    resolve_model,
)


def test_catalog_has_the_shipped_models():
    names = catalog_names()
    assert len(names) >= 20
    assert {"llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b", "gemma-2-2b", "smollm2-135m"} <= set(names)


@pytest.mark.parametrize("name", catalog_names())
def test_every_catalog_config_builds_on_meta(name):
    model = build_meta_model(make_config(load_catalog_config(name)), torch.bfloat16)
    assert next(model.parameters()).device.type == "meta"
    assert sum(p.numel() for p in model.parameters()) > 100e6


@pytest.mark.parametrize(
    ("name", "billions"),
    [
        ("llama-3.1-8b", 8.030),
        ("llama-3.1-70b", 70.554),
        ("qwen2.5-72b", 72.706),
        ("qwen2.5-7b", 7.616),
        ("smollm2-135m", 0.1345),
    ],
)
def test_published_parameter_counts(name, billions):
    model = build_meta_model(make_config(load_catalog_config(name)), torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, rel=2e-3)


def test_resolve_name_path_and_folder(tmp_path):
    assert resolve_model("LLaMA-3.1-8B").origin == "catalog"
    cfg = load_catalog_config("smollm2-135m")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert resolve_model(str(tmp_path)).origin == "folder"
    assert resolve_model(str(tmp_path / "config.json")).config == cfg


def test_unknown_name_suggests():
    with pytest.raises(ModelNotFoundError, match="Did you mean 'llama-3.1-8b'"):
        resolve_model("llama-3.1-8")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON (line 1"),
        ("[1, 2]", "must hold a JSON object"),
        ('{"hidden_size": 4}', "no 'model_type' field"),
    ],
)
def test_bad_config_files(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ModelNotFoundError, match=re.escape(message)):
        resolve_model(str(path))


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        resolve_model(str(tmp_path))


def test_missing_path():
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model("./nope/config.json")


def test_each_variant_names_a_catalog_entry_and_is_not_one_s_source():
    from memfit.models.catalog import catalog_sources, catalog_variants

    variants = catalog_variants()
    # The instruct ids the shipped examples and most recipes name are among them.
    assert {
        "meta-llama/llama-3.1-8b-instruct",
        "meta-llama/meta-llama-3-8b-instruct",
        "qwen/qwen2-0.5b-instruct",
        "qwen/qwen2.5-1.5b",
        "qwen/qwen2.5-7b-instruct",
    } <= set(variants)
    assert not set(variants) & set(catalog_sources())  # a source is planned with its own copy
    for variant in variants.values():
        assert variant.catalog_name in catalog_names() and variant.differs
    qwen = variants["qwen/qwen2.5-1.5b"]
    assert qwen.config() == dict(load_catalog_config("qwen2.5-1.5b"), max_position_embeddings=131072)
    assert variants["meta-llama/llama-3.1-8b-instruct"].config() == load_catalog_config("llama-3.1-8b")
