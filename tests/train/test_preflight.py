"""Preflight: plan the exact run before any weight is loaded; refuse one that cannot fit."""

from __future__ import annotations

import pytest
from trainer_helpers import tiny_config, tiny_model_dict

from memfit.train.preflight import (
    PreflightError,
    detect_target,
    oom_advice,
    run_preflight,
)

KNOBS = dict(method="lora", rank=4, precision="fp32", batch_size=4, seq_len=64, grad_accum=1, checkpointing="on")


def test_cpu_without_a_target_plans_nothing():
    result = run_preflight(tiny_model_dict(), KNOBS, device_type="cpu")
    assert result.plan is None and result.fits is None and result.target is None
    assert detect_target("cpu", None, None, None) == (None, None)
    assert detect_target("cpu", None, "rtx-4090", None) == ("rtx-4090", None)


def test_a_budget_too_small_is_refused_with_the_plan_and_what_to_change():
    with pytest.raises(PreflightError) as info:
        run_preflight(tiny_model_dict(), KNOBS, device_type="cpu", budget="1MiB")
    err = info.value
    assert err.plan is not None and err.plan.fits is False
    assert err.plan.device_total_bytes > 1024 * 1024
    assert "more than the 1.0 MiB of budget 1MiB" in str(err)
    assert "batch_size: 2, grad_accum: 2" in str(err)
    assert "--force" in str(err)


def test_force_trains_anyway_and_a_big_budget_fits():
    forced = run_preflight(tiny_model_dict(), KNOBS, device_type="cpu", budget="1MiB", force=True)
    assert forced.forced and forced.fits is False
    roomy = run_preflight(tiny_model_dict(), KNOBS, device_type="cpu", budget="80GiB")
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
    result = CliRunner().invoke(app, ["train", str(REPO / "examples" / "tiny.yaml"), "-o", str(tmp_path / "run"), "--budget", "1MiB"])
    assert result.exit_code == 3, result.output
    assert "preflight" in result.output and "--force" in result.output
    bad = CliRunner().invoke(app, ["train", str(REPO / "examples" / "tiny.yaml"), "--lr", "-1", "--set", "epoch=2"])
    assert bad.exit_code == 2
    assert "lr: -1.0" in bad.output and "Did you mean 'epochs'" in bad.output


def test_oom_advice_is_ordered_by_effect():
    advice = oom_advice(dict(method="full", optimizer="adamw", checkpointing="off", batch_size=8, grad_accum=2, seq_len=4096))
    assert advice[0].startswith("turn activation checkpointing on")
    assert "batch_size: 4, grad_accum: 4" in advice[1]
    assert "seq_len: 2048" in advice[2]
    assert any("adamw8bit" in a for a in advice) and any("method: lora" in a for a in advice)
    small = oom_advice(dict(method="qlora", checkpointing="on", batch_size=1, seq_len=256, rank=8))
    assert small == ["check the options with `memfit plan` and its --budget"]
