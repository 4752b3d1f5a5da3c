"""A run's memory against its plan: dropped files read as data, or the folder given on the command line."""

from __future__ import annotations

import json

import pytest

from memfit.ui.runs import from_folder, from_uploads
from memfit.ui.uploads import MAX_UPLOAD_BYTES, UploadError

MiB, GiB = 2**20, 2**30

PLAN = {
    "model": "tiny",
    "spec": {"method": "lora", "checkpointing": "on", "batch_size": 1, "seq_len": 2048},
    "peak": {
        "allocated_bytes": 2 * GiB,
        "reserved_bytes": 2 * GiB + 100 * MiB,
        "device_total_bytes": 2 * GiB + 600 * MiB,
        "phase": "backward",
    },
    "categories": {
        "weights": GiB,
        "trainable": 64 * MiB,
        "gradients": 64 * MiB,
        "optimizer": 128 * MiB,
        "activations": 20 * MiB,
        "temporaries": 32 * MiB,
        "allocator": 100 * MiB,
        "runtime": 500 * MiB,
    },
    "gpu": None,
    "fits": None,
    "headroom_bytes": None,
    "details": {},
}


def records(plan=PLAN, cuda=True):
    device = (
        {
            "cuda:0": {
                "allocated_bytes": GiB,
                "reserved_bytes": 2 * GiB,
                "peak_allocated_bytes": 2 * GiB + 50 * MiB,
                "peak_reserved_bytes": 2 * GiB + 200 * MiB,
                "process_bytes": 2 * GiB + 700 * MiB,
            }
        }
        if cuda
        else {}
    )
    start = {
        "kind": "start",
        "schema": 1,
        "expected_devices": ["cuda:0" if cuda else "cpu"],
        "plan": plan,
        "total_steps": 3,
    }
    steps = [{"kind": "step", "step": i, "rss_bytes": 400 * MiB, "devices": device} for i in (1, 2, 3)]
    attribution = {
        "kind": "attribution",
        "first_step": 1,
        "peak_allocated_bytes": 2 * GiB,
        "categories": {"weights": GiB, "activations": 60 * MiB, "runtime": 1},
    }
    return [start, *steps, attribution]


def jsonl(items) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in items).encode()


def test_a_dropped_memory_file_is_compared_as_memfit_report_compares_it():
    from memfit.watch.compare import compare_categories, compare_peaks
    from memfit.watch.timeline import parse_timeline

    answer = from_uploads(jsonl(records()), None)
    timeline = parse_timeline(jsonl(records()).decode().splitlines())
    assert answer["categories"] == [r.to_dict() for r in compare_categories(PLAN, timeline)]
    assert answer["peaks"] == [r.to_dict() for r in compare_peaks(PLAN, timeline)]
    assert answer["plan_source"] == "the run's own plan" and answer["device"] == "cuda:0"
    assert [s["peak_allocated_bytes"] for s in answer["steps"]] == [2 * GiB + 50 * MiB] * 3
    activations = next(r for r in answer["categories"] if r["name"] == "activations")
    assert activations["measured_bytes"] == 60 * MiB and activations["ratio"] == 3.0


def test_a_run_without_a_plan_is_held_against_the_plan_on_the_page():
    answer = from_uploads(jsonl(records(plan=None)), None, fallback_plan=PLAN)
    assert answer["plan_source"].startswith("the plan on the page") and answer["note"] is None
    run_json = json.dumps({"plan": PLAN, "device": "cuda:0"}).encode()
    assert from_uploads(jsonl(records(plan=None)), run_json)["plan_source"] == "the run's own plan"


def test_a_cpu_run_is_shown_measured_only_as_memfit_report_shows_it():
    from memfit.watch.compare import compare_categories
    from memfit.watch.timeline import parse_timeline

    answer = from_uploads(jsonl(records(cuda=False)), None, fallback_plan=PLAN)
    timeline = parse_timeline(jsonl(records(cuda=False)).decode().splitlines())
    assert answer["plan"] is None and answer["plan_source"] is None and answer["peaks"] == []
    assert answer["categories"] == [r.to_dict() for r in compare_categories(None, timeline)]
    assert answer["note"].startswith("a CPU run: the plan is of GPU memory")


@pytest.mark.parametrize(
    "memory, says",
    [
        (b"\xff\xfe", "not UTF-8 text"),
        (jsonl([{"kind": "step", "step": 1}]), "has no start record"),
        (b"{oops\n" + jsonl(records()), "line 1 is not a JSON object"),
        (b" " * (MAX_UPLOAD_BYTES + 1), "more than 1 MiB"),
    ],
)
def test_a_damaged_or_large_file_is_one_line(memory, says):
    with pytest.raises(UploadError, match=says):
        from_uploads(memory, None)


def test_the_api_takes_dropped_files_and_the_folder_from_the_command_line(tmp_path):
    from starlette.testclient import TestClient

    from memfit.ui.app import create_app
    from memfit.ui.service import PlannerService

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "memory.jsonl").write_bytes(jsonl(records()))
    client = TestClient(create_app(PlannerService(), run_dir=run_dir))
    assert client.get("/api/run").json() == from_folder(run_dir)
    dropped = client.post("/api/run", content=json.dumps({"memory": jsonl(records()).decode()}))
    assert dropped.status_code == 200 and dropped.json()["categories"] == from_folder(run_dir)["categories"]
    too_big = client.post("/api/run", content=b" " * (3 * MAX_UPLOAD_BYTES + 1))
    assert too_big.status_code == 400 and "more than 3 MiB" in too_big.json()["error"]
    assert client.post("/api/run", content=b'{"run": "{}"}').status_code == 400
    assert TestClient(create_app(PlannerService())).get("/api/run").status_code == 404


def test_the_command_line_folder_without_a_plan_is_held_against_the_page_plan(tmp_path):
    from starlette.testclient import TestClient

    from memfit.ui.app import create_app
    from memfit.ui.service import PlannerService

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "memory.jsonl").write_bytes(jsonl(records(plan=None)))
    client = TestClient(create_app(PlannerService(), run_dir=run_dir))
    answer = client.post("/api/run", content=json.dumps({"folder": True, "plan": PLAN})).json()
    assert answer["plan_source"].startswith("the plan on the page") and answer["source"] == str(run_dir)
    assert answer == from_folder(run_dir, PLAN)
    assert TestClient(create_app(PlannerService())).post("/api/run", content=b'{"folder": true}').status_code == 404
