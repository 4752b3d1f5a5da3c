"""memfit plan / fit of memfit's own training YAML: the run it describes, at the length its data makes,
the plan the trainer's preflight makes; fit --write changes only the memory keys."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_helpers import DEMO_DATA, tiny_settings

from memfit.planner.search.request import FitRequest
from memfit.train.config import ConfigError
from memfit.train.config_plan import (
    fit_train_config,
    is_train_config,
    plan_train_config,
    read_config_run,
    write_fitted_train_config,
)

#: Plans of the tiny model need about 530 MiB, the estimated CUDA context included.
BUDGET = "2GiB"


def _yaml(tmp_path: Path, name: str = "run.yaml", **changes) -> Path:
    settings = tiny_settings(tmp_path / "out", **changes)
    settings.pop("output_dir")
    path = tmp_path / name
    path.write_text("# my run\n" + yaml.safe_dump(settings, sort_keys=False))
    return path


def test_memfit_s_own_yaml_is_told_apart_from_other_tools_configs(tmp_path):
    assert is_train_config(_yaml(tmp_path))
    assert is_train_config(Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml")
    (tmp_path / "axolotl.yml").write_text("base_model: org/model\nadapter: lora\nmicro_batch_size: 2\n")
    (tmp_path / "notes.yaml").write_text("- a list\n")
    assert not is_train_config(tmp_path / "axolotl.yml") and not is_train_config(tmp_path / "notes.yaml")
    assert not is_train_config("smollm2-135m") and not is_train_config(tmp_path / "missing.yaml")


def test_the_plan_is_the_trainer_s_preflight_plan_at_the_data_s_longest_micro_batch(tmp_path):
    from memfit.train.recipe import train

    path = _yaml(tmp_path, max_steps=1, budget=BUDGET, seq_len=128)
    planned = plan_train_config(path, cache=False)
    read = planned.details["config"]
    assert read["tool"] == "memfit" and read["data"]["read"] and read["data"]["examples"] > 0
    assert (
        planned.spec["seq_len"] == read["data"]["planned_seq_len"] < 128
    )  # the demo's examples are shorter than seq_len
    train(path_config(path, tmp_path / "run"), progress=False)
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["planned_seq_len"] == planned.spec["seq_len"]
    assert record["plan"]["peak"] == planned.to_dict()["peak"] and record["plan"]["spec"] == planned.spec
    assert record["plan"]["categories"] == planned.to_dict()["categories"]


def path_config(path: Path, out: Path):
    from memfit.train.config import load_config

    return load_config(path, {"output_dir": str(out)})


def test_data_that_is_not_at_hand_is_planned_at_seq_len_and_says_why(tmp_path):
    run = read_config_run(_yaml(tmp_path, data=["memfit-test/some-dataset"]))
    assert not run.examples and "is not a local file or folder" in run.unread
    assert run.seq_len_for(4) == 64
    run = read_config_run(_yaml(tmp_path, data=[str(DEMO_DATA)], streaming=True, max_steps=3))
    assert run.unread.startswith("streaming") and run.seq_len_for(4) == 64
    local = read_config_run(_yaml(tmp_path))
    assert local.unread is None and local.seq_len_for(1) >= local.seq_len_for(4)


def test_the_command_line_s_knobs_and_model_replace_the_config_s(tmp_path, tiny_llama):
    folder = tmp_path / "other"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(tiny_llama, vocab_size=512, max_position_embeddings=256)))
    run = read_config_run(_yaml(tmp_path, model_overrides={}), model_override=str(folder), batch_size="2")
    assert run.config.batch_size == 2 and run.model["hidden_size"] == tiny_llama["hidden_size"]
    details = run.details(64, "seq_len")
    assert details["given"] == {"batch_size": 2} and details["given_model"] and details["replaced"] == "smollm2-135m"


def test_a_bad_config_is_the_trainer_s_error(tmp_path):
    with pytest.raises(ConfigError, match="batch_sise: unknown setting. Did you mean 'batch_size'"):
        read_config_run(_yaml(tmp_path, batch_sise=4))


def test_fit_keeps_the_run_and_writes_only_the_memory_keys_back(tmp_path):
    path = _yaml(tmp_path, batch_size=8, grad_accum=1, checkpointing="on", fit_optimizer=False)
    result = fit_train_config(FitRequest(path, budget=BUDGET, max_seq_len=False, workers=1))
    assert result.fits and {f.spec["method"] for f in result.fits} == {"lora"}
    best = result.fits[0].spec
    assert best["batch_size"] * best["grad_accum"] == 8 and best["rank"] == 4 and best["optimizer"] == "adamw"
    assert best["seq_len"] == result.config["data"]["planned_seq_len"]  # the data's longest example
    chosen = dict(best, batch_size=4, grad_accum=2, checkpointing="off")  # a choice that differs from the config
    out = tmp_path / "fitted.yaml"
    diff = write_fitted_train_config(path, chosen, out)
    # Written as the file spells its values: quoted, as this file quotes 'on'.
    assert "-batch_size: 8\n+batch_size: 4\n" in diff and "+grad_accum: 2" in diff and "+checkpointing: 'off'" in diff
    written = out.read_text()
    assert written.startswith("# my run\n")
    before, after = yaml.safe_load(path.read_text()), yaml.safe_load(written)
    assert {k for k in before if before[k] != after[k]} == {"batch_size", "grad_accum", "checkpointing"}
    assert path.read_text().startswith("# my run\n")  # the input untouched


def test_a_knob_of_the_planner_alone_is_planned_not_put_in_the_config(tmp_path):
    planned = plan_train_config(_yaml(tmp_path), recipe="hf", cache=False)
    assert planned.spec["recipe"] == "hf" and planned.details["config"]["given"] == {"recipe": "hf"}
