"""The training config: YAML + flags -> one validated TrainConfig, or one error listing every problem."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from trainer_helpers import DEMO_DATA, REPO, tiny_settings

from memfit.train.command import parse_set_options
from memfit.train.config import (
    ConfigError,
    TrainConfig,
    load_config,
    lr_factor,
    model_config_dict,
    tokenizer_path,
    total_steps,
    validate_config,
    warmup_steps,
)

SHIPPED = sorted((REPO / "examples").glob("*.yaml"))


def test_there_are_shipped_configs():
    assert {p.name for p in SHIPPED} >= {"tiny.yaml", "lora-1b.yaml", "qlora-8b.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    config = load_config(path)
    assert isinstance(config, TrainConfig)
    assert config.spec is not None  # the knobs form a valid RunSpec
    for data in config.data:
        assert Path(data).exists(), data
    assert model_config_dict(config)["model_type"]


def test_demo_config_is_small_and_local():
    config = load_config(REPO / "examples" / "tiny.yaml")
    assert config.init == "random" and config.device == "cpu"
    assert model_config_dict(config)["num_hidden_layers"] == 2
    assert tokenizer_path(config).joinpath("tokenizer.json").is_file()
    assert config.output_dir == str(Path("runs") / "tiny")
    assert config.checkpointing == "on"  # YAML's bare `on` is a boolean; it must still mean "on"


def test_paths_in_yaml_are_relative_to_the_file_and_flags_win(tmp_path, monkeypatch):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "train.jsonl").write_text(DEMO_DATA.read_text())
    (tmp_path / "cfg" / "run.yaml").write_text(
        "model: smollm2-135m\ninit: random\ndata: train.jsonl\nlr: 1.0e-3\nepochs: 3\n"
    )
    monkeypatch.chdir(tmp_path)
    config = load_config("cfg/run.yaml", {"lr": 5e-5, "epochs": None, "output_dir": "out"})
    assert config.data == [str(tmp_path / "cfg" / "train.jsonl")]
    assert config.lr == 5e-5  # flag wins
    assert config.epochs == 3  # an unset flag (None) keeps the file's value
    assert config.output_dir == str(tmp_path / "out")
    assert config.model == "smollm2-135m"  # a catalog name is not turned into a path


def test_every_problem_is_listed_at_once_with_field_names(tmp_path):
    settings = tiny_settings(tmp_path / "out")
    settings.update(
        method="lorra",
        lr=-1.0,
        batchsize=4,
        data=[str(tmp_path / "missing.jsonl")],
        warmup_steps=5,
        warmup_ratio=0.1,
        eval_split=1.5,
        budget="lots",
    )
    with pytest.raises(ConfigError) as info:
        validate_config(settings)
    text = str(info.value)
    problems = info.value.problems
    assert len(problems) >= 7, problems
    assert "batchsize: unknown setting. Did you mean 'batch_size'?" in text
    assert "method: 'lorra'" in text and "Did you mean 'lora'?" in text
    assert "--" not in text  # a YAML's fields are named as the YAML spells them, not as command-line flags
    assert "lr: -1.0" in text
    assert "missing.jsonl" in text and "does not exist" in text
    assert "warmup_steps and warmup_ratio" in text
    assert "eval_split: 1.5" in text
    assert "budget: 'lots'" in text


def test_unknown_keys_get_did_you_mean(tmp_path):
    settings = tiny_settings(tmp_path / "out")
    settings["epoch"] = 2
    settings["learning_rate_schedule"] = "cosine"
    with pytest.raises(ConfigError) as info:
        validate_config(settings)
    assert "epoch: unknown setting. Did you mean 'epochs'?" in str(info.value)
    assert "learning_rate_schedule: unknown setting." in str(info.value)


def test_required_fields_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError) as info:
        validate_config({})
    assert "model: required" in str(info.value) and "data: required" in str(info.value)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping of settings"):
        load_config(listing)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_pretrained_needs_a_local_folder(tmp_path):
    settings = tiny_settings(tmp_path / "out", init="pretrained")
    with pytest.raises(ConfigError) as info:
        validate_config(settings)
    assert "model: 'smollm2-135m' is not a local model folder" in str(info.value)
    assert "init: random" in str(info.value)
    assert "model_overrides: only with init: random" in str(info.value)


def test_unknown_catalog_model_and_gpu(tmp_path):
    settings = tiny_settings(tmp_path / "out", model="smollm-135m", gpu="rtx-4099")
    with pytest.raises(ConfigError) as info:
        validate_config(settings)
    assert "model: unknown model 'smollm-135m'" in str(info.value)
    assert "gpu: unknown GPU 'rtx-4099'" in str(info.value)


def test_spec_combinations_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="precision: fp32 cannot be used with method: qlora.*Use precision: bf16"):
        validate_config(tiny_settings(tmp_path / "out", method="qlora", precision="fp32"))
    config = validate_config(tiny_settings(tmp_path / "out", checkpointing=False))
    assert config.spec.checkpointing == "off"


def test_eval_prompts_are_checked_with_their_index(tmp_path):
    config = validate_config(tiny_settings(tmp_path / "out", eval_prompts="Hi"))
    assert config.eval_prompts == ["Hi"] and config.eval_max_new_tokens == 64  # one prompt may be given alone
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert validate_config(tiny_settings(tmp_path / "out", eval_prompts=["Hi", messages])).eval_prompts[1] == messages
    with pytest.raises(ConfigError) as err:
        validate_config(
            tiny_settings(
                tmp_path / "out",
                eval_prompts=["ok", "", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]],
                eval_max_new_tokens=0,
            )
        )
    assert err.value.problems == [
        "eval_prompts[1]: is empty text; write the prompt, or a list of {role, content} messages",
        "eval_prompts[2]: ends with an assistant message, so the reply would be a second assistant turn in a row; end it with the user's turn the reply answers",
        "eval_max_new_tokens: 0 must be 1 or more (e.g. eval_max_new_tokens: 64)",
    ]
    with pytest.raises(ConfigError, match="eval_prompts with gpus: 2: replies are generated by one process"):
        validate_config(tiny_settings(tmp_path / "out", eval_prompts=["Hi"], gpus=2, shard="ddp", device="cuda"))


def test_set_options_parse_as_yaml():
    assert parse_set_options(["lr=1e-4", "targets=[q_proj, v_proj]", "eval_split=0.1", "max-grad-norm=null"]) == {
        "lr": 1e-4,
        "targets": ["q_proj", "v_proj"],
        "eval_split": 0.1,
        "max_grad_norm": None,
    }
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_set_options(["lr"])


def test_total_and_warmup_steps(tmp_path):
    config = validate_config(tiny_settings(tmp_path / "o", max_steps=None, epochs=2.5, grad_accum=3))
    assert total_steps(config, batches_per_epoch=10) == math.ceil(2.5 * 10 / 3)
    config = validate_config(tiny_settings(tmp_path / "o", max_steps=7))
    assert total_steps(config, batches_per_epoch=1000) == 7
    config = validate_config(tiny_settings(tmp_path / "o", max_steps=None, epochs=None))
    assert total_steps(config, batches_per_epoch=12) == 12  # one epoch by default
    config = validate_config(tiny_settings(tmp_path / "o", warmup_steps=None, warmup_ratio=0.1))
    assert warmup_steps(config, 95) == 9
    config = validate_config(tiny_settings(tmp_path / "o", warmup_steps=50))
    assert warmup_steps(config, 20) == 20


def test_lr_schedules():
    kw = dict(total=110, warmup=10)
    # linear warmup from lr/warmup up to lr
    assert lr_factor(0, schedule="cosine", **kw) == pytest.approx(0.1)
    assert lr_factor(9, schedule="cosine", **kw) == pytest.approx(1.0)
    assert lr_factor(10, schedule="cosine", **kw) == pytest.approx(1.0)
    assert lr_factor(60, schedule="cosine", **kw) == pytest.approx(0.5)
    assert lr_factor(110, schedule="cosine", **kw) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(60, schedule="linear", **kw) == pytest.approx(0.5)
    assert lr_factor(85, schedule="linear", **kw) == pytest.approx(0.25)
    assert lr_factor(100, schedule="constant", **kw) == 1.0
    assert lr_factor(110, schedule="cosine", min_ratio=0.1, **kw) == pytest.approx(0.1)
    assert lr_factor(0, schedule="linear", total=5, warmup=0) == 1.0


def _yaml_with(tmp_path: Path, line: str) -> Path:
    """A valid tiny config file whose last line is ``line`` (written as YAML text, as a user would)."""
    import yaml

    settings = tiny_settings(tmp_path / "out")
    field = line.split(":", 1)[0]
    settings.pop(field, None)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(settings, sort_keys=False) + line + "\n")
    return path


@pytest.mark.parametrize(
    "line",
    [
        "batch_size: 1.0e+20",  # a float that is a whole number, too large for any tensor
        "batch_size: 99999999999999999999",
        "batch_size: 2.5",
        "batch_size: true",
        "batch_size: 1e20",  # YAML 1.1 reads this as text
        "grad_accum: 1.0e+30",
        "seq_len: 18446744073709551616",
        "gpus: 1.0e+19",
    ],
)
def test_whole_number_knobs_in_yaml_are_checked_and_named(tmp_path, line):
    field = line.split(":", 1)[0]
    with pytest.raises(ConfigError) as info:
        load_config(_yaml_with(tmp_path, line))
    assert len(info.value.problems) == 1, info.value.problems
    assert info.value.problems[0].startswith(f"{field}: "), info.value.problems
    assert info.value.exit_code == 2


@pytest.mark.parametrize(
    "line",
    [
        "seed: 99999999999999999999",
        "log_every: true",
        "max_steps: 2.5",
        "save_every: 1.0e+30",
        "keep_checkpoints: false",
    ],
)
def test_whole_number_fields_in_yaml_are_checked_and_named(tmp_path, line):
    field = line.split(":", 1)[0]
    with pytest.raises(ConfigError) as info:
        load_config(_yaml_with(tmp_path, line))
    assert len(info.value.problems) == 1, info.value.problems
    assert info.value.problems[0].startswith(f"{field}: "), info.value.problems


def test_knobs_are_held_as_the_numbers_they_were_checked_as(tmp_path):
    # A flag's value is text and a quoted YAML number is too: the config holds them converted, so
    # the run never compares or slices with text.
    config = load_config(
        _yaml_with(tmp_path, 'batch_size: "8"'), {"grad_accum": "3", "rank": "8", "max_grad_norm": "none"}
    )
    assert (config.batch_size, config.grad_accum, config.rank, config.max_grad_norm) == (8, 3, 8, None)
    assert config.spec.batch_size == 8 and config.spec.max_grad_norm is None
    config = load_config(_yaml_with(tmp_path, "targets: q_proj, v_proj"), {"gpus": "1", "checkpointing": "OFF"})
    assert config.gpus == 1 and config.checkpointing == "off" and tuple(config.targets) == ("q_proj", "v_proj")


def test_several_gpus_given_as_text_get_the_multi_gpu_rules(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(_yaml_with(tmp_path, "seed: 0"), {"gpus": "2"})
    (problem,) = info.value.problems
    assert problem.startswith("shard: 'none' with gpus: 2") and "--nproc 2" in problem and "torchrun" in problem


BOOLEAN = ": write {f}: true or {f}: false (unquoted)"


@pytest.mark.parametrize(
    "line, problem",
    [
        ("streaming: 'yes'", "streaming: 'yes' is not true or false but text" + BOOLEAN.format(f="streaming")),
        (
            "train_on_inputs: 1",
            "train_on_inputs: 1 is not true or false but a number" + BOOLEAN.format(f="train_on_inputs"),
        ),
        ("force: null", "force: null is not true or false but null" + BOOLEAN.format(f="force")),
        (
            "packing: 'true'",
            "packing: 'true' is not true or false but text" + BOOLEAN.format(f="packing"),
        ),  # a knob: make_spec would read the text
        (
            "simpo_gamma: true",
            "simpo_gamma: true is true or false, not a number: write a number (e.g. simpo_gamma: 0.5)",
        ),
        ("lr: false", "lr: false is true or false, not a number: write a number (e.g. lr: 0.0002)"),
        ("eval_split: true", "eval_split: true is true or false, not a number: write a number (e.g. eval_split: 0.0)"),
        (
            "shuffle_buffer_size: true",
            "shuffle_buffer_size: true is true or false, not a whole number: write a whole number "
            "(e.g. shuffle_buffer_size: 1000)",
        ),
        ("epochs: true", "epochs: true is true or false, not a number: write a number"),
        (
            f"data: [{{path: {DEMO_DATA}, weight: true}}, {{path: {DEMO_DATA}, weight: 1}}]",
            "data[0].weight: true is true or false, not a number: write the source's share, e.g. weight: 0.7",
        ),
    ],
)
def test_booleans_and_numbers_are_not_taken_for_each_other(tmp_path, line, problem):
    with pytest.raises(ConfigError) as info:
        load_config(_yaml_with(tmp_path, line))
    assert info.value.problems == [problem]


def test_yaml_booleans_and_set_options_still_parse(tmp_path):
    config = load_config(_yaml_with(tmp_path, "streaming: yes"))  # YAML 1.1: yes is true
    assert config.streaming is True
    assert load_config(_yaml_with(tmp_path, "seed: 1"), parse_set_options(["streaming=true"])).streaming is True
    overrides = parse_set_options(["objective=dpo", "train_on_inputs=on", "beta=0.2", "lr=1e-4", "packing=false"])
    config = load_config(_yaml_with(tmp_path, "seed: 1"), overrides)
    assert (config.train_on_inputs, config.beta, config.lr, config.packing) == (True, 0.2, 1e-4, False)
    with pytest.raises(ConfigError) as info:
        load_config(_yaml_with(tmp_path, "seed: 1"), parse_set_options(["beta=true", "streaming='yes'"]))
    assert sorted(p.split(":")[0] for p in info.value.problems) == ["beta", "streaming"]
