"""memfit.plan with --gpus N: per-rank plans, the JSON contract, the CLI."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import memfit
from memfit.cli import app
from memfit.planner.api import PlanError
from memfit.planner.categories import CATEGORIES

MODEL = "smollm2-135m"
KNOBS = dict(method="full", seq_len=256)


def test_fsdp_per_rank_memory_falls_with_more_gpus():
    plans = {n: memfit.plan(MODEL, gpus=n, shard="fsdp", **KNOBS) for n in (2, 4, 8)}
    one = memfit.plan(MODEL, **KNOBS)
    totals = [plans[n].device_total_bytes for n in (2, 4, 8)]
    assert one.device_total_bytes > totals[0] > totals[1] > totals[2]
    for p in plans.values():
        floor = p.categories["activations"] + 2 * p.details["gathered_layer_bytes"]
        assert p.allocated_bytes >= floor
        states = p.details["model_state_bytes"]
        assert states["per_rank_device_bytes"] == pytest.approx(states["before_bytes"] / p.spec["gpus"], rel=0.05)


def test_multi_gpu_json_is_per_rank_and_keeps_the_contract():
    data = memfit.plan(MODEL, gpus=4, shard="zero2", gpu="a100-40gb", **KNOBS).to_dict()
    assert {"model", "spec", "peak", "categories", "gpu", "fits", "headroom_bytes"} <= set(data)
    assert set(data["categories"]) == set(CATEGORIES)
    assert sum(data["categories"].values()) == data["peak"]["device_total_bytes"]
    assert data["spec"]["gpus"] == 4 and data["spec"]["shard"] == "zero2"
    assert data["details"]["per_rank"] is True and data["details"]["shard"] == "zero2"
    assert data["headroom_bytes"] == data["gpu"]["memory_bytes"] - data["peak"]["device_total_bytes"]


def test_shard_none_on_several_gpus_is_ddp():
    plan = memfit.plan(MODEL, gpus=2, **KNOBS)
    assert plan.details["shard"] == "ddp" and any("planned as ddp" in n for n in plan.details["notes"])
    assert plan.categories["gradients"] > memfit.plan(MODEL, **KNOBS).categories["gradients"]


def test_offload_moves_states_to_host():
    plan = memfit.plan(MODEL, gpus=4, shard="fsdp-offload", **KNOBS)
    states = plan.details["model_state_bytes"]
    assert states["per_rank_device_bytes"] == 0 and plan.details["host_peak_bytes"] >= states["per_rank_host_bytes"] > 0
    assert plan.categories["optimizer"] == 0


def test_lora_shards_the_frozen_base():
    one = memfit.plan(MODEL, method="lora", seq_len=256)
    eight = memfit.plan(MODEL, method="lora", seq_len=256, gpus=8, shard="fsdp")
    assert eight.categories["weights"] < one.categories["weights"] / 4


def test_bad_combinations_are_refused():
    with pytest.raises(PlanError, match="fsdp-offload"):
        memfit.plan(MODEL, gpus=4, shard="fsdp-offload", optimizer="adamw8bit", **KNOBS)
    with pytest.raises(PlanError, match="--gpus 2 or more"):
        memfit.plan(MODEL, shard="fsdp", **KNOBS)


def test_cli_plan_per_gpu():
    runner = CliRunner()
    result = runner.invoke(
        app,
        ["plan", MODEL, "--method", "full", "--seq-len", "256", "--gpus", "8", "--shard", "fsdp", "--gpu", "h100-80gb"],
    )
    assert result.exit_code == 0, result.output
    assert "per GPU" in result.output and "fits" in result.output
    result = runner.invoke(
        app, ["plan", MODEL, "--method", "full", "--seq-len", "256", "--gpus", "8", "--shard", "fsdp", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["details"]["per_rank"] is True


def test_qlora_4bit_weights_stay_whole_on_every_rank():
    """memfit's trainer keeps packed 4-bit weights outside FSDP: the plan counts them on every rank."""
    from memfit.models.build import DTYPES, build_meta_model, make_config
    from memfit.models.catalog import resolve_model
    from memfit.spec import make_spec
    from memfit.step.prepare import prepare_for_method

    config = resolve_model(MODEL).config
    model = prepare_for_method(build_meta_model(make_config(config), DTYPES["bf16"]), make_spec(method="qlora"))
    packed = sum(p.numel() * p.element_size() for p in model.parameters() if type(p).__name__ == "Params4bit")
    one = memfit.plan(MODEL, method="qlora", seq_len=256)
    four = memfit.plan(MODEL, method="qlora", seq_len=256, gpus=4, shard="fsdp")
    assert packed > 0
    assert four.categories["weights"] >= packed  # not divided by 4
    assert four.categories["weights"] < one.categories["weights"]  # the bf16 embeddings and head are sharded
    assert (
        four.details["gathered_layer_bytes"] < packed / config["num_hidden_layers"]
    )  # 4-bit weights are never gathered


