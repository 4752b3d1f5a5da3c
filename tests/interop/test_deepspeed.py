"""DeepSpeed configs as the Hugging Face Trainer runs them: stage, offload, bucket sizes, "auto"."""

from __future__ import annotations

import pytest

from memfit.interop.deepspeed import (
    DEFAULT_PREFETCH_BUCKET,
    DeepSpeedError,
    ZeroSettings,
    find_deepspeed_file,
    load_deepspeed,
    read_zero,
    shard_mode,
)


def test_deepspeed_s_defaults_where_the_file_is_silent():
    zero = read_zero({"zero_optimization": {"stage": 2}}, "ds.json")
    assert (zero.reduce_bucket_elements, zero.allgather_bucket_elements) == (500_000_000, 500_000_000)
    assert zero.prefetch_bucket_elements == 50_000_000 and zero.max_live_parameters == 1_000_000_000
    assert zero.contiguous_gradients and not zero.overlaps_comm  # overlap_comm: on by default for stage 3 only
    assert read_zero({"zero_optimization": {"stage": 3}}, "ds.json").overlaps_comm


def test_numbers_as_deepspeed_configs_write_them():
    zero = read_zero(
        {
            "zero_optimization": {
                "stage": 3,
                "reduce_bucket_size": 5e8,
                "stage3_prefetch_bucket_size": "2e7",
                "stage3_max_live_parameters": 1e9,
                "overlap_comm": "false",
            }
        },
        "ds.json",
    )
    assert zero.reduce_bucket_elements == 500_000_000 and zero.prefetch_bucket_elements == 20_000_000
    assert zero.overlap_comm is False


def test_auto_is_resolved_as_transformers_resolves_it():
    # transformers' integrations/deepspeed.py (trainer_config_finalize): reduce_bucket_size = hidden_size²;
    # for stage 3, stage3_prefetch_bucket_size = int(0.9 x hidden_size²), persistence threshold 10 x hidden_size.
    auto = {
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    }
    zero3 = read_zero({"zero_optimization": {"stage": 3, **auto}}, "ds.json")
    assert zero3.reduce_bucket_elements is None  # "auto": unknown until the model is
    resolved = zero3.resolved(4096)
    assert resolved.reduce_bucket_elements == 4096 * 4096
    assert resolved.prefetch_bucket_elements == int(0.9 * 4096 * 4096) == 15_099_494
    assert resolved.persistence_threshold_elements == 40_960
    # Stages 1 and 2: only the reduce bucket is filled in (DeepSpeed does not read the stage-3 keys there).
    zero2 = read_zero({"zero_optimization": {"stage": 2, **auto}}, "ds.json").resolved(2048)
    assert zero2.reduce_bucket_elements == 2048 * 2048 and zero2.prefetch_bucket_elements == DEFAULT_PREFETCH_BUCKET


