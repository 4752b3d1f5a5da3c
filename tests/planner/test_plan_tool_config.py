"""memfit plan / fit of another tool's config: the same plan as memfit's knobs give, and what was read."""

from __future__ import annotations

import json
import textwrap

import pytest

from memfit.planner.api import plan
from memfit.planner.search.driver import fit
from memfit.planner.search.request import FitEvents, FitRequest


@pytest.fixture
def model_folder(tmp_path, tiny_llama):
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(tiny_llama))
    return folder


def _axolotl(tmp_path, model_folder, extra: str = "") -> str:
    path = tmp_path / "axolotl.yml"
    path.write_text(
        textwrap.dedent(f"""
        base_model: {model_folder}
        adapter: lora
        lora_r: 8
        lora_target_linear: true
        sequence_len: 128
        micro_batch_size: 2
        gradient_accumulation_steps: 2
        gradient_checkpointing: true
        bf16: false
        fp16: false
        """)
        + extra
    )
    return str(path)


def test_a_config_plans_as_its_knobs_plan_on_the_hugging_face_step(tmp_path, model_folder):
    config = _axolotl(tmp_path, model_folder, "peft_use_dora: true\ntorch_compile: true\n")
    from_config = plan(config, cache=False)
    by_hand = plan(
        str(model_folder),
        method="lora",
        rank=8,
        targets="all-linear",
        seq_len=128,
        batch_size=2,
        grad_accum=2,
        checkpointing="on",
        precision="fp32",
        recipe="hf",
        use_reentrant="on",  # Axolotl's default for SFT
        dora=True,
        cache=False,
    )
    assert from_config.device_total_bytes == by_hand.device_total_bytes
    assert from_config.spec == by_hand.spec
    read = from_config.details["config"]
    assert read["tool"] == "axolotl" and read["path"] == config
    assert [f["key"] for f in read["not_modelled"]] == ["torch_compile"]


def test_options_given_replace_the_config_s(tmp_path, model_folder):
    result = plan(_axolotl(tmp_path, model_folder), batch_size=1, cache=False)
    assert result.spec["batch_size"] == 1 and result.details["config"]["given"] == {"batch_size": 1}
    # What the config's optimizer is planned as no longer matters once the command line picks one.
    config = _axolotl(tmp_path, model_folder, "optimizer: adamw_anyprecision\n")
    assert [f["knob"] for f in plan(config, cache=False).details["config"]["approximated"]] == ["optimizer"]
    assert plan(config, optimizer="sgd", cache=False).details["config"]["approximated"] == []
    # The Trainer's adamw_torch is foreach AdamW; another optimizer given on the command line replaces it whole.
    foreach = _axolotl(tmp_path, model_folder, "optimizer: adamw_torch\n")
    assert plan(foreach, cache=False).spec["adamw_impl"] == "foreach"
    assert plan(foreach, optimizer="sgd", cache=False).spec["adamw_impl"] == "fused"


def test_a_sharded_config_on_one_gpu_is_planned_unsharded_and_says_so(tmp_path, model_folder):
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 3}}')
    result = plan(_axolotl(tmp_path, model_folder, "deepspeed: ds.json\n"), cache=False)
    assert result.spec["shard"] == "none" and "deepspeed" not in result.details
    assert any(f["key"] == "deepspeed" and "--gpus N" in f["why"] for f in result.details["config"]["not_modelled"])
    sharded = plan(_axolotl(tmp_path, model_folder, "deepspeed: ds.json\n"), gpus=2, cache=False)
    assert sharded.spec["shard"] == "zero3" and sharded.details["deepspeed"]["stage"] == 3


def test_fit_keeps_the_config_s_method_batch_and_length(tmp_path, model_folder):
    found, expected = [], []
    result = fit(
        FitRequest(_axolotl(tmp_path, model_folder), budget="2GiB", max_seq_len=False, workers=1),
        FitEvents(
            found=lambda method, fits: found.append((method, [f.spec for f in fits])), plans_expected=expected.append
        ),
    )
    assert result.fits and {f.spec["method"] for f in result.fits} == {"lora"}
    # The caller hears of the search as for any model (memfit ui streams it); the callbacks are not knobs.
    assert [m for m, _ in found] == ["lora"] and len(found[0][1]) == len(result.fits) and expected and expected[0] > 0
    assert result.to_dict()["details"]["config"]["given"] == {}
    best = result.fits[0].spec
    assert best["batch_size"] * best["grad_accum"] == 4 and best["seq_len"] == 128 and best["recipe"] == "hf"
    assert result.to_dict()["details"]["config"]["tool"] == "axolotl"


# ------------------------------------------------------------------------------------------------
# Preference configs on several GPUs


