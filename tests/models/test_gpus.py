from __future__ import annotations

import pytest

from memfit.models.gpus import (
    Gpu,
    UnknownGpuError,
    get_gpu,
    load_gpus,
    normalize_gpu_name,
    parse_catalog,
)

GiB = 1 << 30
MiB = 1 << 20

REQUIRED = [
    "t4",
    "rtx-3090",
    "rtx-4090",
    "a10",
    "l4",
    "a100-40gb",
    "a100-80gb",
    "h100-80gb",
    "h200",
    "rtx-4060",
]


def test_required_cards_present():
    gpus = load_gpus()
    for name in REQUIRED:
        assert name in gpus, name


def test_every_entry_loads_and_is_plausible():
    gpus = load_gpus()
    assert len(gpus) >= 10
    for name, gpu in gpus.items():
        assert isinstance(gpu, Gpu)
        assert gpu.name == name
        assert 4 * GiB <= gpu.memory_bytes <= 200 * GiB, name
        assert gpu.memory_bytes % MiB == 0
        assert gpu.arch in {"volta", "turing", "ampere", "ada", "hopper", "blackwell"}
        assert (7, 0) <= gpu.compute_capability < (13, 0)
        assert gpu.supports_bf16 == (gpu.bf16_tflops is not None)
        assert gpu.supports_bf16 == (gpu.compute_capability >= (8, 0))
        if gpu.bf16_tflops is not None:
            assert 10 < gpu.bf16_tflops < 3000
        assert 100 < gpu.memory_bandwidth_gbps < 10_000
        assert gpu.source


def test_published_memory_totals():
    assert get_gpu("h100-80gb").memory_bytes == 81559 * MiB
    assert get_gpu("a100-80gb").memory_bytes == 81920 * MiB
    assert get_gpu("rtx-4090").memory_bytes == 24564 * MiB
    assert get_gpu("t4").memory_bytes == 15360 * MiB


def test_no_bf16_on_t4_and_v100():
    assert not get_gpu("t4").supports_bf16
    assert not get_gpu("v100-16gb").supports_bf16
    assert get_gpu("a10").supports_bf16


@pytest.mark.parametrize(
    "query, expected",
    [
        ("4090", "rtx-4090"),
        ("rtx4090", "rtx-4090"),
        ("RTX 4090", "rtx-4090"),
        ("rtx_4090", "rtx-4090"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("h100", "h100-80gb"),
        ("H100-80GB", "h100-80gb"),
        ("NVIDIA H100 80GB HBM3", "h100-80gb"),
        ("Tesla T4", "t4"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("A100 40GB", "a100-40gb"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA RTX A6000", "rtx-a6000"),
        ("  H200 ", "h200"),
    ],
)
def test_aliases_resolve(query, expected):
    assert get_gpu(query).name == expected


def test_every_alias_resolves_to_its_entry():
    for name, gpu in load_gpus().items():
        for alias in (name, *gpu.aliases):
            assert get_gpu(alias).name == name


def test_unknown_gpu_suggests_close_names():
    with pytest.raises(UnknownGpuError) as info:
        get_gpu("rtx 4009")
    message = str(info.value)
    assert "Did you mean 'rtx-4090'" in message
    assert "h100-80gb" in message  # lists the known names
    assert isinstance(info.value, ValueError)


def test_unknown_gpu_without_close_match():
    with pytest.raises(UnknownGpuError, match="Known GPUs"):
        get_gpu("quantum-toaster-9000")


@pytest.mark.parametrize("query, options", [("a100", ("a100-40gb", "a100-80gb")), ("V100", ("v100-16gb", "v100-32gb"))])
def test_ambiguous_names_are_not_guessed_but_all_variants_suggested(query, options):
    with pytest.raises(UnknownGpuError) as info:
        get_gpu(query)
    suggestion = str(info.value).split("Known GPUs")[0]
    for option in options:
        assert repr(option) in suggestion


def test_normalize():
    assert normalize_gpu_name("NVIDIA GeForce RTX 3090") == "rtx3090"
    assert normalize_gpu_name("a100-sxm4-80gb") == "a100sxm480gb"


def test_load_is_cached_but_returns_a_copy():
    first = load_gpus()
    first.pop("t4")
    assert "t4" in load_gpus()


def test_catalog_problems_are_collected():
    text = """
Bad_Name: {}
x1:
  display_name: X
  memory_mib: lots
  arch: pascal
  compute_capability: "6.1"
  supports_bf16: false
  memory_bandwidth_gbps: 100
x2:
  display_name: X2
  memory_mib: 1024
  arch: ampere
  compute_capability: "8.0"
  supports_bf16: true
  bf16_tflops: null
  memory_bandwidth_gbps: 100
  aliases: [x1]
"""
    with pytest.raises(ValueError) as info:
        parse_catalog(text)
    message = str(info.value)
    assert "kebab-case" in message
    assert "memory_mib" in message
    assert "supports_bf16 and bf16_tflops disagree" in message
