"""memfit doctor on recorded run folders: findings with fixes, most important first; exit codes."""

from __future__ import annotations

import json

from rich.console import Console
from watch_helpers import GiB, MiB, start_record, step_records, tiny_plan, write_run

from memfit.watch.doctor import diagnose, render
from memfit.watch.timeline import Finding


def leaky_run(tmp_path, total_steps=50_000):  # 57 GiB free at 2 MiB per step: full near step 29,000
    def devices(s):
        return {
            "cuda:0": {"allocated_bytes": 200 * MiB, "process_bytes": 700 * MiB},
            "cuda:1": {
                "allocated_bytes": 20 * GiB + 2 * MiB * s,
                "reserved_bytes": 22 * GiB + 2 * MiB * s,
                "peak_allocated_bytes": 24 * GiB + 2 * MiB * s,
                "peak_reserved_bytes": 24 * GiB,
                "nvml_used_bytes": 23 * GiB + 2 * MiB * s,
            },
        }

    live = Finding("error", "checkpointing_inactive", "activation checkpointing was asked for but is off", "enable it")
    records = [
        start_record(
            ("cuda:1",),
            total_steps,
            plan=tiny_plan(allocated=20 * GiB),
            capacity={"cuda:0": 80 * GiB, "cuda:1": 80 * GiB},
        ),
        *step_records(120, devices=devices),
        {"kind": "finding", "finding": live.to_dict()},
    ]
    return write_run(tmp_path / "run", records, metrics=[{"step": s, "loss": 3.0 / s} for s in range(1, 121)])


def text_of(diagnosis) -> str:
    console = Console(record=True, width=200)
    render(diagnosis, console)
    return console.export_text()


def test_findings_from_the_timeline_and_from_the_live_run_most_severe_first(tmp_path):
    diagnosis = diagnose(leaky_run(tmp_path))
    codes = [(f.severity, f.code, f.data.get("device")) for f in diagnosis.findings]
    assert codes[:3] == [
        ("error", "checkpointing_inactive", None),
        ("error", "stray_device", "cuda:0"),
        ("error", "leak", "cuda:1"),
    ]
    assert diagnosis.exit_code == 1
    text = text_of(diagnosis)
    assert "1. error checkpointing_inactive" in text and "fix:" in text
    assert "grows by 2.00 MiB per step" in text
    assert "predicted vs measured" in text


def test_a_clean_run_is_healthy(tmp_path):
    run = write_run(tmp_path / "run", [start_record(), *step_records(50), {"kind": "end", "status": "completed"}])
    diagnosis = diagnose(run)
    assert diagnosis.findings == [] and diagnosis.exit_code == 0
    assert "No memory problems found in 50 recorded steps" in text_of(diagnosis)


def test_warnings_alone_exit_zero_and_an_oom_from_run_json_is_an_error(tmp_path):
    devices = lambda s: {"cuda:0": {"allocated_bytes": GiB, "other_processes_bytes": 2 * GiB}}  # noqa: E731
    run = write_run(tmp_path / "run", [start_record(("cuda:0",)), *step_records(5, devices=devices)])
    diagnosis = diagnose(run)
    assert [f.code for f in diagnosis.findings] == ["other_processes"] and diagnosis.exit_code == 0
    (run / "run.json").write_text(json.dumps({"status": "oom", "step": 4}))
    diagnosis = diagnose(run)
    assert diagnosis.findings[0].code == "oom" and "step 5" in diagnosis.findings[0].message
    assert diagnosis.exit_code == 1
    assert "no end record" in text_of(diagnosis)


def test_host_peak_is_the_recorders_own_peak_and_says_which_reading(tmp_path):
    # Step ends read 1.8 GiB at most; the process's high-water mark (ru_maxrss) saw 2.0 GiB between them.
    steps = step_records(30, rss=lambda s: 1800 * MiB + s * 64 * 1024)
    for record in steps:
        record["peak_rss_bytes"] = 2048 * MiB
    diagnosis = diagnose(write_run(tmp_path / "run", [start_record(), *steps]))
    host = dict(diagnosis.facts)["host RSS"]
    assert host.startswith("1.8 GiB after the first step, 1.8 GiB at the last; peak 2.0 GiB ")
    assert "the process's peak RSS from the OS, getrusage ru_maxrss; reached by the end of step 1" in host
    assert "peak 2.0 GiB" in text_of(diagnosis)


def test_output_through_a_pipe_is_not_wrapped_at_80_columns(tmp_path):
    from typer.testing import CliRunner

    from memfit.cli import app

    run = write_run(
        tmp_path / ("a-run-folder-with-a-long-name-" * 3),
        [start_record(), *step_records(100, rss=lambda s: 400 * MiB + 3 * MiB * s)],
    )
    result = CliRunner().invoke(app, ["doctor", str(run)])  # not a terminal, as through a pipe
    lines = result.output.splitlines()
    assert any(line.startswith("run folder") and line.endswith(run.name) for line in lines)
    [leak] = [line for line in lines if "leak" in line]
    assert len(leak) > 100 and "MiB per step" in leak  # one line, however long
    assert all(line == line.rstrip() for line in lines)  # and no padding to a width
