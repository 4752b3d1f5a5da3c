"""Preflight: plan the exact run before any weight is loaded; refuse one that cannot fit."""

from __future__ import annotations

import pytest
from trainer_helpers import tiny_config, tiny_model_dict

from memfit.planner.search.run import RunPlanner
from memfit.planner.target import NO_TARGET, target_from_options
from memfit.train.fitting import run_target
from memfit.train.preflight import PreflightError, oom_advice, refusal

KNOBS = dict(method="lora", rank=4, precision="fp32", batch_size=4, seq_len=64, grad_accum=1, checkpointing="on")


class _Device:
    def __init__(self, type: str, index: int | None = None):
        self.type, self.index = type, index


def test_cpu_without_a_target_plans_nothing(tmp_path):
    result = RunPlanner(tiny_model_dict(), NO_TARGET).preflight(KNOBS)
    assert result.plan is None and result.fits is None and result.target_name is None
    assert run_target(tiny_config(tmp_path / "run"), _Device("cpu")) == NO_TARGET
    assert run_target(tiny_config(tmp_path / "run", gpu="rtx-4090"), _Device("cpu")).card == "rtx-4090"


def test_a_budget_too_small_is_refused_with_the_plan_and_what_to_change():
    preflight = RunPlanner(tiny_model_dict(), target_from_options(None, "1MiB")).preflight(KNOBS)
    assert preflight.refused and preflight.fitting == []  # nothing fits 1 MiB
    err = refusal(preflight, KNOBS)
    assert isinstance(err, PreflightError)
    assert err.plan is not None and err.plan.fits is False
    assert err.plan.device_total_bytes > 1024 * 1024
    assert "more than the 1.0 MiB of budget 1MiB" in str(err)
    assert "batch_size: 2, grad_accum: 2" in str(err)
    assert "--force" in str(err)


def test_a_refusal_names_the_configurations_that_fit_fastest_first():
    # Between the run as given (checkpointing off, micro-batch 4) and its leanest configuration.
    knobs = dict(KNOBS, checkpointing="off", tiling="off", seq_len=256)
    planner = RunPlanner(tiny_model_dict(), NO_TARGET)
    given = planner.check(knobs).device_total_bytes
    lean = planner.check(dict(knobs, checkpointing="on", batch_size=1, grad_accum=4)).device_total_bytes
    assert lean < given
    budget = target_from_options(None, str((given + lean) // 2))
    preflight = RunPlanner(tiny_model_dict(), budget).preflight(knobs)
    assert preflight.refused and 1 <= len(preflight.fitting) <= 3
    assert all(p.fits and p.spec["batch_size"] * p.spec["grad_accum"] == 4 for p in preflight.fitting)
    # The first is the configuration fit: auto chooses, against the same Target.
    chosen = RunPlanner(tiny_model_dict(), budget).fit(knobs)
    assert chosen is not None and preflight.fitting[0].spec == chosen.chosen.spec
    text = str(refusal(preflight, knobs))
    first = preflight.fitting[0].spec
    assert "fits (" in text and f"batch_size: {first['batch_size']}, grad_accum: {first['grad_accum']}" in text
    assert "fit: auto (train --fit)" in text and "--force" in text


def test_force_trains_anyway_and_a_big_budget_fits():
    forced = RunPlanner(tiny_model_dict(), target_from_options(None, "1MiB")).preflight(KNOBS, force=True)
    assert forced.forced and forced.fits is False and not forced.refused and forced.fitting == []
    roomy = RunPlanner(tiny_model_dict(), target_from_options(None, "80GiB")).preflight(KNOBS)
    assert roomy.fits is True and not roomy.forced
    assert roomy.to_dict()["plan"]["spec"]["rank"] == 4


def test_train_refuses_before_loading_any_weight(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from memfit.train import loading
    from memfit.train.recipe import train

    def must_not_load(*args, **kwargs):
        raise AssertionError("weights were loaded before preflight")

    monkeypatch.setattr(loading, "load_model", must_not_load)
    with pytest.raises(PreflightError):
        train(tiny_config(tmp_path / "run", budget="1MiB"), progress=False)


def test_the_command_exits_3_on_refusal(tmp_path):
    pytest.importorskip("torch")
    import typer
    from trainer_helpers import REPO
    from typer.testing import CliRunner

    from memfit.train.command import train_command

    app = typer.Typer()
    app.command("train")(train_command)
    app.command("other")(lambda: None)
    result = CliRunner().invoke(
        app, ["train", str(REPO / "examples" / "tiny.yaml"), "-o", str(tmp_path / "run"), "--budget", "1MiB"]
    )
    assert result.exit_code == 3, result.output
    assert "preflight" in result.output and "--force" in result.output
    bad = CliRunner().invoke(app, ["train", str(REPO / "examples" / "tiny.yaml"), "--lr", "-1", "--set", "epoch=2"])
    assert bad.exit_code == 2
    assert "lr: -1.0" in bad.output and "Did you mean 'epochs'" in bad.output


def test_oom_advice_is_ordered_by_effect():
    advice = oom_advice(
        dict(method="full", optimizer="adamw", checkpointing="off", batch_size=8, grad_accum=2, seq_len=4096)
    )
    assert advice[0].startswith("turn activation checkpointing on")
    assert "batch_size: 4, grad_accum: 4" in advice[1]
    assert "seq_len: 2048" in advice[2]
    assert any("adamw8bit" in a for a in advice) and any("method: lora" in a for a in advice)
    small = oom_advice(dict(method="qlora", checkpointing="on", batch_size=1, seq_len=256, rank=8))
    assert small == ["check the options with `memfit plan` and its --budget"]