def _write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_llamafactory_dpo_with_deepspeed_plans_per_gpu_with_trl_s_reference(tmp_path, model_folder):
    for stage in (2, 3):
        (tmp_path / f"ds{stage}.json").write_text(json.dumps({"zero_optimization": {"stage": stage}}))
    common = f"""
        model_name_or_path: {model_folder}
        stage: dpo
        finetuning_type: full
        cutoff_len: 64
        per_device_train_batch_size: 1
        """
    three = plan(_write(tmp_path, "lf3.yaml", common + "deepspeed: ds3.json\n"), gpus=4, cache=False)
    two = plan(_write(tmp_path, "lf2.yaml", common + "deepspeed: ds2.json\n"), gpus=4, cache=False)
    assert three.spec["objective"] == two.spec["objective"] == "dpo"
    assert (three.spec["shard"], two.spec["shard"]) == ("zero3", "zero2")
    assert three.details["deepspeed"]["stage"] == 3 and two.details["deepspeed"]["stage"] == 2
    # TRL's prepare_deepspeed shards the reference model under ZeRO-3 and keeps it whole below.
    assert "a shard on each of the 4 GPUs" in three.details["reference"]
    assert "whole on each GPU" in two.details["reference"]
    assert two.categories["weights"] > 3 * three.categories["weights"]


def test_axolotl_rl_dpo_with_deepspeed_plans_per_gpu(tmp_path, model_folder):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    result = plan(_axolotl(tmp_path, model_folder, "rl: dpo\ndeepspeed: ds.json\n"), gpus=2, cache=False)
    assert result.spec["objective"] == "dpo" and result.spec["gpus"] == 2 and result.spec["shard"] == "zero2"
    assert result.details["per_rank"] and result.details["reference"].startswith(
        "the base model with its LoRA adapters disabled"
    )


@pytest.mark.parametrize(
    "sharding, shard", [("fsdp: full_shard auto_wrap\n", "fsdp"), ("deepspeed: ds.json\n", "zero3")]
)
def test_a_trl_dpo_config_with_fsdp_or_deepspeed_plans_per_gpu(tmp_path, model_folder, sharding, shard):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    config = _write(
        tmp_path,
        "dpo.yaml",
        f"""
        model_name_or_path: {model_folder}
        beta: 0.1
        max_length: 64
        per_device_train_batch_size: 1
        gradient_checkpointing: true
        """
        + sharding,
    )
    result = plan(config, gpus=2, cache=False)
    assert result.spec["objective"] == "dpo" and result.spec["method"] == "full" and result.spec["shard"] == shard
    assert "a shard on each of the 2 GPUs" in result.details["reference"]


def test_a_mode_that_cannot_run_is_refused_by_the_config_s_keys(tmp_path, model_folder):
    from memfit.planner.api import PlanError

    (tmp_path / "ds.json").write_text(
        json.dumps(
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_param": {"device": "cpu"},
                    "offload_optimizer": {"device": "cpu"},
                }
            }
        )
    )
    config = _write(
        tmp_path,
        "lf.yaml",
        f"""
        model_name_or_path: {model_folder}
        stage: dpo
        finetuning_type: lora
        deepspeed: ds.json
        optim: adamw_bnb_8bit
        """,
    )
    with pytest.raises(PlanError) as err:
        plan(config, gpus=2, cache=False)
    assert f"{config}: deepspeed (memfit shard: fsdp-offload) with optim (memfit optimizer: adamw8bit)" in str(
        err.value
    )
    with pytest.raises(PlanError, match=r"with --optimizer paged-adamw8bit"):
        plan(config, gpus=2, optimizer="paged-adamw8bit", cache=False)


def test_plan_and_fit_take_another_model_in_place_of_the_config_s(tmp_path, model_folder):
    config = _axolotl(tmp_path, "org/not-fetched")  # the config's own model is never looked at
    planned = plan(config, model_override=str(model_folder), cache=False)
    assert (
        planned.details["config"]["model"] == str(model_folder)
        and planned.details["config"]["replaced"] == "org/not-fetched"
    )
    result = fit(FitRequest(config, model_override=str(model_folder), budget="2GiB", max_seq_len=False, workers=1))
    assert result.fits and result.config["model"] == str(model_folder) and result.config["given_model"]


def test_a_gpu_count_that_is_no_number_is_refused_by_name_not_a_traceback(tmp_path, model_folder):
    from memfit.planner.errors import PlanError

    config = _axolotl(tmp_path, model_folder, "deepspeed: ds.json\n")
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(PlanError, match="--gpus: 'x' is not a whole number"):
        plan(config, gpus="x", cache=False)
