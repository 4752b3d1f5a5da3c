from __future__ import annotations

import pytest

from memfit.planner.exact.allocator import simulate
from memfit.planner.exact.runtime import (
    CUBLAS_WORKSPACE_DEFAULT_BYTES,
    CUBLAS_WORKSPACE_LARGE_BYTES,
    DEFAULT_CUDA_CONTEXT_BYTES,
    KNOWN_ARCHS,
    default_cublas_workspace_bytes,
    parse_cublas_workspace_config,
    runtime_overhead,
)

MiB = 1 << 20


def test_default_workspace_is_torch_default_config():
    # ":4096:2:16:8" -> 2 x 4096 KiB + 8 x 16 KiB, the 8519680 B torch reports
    assert CUBLAS_WORKSPACE_DEFAULT_BYTES == 8_519_680
    assert parse_cublas_workspace_config(":4096:2:16:8") == 8_519_680
    assert parse_cublas_workspace_config(":4096:8") == 32 * MiB
    assert parse_cublas_workspace_config(":16:8") == 128 * 1024


def test_bad_workspace_config():
    with pytest.raises(ValueError, match="CUBLAS_WORKSPACE_CONFIG"):
        parse_cublas_workspace_config("4096")


@pytest.mark.parametrize(
    "arch, expected",
    [
        ("turing", CUBLAS_WORKSPACE_DEFAULT_BYTES),
        ("ampere", CUBLAS_WORKSPACE_DEFAULT_BYTES),
        ("ada", CUBLAS_WORKSPACE_DEFAULT_BYTES),
        ("hopper", CUBLAS_WORKSPACE_LARGE_BYTES),
        ("Blackwell", CUBLAS_WORKSPACE_LARGE_BYTES),
        (None, CUBLAS_WORKSPACE_DEFAULT_BYTES),
    ],
)
def test_workspace_by_arch(arch, expected):
    assert default_cublas_workspace_bytes(arch) == expected


def test_runtime_overhead_defaults():
    o = runtime_overhead("hopper")
    assert o.context_bytes == DEFAULT_CUDA_CONTEXT_BYTES
    assert o.cublas_workspace_allocs == (32 * MiB, 32 * MiB)
    assert o.cublas_workspace_bytes == 64 * MiB
    assert any("estimate" in n for n in o.notes)


def test_runtime_overhead_overrides():
    o = runtime_overhead("ampere", context_bytes=300 * MiB, cublas_workspace_bytes=4 * MiB, num_cublas_workspaces=1)
    assert (o.context_bytes, o.cublas_workspace_allocs) == (300 * MiB, (4 * MiB,))
    assert not any("estimate" in n for n in o.notes)
    o = runtime_overhead("ampere", cublas_workspace_config=":4096:8")
    assert o.cublas_workspace_allocs == (32 * MiB, 32 * MiB)
    o = runtime_overhead("ampere", unified_cublaslt_workspace=False)
    assert o.cublas_workspace_allocs == (CUBLAS_WORKSPACE_DEFAULT_BYTES,) * 2 + (MiB, MiB)
    assert runtime_overhead("ada", num_cublas_workspaces=0).cublas_workspace_bytes == 0


def test_workspaces_replay_through_allocator():
    # two 8.125 MiB workspaces are large-pool requests < 10 MiB: both fit in
    # one 20 MiB segment; allocated counts their rounded sizes
    allocs = runtime_overhead("ampere").cublas_workspace_allocs
    r = simulate([("alloc", i, n) for i, n in enumerate(allocs)])
    assert r.final_reserved_bytes == 20 * MiB
    assert r.final_allocated_bytes == 2 * CUBLAS_WORKSPACE_DEFAULT_BYTES


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"context_bytes": -1}, "context_bytes"),
        ({"num_cublas_workspaces": -1}, "num_cublas_workspaces"),
        ({"cublas_workspace_bytes": 1.5}, "cublas_workspace_bytes"),
    ],
)
def test_runtime_overhead_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        runtime_overhead("ampere", **kwargs)


def test_unknown_arch_lists_known_ones():
    with pytest.raises(ValueError, match="pascal") as info:
        runtime_overhead("pascal")
    for arch in KNOWN_ARCHS:
        assert arch in str(info.value)
