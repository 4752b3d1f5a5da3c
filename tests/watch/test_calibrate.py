"""memfit calibrate: a recorded run's context and allocator reserve, kept per card, used by later plans."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from watch_helpers import GiB, MiB, start_record, step_records, tiny_plan, write_run

import memfit
from memfit.planner import calibration
from memfit.watch.calibrate import CalibrationError, calibrate


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "cache"))


def _plan_on(card: str) -> dict:
    return dict(tiny_plan(allocated=2 * GiB), gpu={"name": card, "memory_bytes": 24 * GiB})


def _recorded_run(run_dir, plan):
    # A CUDA run: 2.1 GiB allocated at its peak, 2.5 GiB reserved, NVML sees 3.1 GiB of the process
    # where PyTorch reserved 2.5 GiB (the context: 0.6 GiB; more at a later step, where more was held).
    def devices(step):
        return {
            "cuda:0": {
                "peak_allocated_bytes": int(2.1 * GiB),
                "peak_reserved_bytes": int(2.5 * GiB),
                "reserved_bytes": int(2.5 * GiB),
                "process_bytes": int(3.1 * GiB) + step * MiB,
            }
        }

    return write_run(run_dir, [start_record(expected=("cuda:0",), plan=plan), *step_records(3, devices=devices)])


def test_a_recorded_run_gives_its_cards_context_and_reserve(tmp_path):
    found = calibrate(_recorded_run(tmp_path / "run", _plan_on("rtx-4090")))
    assert found.card == "rtx-4090" and found.context_bytes == int(0.6 * GiB) + MiB
    # Measured reserve 0.4 GiB against the plan's 100 MiB, over a 2.1 GiB peak.
    assert found.allocator_extra_fraction == pytest.approx((0.4 * GiB - 100 * MiB) / (2.1 * GiB), rel=1e-5)
    assert found.describe().startswith("calibrated on rtx-4090 from ") and found.run.endswith("run")


def test_a_memory_stats_dump_beside_its_plan_calibrates_the_reserve_only(tmp_path):
    folder = tmp_path / "dump"
    folder.mkdir()
    (folder / "memory_stats.json").write_text(
        json.dumps({"allocated_bytes.all.peak": 4 * GiB, "reserved_bytes.all.peak": 5 * GiB})
    )
    (folder / "plan.json").write_text(json.dumps(dict(tiny_plan(allocated=4 * GiB), gpu={"name": "a100-80gb"})))
    found = calibrate(folder)
    assert found.card == "a100-80gb" and found.context_bytes is None
    assert found.allocator_extra_fraction == pytest.approx((GiB - 100 * MiB) / (4 * GiB), rel=1e-5)


def test_later_plans_on_the_card_use_the_calibration_and_say_so(tmp_path):
    base = memfit.plan("smollm2-135m", gpu="rtx-4090", seq_len=64, cache=False)
    found = calibrate(_recorded_run(tmp_path / "run", _plan_on("rtx-4090")))
    calibration.save(found)
    assert calibration.for_card("rtx-4090") == found
    after = memfit.plan("smollm2-135m", gpu="rtx-4090", seq_len=64, cache=False)
    extra = int(after.allocated_bytes * found.allocator_extra_fraction)
    assert after.allocated_bytes == base.allocated_bytes
    assert after.reserved_bytes == base.reserved_bytes + extra
    assert after.details["context_bytes"] == found.context_bytes
    assert after.device_total_bytes == after.reserved_bytes + found.context_bytes
    assert after.details["notes"][0] == found.describe()
    other = memfit.plan("smollm2-135m", gpu="a100-80gb", seq_len=64, cache=False)
    assert "calibration" not in other.details and other.details["context_bytes"] == base.details["context_bytes"]
    given = memfit.plan("smollm2-135m", gpu="rtx-4090", seq_len=64, cache=False, context_bytes=1000)
    assert given.details["context_bytes"] == 1000


@pytest.mark.parametrize(
    "what, says",
    [
        ("missing", "is not a folder"),
        ("empty", "has neither memory.jsonl nor memory_stats.json"),
        ("no plan", "without a plan"),
        ("cpu", "a run on a CPU calibrates no card"),
        ("no card", "--gpu"),
    ],
)
def test_a_run_that_cannot_calibrate_says_why(tmp_path, what, says):
    folder = tmp_path / "run"
    if what == "empty":
        folder.mkdir()
    elif what == "no plan":
        _recorded_run(folder, None)
    elif what == "cpu":
        write_run(folder, [start_record(plan=_plan_on("rtx-4090")), *step_records(2)])
    elif what == "no card":
        _recorded_run(folder, tiny_plan())
    with pytest.raises(CalibrationError, match=says):
        calibrate(folder)


def test_the_command_keeps_the_calibration_and_refuses_a_bad_folder_in_one_line(tmp_path):
    run = _recorded_run(tmp_path / "run", tiny_plan())
    env_cache = {"MEMFIT_CACHE": str(tmp_path / "cache")}
    import os

    env = dict(os.environ, **env_cache)
    done = subprocess.run(
        [sys.executable, "-m", "memfit", "calibrate", str(run), "--gpu", "l4"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "calibrated on l4 from" in done.stdout
    assert (
        json.loads((tmp_path / "cache" / "calibration.json").read_text())["cards"]["l4"]["context_bytes"]
        == int(0.6 * GiB) + MiB
    )
    bad = subprocess.run(
        [sys.executable, "-m", "memfit", "calibrate", str(tmp_path / "nothing")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "is not a folder" in bad.stderr
