"""memfit.plan: the JSON contract, fit against a GPU or budget, and errors before any work."""

from __future__ import annotations

import pytest

import memfit
from memfit.planner.api import PlanError
from memfit.planner.categories import CATEGORIES

CONTRACT_KEYS = {"model", "spec", "peak", "categories", "gpu", "fits", "headroom_bytes"}


def test_json_contract(tiny_llama):
    data = memfit.plan(tiny_llama, method="lora", seq_len=128, batch_size=2, gpu="rtx-4090").to_dict()
    assert CONTRACT_KEYS <= set(data)
    assert set(data["peak"]) == {"allocated_bytes", "reserved_bytes", "device_total_bytes", "phase"}
    assert data["peak"]["phase"] in ("forward", "backward", "optimizer")
    assert set(data["categories"]) == set(CATEGORIES)
    assert all(isinstance(v, int) and v >= 0 for v in data["categories"].values())
    assert sum(data["categories"].values()) == data["peak"]["device_total_bytes"]
    assert data["peak"]["allocated_bytes"] <= data["peak"]["reserved_bytes"] < data["peak"]["device_total_bytes"]
    assert data["gpu"] == {"name": "rtx-4090", "memory_bytes": 24564 * 2**20}
    assert data["fits"] is True
    assert data["headroom_bytes"] == data["gpu"]["memory_bytes"] - data["peak"]["device_total_bytes"]
    for knob in (
        "method",
        "rank",
        "alpha",
        "targets",
        "precision",
        "optimizer",
        "batch_size",
        "seq_len",
        "checkpointing",
    ):
        assert knob in data["spec"]


def test_no_gpu_means_no_verdict(tiny_llama):
    data = memfit.plan(tiny_llama, seq_len=64).to_dict()
    assert data["gpu"] is None and data["fits"] is None and data["headroom_bytes"] is None


def test_budget_decides_fit(tiny_llama):
    small = memfit.plan(tiny_llama, seq_len=64, budget="1MiB")
    assert small.fits is False and small.headroom_bytes < 0
    assert memfit.plan(tiny_llama, seq_len=64, budget="80GB").fits is True


def test_catalog_model_plans_with_every_method():
    peaks = {
        m: memfit.plan("smollm2-135m", method=m, seq_len=256).device_total_bytes for m in ("full", "lora", "qlora")
    }
    assert peaks["qlora"] < peaks["lora"] < peaks["full"]


def test_memory_grows_with_batch_and_length():
    base = memfit.plan("smollm2-135m", seq_len=256, batch_size=1, checkpointing="off").allocated_bytes
    assert memfit.plan("smollm2-135m", seq_len=512, batch_size=1, checkpointing="off").allocated_bytes > base
    assert memfit.plan("smollm2-135m", seq_len=256, batch_size=2, checkpointing="off").allocated_bytes > base


def test_optimizers_and_precisions_plan():
    adamw = memfit.plan("smollm2-135m", method="full", seq_len=128)
    sgd = memfit.plan("smollm2-135m", method="full", seq_len=128, optimizer="sgd")
    assert sgd.categories["optimizer"] == 0 < adamw.categories["optimizer"]
    fp32 = memfit.plan("smollm2-135m", method="full", precision="fp32", seq_len=128)
    assert fp32.categories["trainable"] == pytest.approx(2 * adamw.categories["trainable"], rel=0.01)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("llama-3.1-8", {}), "Did you mean 'llama-3.1-8b'"),
        (("smollm2-135m", {"seq_len": 100_000}), "beyond smollm2-135m's max_position_embeddings (8192)"),
        (("smollm2-135m", {"rank": 0}), "--rank: 0 must be 1 or more"),
        (("smollm2-135m", {"method": "qlora", "precision": "fp32"}), "fp32 cannot be used with --method qlora"),
        (("smollm2-135m", {"gpu": "rtx-4091"}), "Did you mean 'rtx-4090'"),
        (("smollm2-135m", {"budget": "lots"}), "--budget"),
        (("smollm2-135m", {"budget": "0GiB"}), "must be more than 0 bytes"),
        (("smollm2-135m", {"gpus": 1, "shard": "zero3"}), "--shard: zero3 needs --gpus 2 or more"),
        (
            ("smollm2-135m", {"gpus": 4, "shard": "fsdp-offload", "optimizer": "adamw8bit"}),
            "bitsandbytes' 8-bit optimizers need GPU tensors",
        ),
    ],
)
def test_bad_input_is_refused_before_work(args, message):
    model, knobs = args
    with pytest.raises(PlanError) as info:
        memfit.plan(model, **knobs)
    assert message in str(info.value)


def test_unknown_target_module_is_named(tiny_llama):
    # Found while validating, with the other problems, before any simulation.
    with pytest.raises(PlanError, match="--targets: qkv match no linear layer.*q_proj"):
        memfit.plan(tiny_llama, targets="qkv", seq_len=64)


def test_all_problems_listed_together():
    with pytest.raises(PlanError) as info:
        memfit.plan("nope-7b", rank=0, batch_size=0, gpu="x")
    assert len(info.value.problems) == 4


def test_parameter_counts_read_well():
    from memfit.planner.report import format_count

    assert format_count(8_030_261_248) == "8.030 B"
    assert format_count(41_943_040) == "41.94 M"
    assert format_count(45_056) == "45,056"
