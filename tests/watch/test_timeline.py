"""Reading memory.jsonl and run folders back; findings order and identity."""

from __future__ import annotations

import json

import pytest
from watch_helpers import start_record, step_records, write_run

from memfit.watch.timeline import (
    Finding,
    TimelineError,
    load_run,
    merge_findings,
    parse_timeline,
    sort_findings,
)


def lines(records):
    return [json.dumps(r) for r in records]


def test_parse_keeps_every_kind():
    finding = Finding("warning", "leak", "m", "f", 3, {"device": "host"})
    records = [
        start_record(),
        *step_records(3),
        {"kind": "attribution", "categories": {"weights": 1}},
        {"kind": "finding", "finding": finding.to_dict()},
        {"kind": "end", "status": "completed"},
    ]
    timeline = parse_timeline(lines(records))
    assert [r["step"] for r in timeline.steps] == [1, 2, 3]
    assert timeline.attribution["categories"] == {"weights": 1}
    assert timeline.findings == [finding]
    assert timeline.end["status"] == "completed"
    assert timeline.expected_devices == ["cpu"]


def test_a_damaged_last_line_is_dropped_but_not_one_in_the_middle():
    good = lines([start_record(), *step_records(2)])
    crashed = parse_timeline(good + ['{"kind": "step", "st'])
    assert len(crashed.steps) == 2
    with pytest.raises(TimelineError, match="line 2 is not a JSON object"):
        parse_timeline([good[0], "{oops", good[1]])


def test_without_start_record_the_file_is_refused():
    with pytest.raises(TimelineError, match="no start record"):
        parse_timeline(lines(step_records(2)))


def test_resumed_run_replaces_steps_after_the_resume_step_and_a_new_run_replaces_all():
    first = [start_record(), *step_records(5)]
    resumed = [start_record(resumed_from_step=3), *step_records(6)[3:]]
    timeline = parse_timeline(lines(first + resumed))
    assert [r["step"] for r in timeline.steps] == [1, 2, 3, 4, 5, 6]
    fresh = parse_timeline(lines(first + [start_record(), *step_records(2)]))
    assert [r["step"] for r in fresh.steps] == [1, 2]


def test_load_run_errors_name_the_problem(tmp_path):
    with pytest.raises(TimelineError, match="does not exist"):
        load_run(tmp_path / "missing")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(TimelineError, match="is a file"):
        load_run(tmp_path / "file.txt")
    with pytest.raises(TimelineError, match="has no memory.jsonl"):
        load_run(tmp_path)


def test_load_run_fills_device_and_plan_from_run_json(tmp_path):
    run = write_run(
        tmp_path / "run",
        [start_record(expected=()), *step_records(2)],
        metrics=[{"step": 1, "loss": 2.0}, {"step": 1, "eval_loss": 2.5}, "not a dict"],
    )
    (run / "run.json").write_text(json.dumps({"device": "cuda:1", "total_steps": 50, "plan": {"categories": {}}}))
    folder = load_run(run)
    assert folder.timeline.expected_devices == ["cuda:1"]
    assert folder.timeline.total_steps == 50
    assert folder.plan == {"categories": {}}
    assert len(folder.metrics) == 2


def test_findings_sort_most_severe_first_and_merge_by_code_and_device():
    info = Finding("info", "x", "m", "f", 1)
    warn = Finding("warning", "leak", "m", "f", 9, {"device": "host"})
    err = Finding("error", "leak", "m", "f", 20, {"device": "host"})
    other = Finding("warning", "leak", "m", "f", 5, {"device": "cuda:0"})
    assert sort_findings([info, warn, err]) == [err, warn, info]
    assert merge_findings([warn, other], [err, info]) == [err, other, info]
    with pytest.raises(ValueError, match="severity"):
        Finding("fatal", "x", "m", "f")


def test_every_rank_of_a_multi_process_run_is_read_and_diagnosed(tmp_path):
    from watch_helpers import GiB, MiB

    from memfit.watch.doctor import diagnose, run_facts

    steady = lambda s: {"cuda:0": {"allocated_bytes": 10 * GiB, "peak_allocated_bytes": 12 * GiB}}  # noqa: E731

    def leaking(s):
        return {"cuda:1": {"allocated_bytes": 10 * GiB + 2 * MiB * s, "peak_allocated_bytes": 12 * GiB + 2 * MiB * s}}

    capacity = {"cuda:0": 80 * GiB, "cuda:1": 80 * GiB}
    run = write_run(
        tmp_path / "run", [start_record(("cuda:0",), 50_000, capacity=capacity), *step_records(120, devices=steady)]
    )
    rank1 = [start_record(("cuda:1",), 50_000, capacity=capacity), *step_records(120, devices=leaking)]
    (run / "memory-rank1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rank1))

    timeline = load_run(run).timeline
    assert timeline.device_names() == ["cuda:0", "rank1/cuda:1"]
    assert timeline.expected_devices == ["cuda:0", "rank1/cuda:1"]
    diagnosis = diagnose(run)
    assert [(f.code, f.data.get("device")) for f in diagnosis.findings] == [("leak", "rank1/cuda:1")]
    assert any(name == "rank1/cuda:1" for name, _ in run_facts(diagnosis.run))