def test_input_embeddings_stay_on_the_device_under_sharding(tiny_llama):
    """One GPU keeps a frozen, untied table in host memory; FSDP keeps it in its root group."""
    one = memfit.plan(tiny_llama, method="lora", seq_len=64)
    four = memfit.plan(tiny_llama, method="lora", seq_len=64, gpus=4, shard="fsdp")
    assert one.details["input_embeddings"] == "host"
    assert four.details["input_embeddings"] == "device"
    assert four.details["host_peak_bytes"] == 0


# ------------------------------------------------------------------------------------------------
# Preference objectives per rank


def test_dpo_plans_per_rank_with_its_reference_pass_and_frozen_copy(tiny_llama):
    one = memfit.plan(tiny_llama, method="full", objective="dpo", seq_len=64, cache=False)
    copy_bytes = one.categories["weights"]  # full fine-tuning's only frozen tensors: the reference copy
    plans = {
        shard: memfit.plan(tiny_llama, method="full", objective="dpo", seq_len=64, gpus=4, shard=shard, cache=False)
        for shard in ("ddp", "zero2", "fsdp", "fsdp-offload")
    }
    assert plans["ddp"].categories["weights"] == copy_bytes and "whole on each GPU" in plans["ddp"].details["reference"]
    for shard in ("zero2", "fsdp"):
        assert copy_bytes / 4 <= plans[shard].categories["weights"] < copy_bytes / 3
        assert "a shard on each of the 4 GPUs" in plans[shard].details["reference"]
    assert plans["fsdp-offload"].categories["weights"] == 0
    for p in plans.values():
        assert p.details["per_rank"] and "reference" in p.details["phase_peaks_allocated_bytes"]
    # The pass gathers the copy's layers and root group as forward gathers the model's.
    lora = {
        n: memfit.plan(tiny_llama, method="lora", objective="dpo", seq_len=64, gpus=n, shard="fsdp", cache=False)
        for n in (2, 8)
    }
    assert lora[2].details["reference"].startswith("the base model with its LoRA adapters disabled")
    assert lora[2].allocated_bytes > lora[8].allocated_bytes


def test_orpo_simpo_and_a_precomputed_reference_plan_on_several_gpus(tiny_llama):
    for knobs in (dict(objective="orpo"), dict(objective="simpo"), dict(objective="dpo", precompute_reference=True)):
        p = memfit.plan(tiny_llama, method="lora", seq_len=64, gpus=2, shard="zero2", cache=False, **knobs)
        assert p.details["per_rank"] and "reference" not in p.details["phase_peaks_allocated_bytes"]
    assert "each of the 2 GPUs its share of the pairs" in p.details["reference"]


def test_cli_plans_dpo_per_gpu():
    result = CliRunner().invoke(
        app,
        [
            "plan",
            MODEL,
            "--objective",
            "dpo",
            "--method",
            "full",
            "--seq-len",
            "128",
            "--gpus",
            "2",
            "--shard",
            "fsdp",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)["details"]
    assert (
        data["per_rank"] is True and data["objective"] == "dpo" and "a shard on each of the 2 GPUs" in data["reference"]
    )