@pytest.mark.parametrize(
    "zero, mode",
    [
        ({"stage": 0}, "ddp"),
        ({"stage": 1}, "zero1"),
        ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, "zero2"),
        ({"stage": 3}, "zero3"),
        ({"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "nvme"}}, "fsdp-offload"),
    ],
)
def test_zero_stages_are_memfit_s_shard_modes(zero, mode):
    assert shard_mode(read_zero({"zero_optimization": zero}, "ds.json")) == mode


@pytest.mark.parametrize(
    "zero, message",
    [
        ({"stage": 4}, "zero_optimization.stage: 4 is not one of 0, 1, 2, 3"),
        (
            {"stage": 2, "reduce_bucket_size": "big"},
            "zero_optimization.reduce_bucket_size: 'big' is not a whole number",
        ),
        (
            {"stage": 2, "offload_param": {"device": "cpu"}},
            "offload_param: DeepSpeed offloads parameters with stage 3 only",
        ),
        (
            {"stage": 3, "offload_optimizer": {"device": "gpu"}},
            "offload_optimizer.device: 'gpu' is not one of none, cpu, nvme",
        ),
    ],
)
def test_bad_values_name_the_key_and_the_file(zero, message):
    with pytest.raises(DeepSpeedError) as err:
        read_zero({"zero_optimization": zero}, "conf/ds.json")
    assert str(err.value).startswith("conf/ds.json: ") and message in str(err.value)


def test_what_is_not_modelled_and_unknown_keys_are_kept():
    zero = read_zero(
        {
            "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8, "stage3_mystery": 1},
            "optimizer": {"type": "AdamW"},
            "bf16": {"enabled": True},
            "wall_clock_breakdown": False,
            "my_key": 1,
        },
        "ds.json",
    )
    assert [key for key, _, _ in zero.unmodelled] == ["zero_optimization.zero_hpz_partition_size"]
    assert zero.unknown == ("zero_optimization.stage3_mystery", "my_key")
    assert zero.optimizer_type == "AdamW" and zero.bf16 is True


def test_the_file_is_found_next_to_the_config_then_in_the_working_directory(tmp_path, monkeypatch):
    configs, work = tmp_path / "configs", tmp_path / "work"
    configs.mkdir(), work.mkdir()
    (configs / "ds.json").write_text('{"zero_optimization": {"stage": 1}}')
    (work / "ds_cwd.json").write_text('{"zero_optimization": {"stage": 2}}')
    monkeypatch.chdir(work)
    assert find_deepspeed_file("ds.json", configs) == configs / "ds.json"
    assert find_deepspeed_file("ds_cwd.json", configs).resolve() == (work / "ds_cwd.json").resolve()
    with pytest.raises(DeepSpeedError, match="'missing.json' does not exist"):
        find_deepspeed_file("missing.json", configs)


def test_a_folder_is_named_as_a_folder_where_a_file_is_expected(tmp_path, write_config):
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "ds_z3.json").write_text('{"zero_optimization": {"stage": 3}}')
    with pytest.raises(DeepSpeedError) as err:
        find_deepspeed_file("deepspeed", tmp_path)
    assert str(err.value) == (
        f"'deepspeed' is a folder ({str(tmp_path / 'deepspeed')!r}) (it holds ds_z3.json); a DeepSpeed "
        "JSON file is expected: point it at the file, e.g. ds_z3_config.json"
    )
    from memfit.interop import ToolConfigError, read_tool_config

    config = write_config("sft.yaml", "model_name_or_path: org/model\nfinetuning_type: full\ndeepspeed: deepspeed/\n")
    with pytest.raises(
        ToolConfigError, match=r"deepspeed: 'deepspeed/' is a folder .* a DeepSpeed JSON file is expected"
    ):
        read_tool_config(config)


def test_a_file_that_is_not_json_names_the_line(tmp_path):
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2,}}')
    with pytest.raises(DeepSpeedError, match=r"is not valid JSON \(line 1"):
        load_deepspeed("ds.json", tmp_path)
    data, where = load_deepspeed({"zero_optimization": {"stage": 1}}, tmp_path)
    assert where == "inline" and data["zero_optimization"]["stage"] == 1


def test_settings_have_a_stable_json_form():
    data = ZeroSettings(path="ds.json", stage=2).to_dict()
    assert data["stage"] == 2 and data["reduce_bucket_size"] == 500_000_000 and data["overlap_comm"] is False


def test_an_fsdp_config_that_is_a_folder_is_named_as_one(tmp_path, write_config):
    from memfit.interop import ToolConfigError, read_tool_config

    (tmp_path / "fsdp").mkdir()
    config = write_config("sft.yaml", "model_name_or_path: org/model\nfsdp: full_shard auto_wrap\nfsdp_config: fsdp\n")
    with pytest.raises(
        ToolConfigError, match=r"fsdp_config: 'fsdp' is a folder .*; an FSDP config file \(JSON\) is expected"
    ):
        read_tool_config(config)
