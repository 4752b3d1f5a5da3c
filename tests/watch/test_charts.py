"""The report's charts: drawn only with data to show, named after their device."""

from __future__ import annotations

from pathlib import Path

import pytest
from watch_helpers import GiB, start_record, step_records

pytest.importorskip("matplotlib")

from memfit.watch.charts import chart_title, device_chart_name, render_charts
from memfit.watch.doctor import Diagnosis
from memfit.watch.timeline import RunFolder, Timeline


def charts_of(steps, metrics=(), expected=("cuda:0",)):
    run = RunFolder(
        path=Path("run"), timeline=Timeline(start=start_record(expected), steps=steps), metrics=list(metrics), run=None
    )
    return [name for name, _ in render_charts(Diagnosis(run=run, findings=[]), plan_compared=False)]


def test_a_device_without_byte_readings_or_a_series_of_one_point_gets_no_chart():
    # NVML named the device but measured nothing on it: no frame drawn around nothing.
    assert charts_of(step_records(5, devices=lambda s: {"cuda:0": {"total_bytes": 80 * GiB}})) == ["memory-host"]
    assert charts_of(step_records(5, devices=lambda s: {"cuda:0": {"allocated_bytes": GiB}})) == [
        "memory-cuda0",
        "memory-host",
    ]
    assert (
        charts_of(step_records(1, devices=lambda s: {"cuda:0": {"allocated_bytes": GiB}}), [{"step": 1, "loss": 2.0}])
        == []
    )


def test_eval_points_alone_make_a_loss_chart_and_the_trainers_learning_rate_is_drawn():
    metrics = [
        {"step": 10, "eval_loss": 2.5},
        {"step": 20, "eval_loss": 2.4},
        {"step": 10, "learning_rate": 1e-4},
        {"step": 20, "learning_rate": 5e-5},
    ]
    assert charts_of(step_records(2), metrics) == ["loss", "lr", "memory-host"]


def test_names_and_titles():
    assert device_chart_name("rank1/cuda:1") == "memory-rank1-cuda1"
    assert chart_title("memory-cuda0") == "Memory: cuda0" and chart_title("lr") == "Learning rate"
