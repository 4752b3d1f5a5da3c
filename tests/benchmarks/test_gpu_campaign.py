"""The GPU campaign's whole logic runs on a CPU with tiny models (``--tiny --device cpu``), so that
it cannot rot between GPU runs: every part's results file, resume, ``--parts``,
``--max-minutes`` and the report. The dry runs hold ``--max-minutes`` against a clock that does not
move (``--frozen-clock``), so what starts depends on the estimates alone, not on how busy the
machine is; the subprocess timeouts only catch a hung process."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CAMPAIGN = ROOT / "benchmarks" / "gpu_campaign.py"
sys.path.insert(0, str(ROOT / "benchmarks"))


#: Only a hung dry run takes this long, however busy the machine (a quiet one takes about a minute).
HANG_S = 3600


def campaign(*args, tiny=True):
    command = [
        sys.executable,
        str(CAMPAIGN),
        *(["--tiny", "--device", "cpu", "--frozen-clock"] if tiny else []),
        *map(str, args),
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=HANG_S, cwd=ROOT)


def load(folder: Path, name: str) -> dict:
    return json.loads((folder / name).read_text())


@pytest.mark.slow
def test_dry_run_every_part_then_resume_then_time_limit(tmp_path):
    out = tmp_path / "results" / "cpu"

    # Three parts only, within a budget that their estimates fit: their files and nothing else.
    first = campaign("--parts", "tests,accuracy,constants", "--out", out, "--max-minutes", "5")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == {
        "campaign.json",
        "campaign.log",
        "tests.json",
        "accuracy.json",
        "constants.json",
    }

    tests = load(out, "tests.json")
    assert tests["status"] == "complete" and tests["mode"] == "tiny"
    pytest_run = tests["units"]["pytest"]
    # On a CPU every GPU test is skipped by the suite's conftest, and each one is listed.
    assert (
        pytest_run["exit_code"] == 0
        and pytest_run["counts"] == {"skipped": len(pytest_run["tests"])}
        and pytest_run["tests"]
    )

    accuracy = load(out, "accuracy.json")
    assert accuracy["status"] == "complete" and len(accuracy["units"]) == 2
    for row in accuracy["units"].values():
        assert row["measured"]["status"] == "ok" and row["measured"]["allocated_bytes"] > 0
        # Real CPU tensors, measured by the planner's tracker: plan and run agree within 1%.
        assert abs(row["error"]["allocated"]) < 0.01
    assert accuracy["summary"]["allocated"]["n"] == 2 and accuracy["summary"]["allocated"]["median_abs_error"] < 0.01

    constants = load(out, "constants.json")["units"]["constants"]
    assert constants["status"] == "ok" and constants["measured"] is None  # nothing to measure on a CPU
    assert constants["assumed"]["cuda_context_bytes"] == 512 * 2**20
    assert [s["method"] for s in constants["training_steps"]] == ["lora", "qlora"]

    # Everything: the three finished parts are skipped, context and speed run.
    second = campaign("--out", out)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert load(out, "accuracy.json")["units"] == accuracy["units"]
    assert "2 of 2 cases done earlier" in second.stdout and "tests: done earlier" in second.stdout

    context = load(out, "context.json")
    assert context["status"] == "complete"
    for recipe in ("memfit", "hf"):
        unit = context["units"][recipe]
        planned, step = unit["planned_max_seq_len"], unit["step_tokens"]
        assert unit["finished"] and planned > 0 and step >= 128
        # The search ends on a boundary: a length that ran, and one step above it one that did not.
        assert unit["first_oom"] - unit["longest_ran"] == step
        # On a CPU the cap is the plan's allocated bytes at its answer: the boundary is near it.
        assert abs(unit["longest_ran"] - planned) <= 4 * step
        assert all(p["status"] in ("ok", "oom") for p in unit["probes"])

    speed = load(out, "speed.json")
    assert speed["status"] == "complete"
    sides = {u["side"]: u["result"] for u in speed["units"].values()}
    assert set(sides) == {"memfit", "hf-trainer"}
    for result in sides.values():
        assert result["status"] == "ok" and result["tokens_per_second_after_warmup"] > 0
    assert sides["memfit"]["tokens"] == sides["hf-trainer"]["tokens"]  # the same rows on both sides
    assert speed["summary"]["tiny-lora-128"]["speed_ratio"] > 0

    invocations = load(out, "campaign.json")["invocations"]
    assert len(invocations) == 2
    assert invocations[1]["parts"]["accuracy"]["status"] == "complete"
    assert invocations[1]["parts"]["tests"]["status"] == "done earlier"
    assert invocations[0]["environment"]["versions"]["torch"]

    # A budget of 18 s: the tests part (estimated 20 s) does not start and writes no file, whatever
    # the machine's speed (the clock is frozen: only the estimates count).
    budget = tmp_path / "results" / "budget"
    limited = campaign("--parts", "tests", "--out", budget, "--max-minutes", "0.3")
    assert limited.returncode == 0, limited.stderr[-3000:]
    assert {p.name for p in budget.iterdir()} == {"campaign.json", "campaign.log"}
    assert load(budget, "campaign.json")["invocations"][0]["parts"]["tests"]["status"] == "not started (time)"

    # The report reads the results; the dry run is marked as such (the command's own --report is
    # test_report_without_results_says_so's).
    from gpu_campaign import write_report

    doc = tmp_path / "gpu-results.md"
    write_report(tmp_path / "results", doc, None, include_tiny=True)
    text = doc.read_text()
    assert "dry run on a CPU" in text and "### 2. Planner accuracy" in text and "tiny-llama/lora-on-2x64" in text


def test_report_without_results_says_so(tmp_path):
    doc = tmp_path / "gpu-results.md"
    readme = tmp_path / "README.md"
    from gpu_campaign import README_BEGIN, README_END

    readme.write_text(f"# x\n\n{README_BEGIN}\nold\n{README_END}\n\nrest\n")
    result = campaign("--report", "--results-root", tmp_path / "nothing", "--doc", doc, "--readme", readme, tiny=False)
    assert result.returncode == 0, result.stderr
    assert "No GPU measurements yet" in doc.read_text() and "--install --max-minutes 9 --out $OUT" in doc.read_text()
    text = readme.read_text()
    assert "No GPU measurements yet" in text and "old" not in text and text.endswith("rest\n")


@pytest.mark.parametrize(
    "args, option",
    [
        (["--parts", "acuracy"], "--parts"),
        (["--max-minutes", "-1"], "--max-minutes"),
        (["--device", "tpu"], "--device"),
        (["--resume-from", "/nonexistent/folder"], "--resume-from"),
    ],
)
def test_bad_options_one_line_exit_2(args, option):
    result = campaign(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and option in lines[0]


def test_cpu_without_tiny_is_refused():
    result = campaign("--device", "cpu", tiny=False)
    assert result.returncode == 2 and "--tiny" in result.stderr


def test_the_time_budget_reads_the_clock_it_is_given():
    from gpu_campaign import GRACE_S, Clock, FrozenClock

    now = [1000.0]
    clock = Clock(2, now=lambda: now[0])  # two minutes from t=1000
    assert clock.allows(120) and not clock.allows(120.5)
    now[0] = 1100.0
    assert clock.elapsed() == 100 and clock.allows(20) and not clock.allows(21)
    # A child may run to the deadline plus the grace period, and no less than 30 s.
    assert clock.child_timeout(1) == 20 + GRACE_S
    now[0] = 1300.0
    assert clock.child_timeout(1) == 30 and clock.child_deadline == 1120
    # Without a budget only a hung child is stopped: at 5x its estimate, the hang limit at least.
    open_ended = Clock(None, now=lambda: now[0])
    assert open_ended.allows(10**9) and open_ended.child_timeout(1) == 120 and open_ended.child_timeout(100) == 500

    frozen = FrozenClock(0.5)
    assert frozen.allows(30) and not frozen.allows(31) and frozen.elapsed() == 0
    assert frozen.child_deadline is None and frozen.child_timeout(1) == 3600


def test_merge_keeps_units_of_both_and_every_invocation():
    from gpu_campaign import merge_part

    mine = {"units": {"a": {"v": 1}, "b": {"v": 2}}, "info": {"x": 1}}
    other = {"units": {"b": {"v": 9}, "c": {"v": 3}}, "info": {"y": 2}}
    merged = merge_part(mine, other)
    assert merged["units"] == {"a": {"v": 1}, "b": {"v": 2}, "c": {"v": 3}} and merged["info"] == {"x": 1, "y": 2}
    runs = merge_part(
        {"invocations": [{"id": "2", "started_at": "2"}]}, {"invocations": [{"id": "1", "started_at": "1"}]}
    )
    assert [i["id"] for i in runs["invocations"]] == ["1", "2"]


def _write(folder: Path, name: str, data: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(data))


def test_report_says_where_measurements_disagree_with_the_plan(tmp_path):
    """Results shaped as a GPU run writes them (made up for this test): each disagreement gets its sentence."""
    from gpu_campaign import write_report

    GiB, MiB = 2**30, 2**20
    folder = tmp_path / "results" / "h100-80gb"
    env = {
        "gpu": "NVIDIA H100 80GB HBM3",
        "cpu": "x",
        "cpu_count": 16,
        "memory_bytes": 128 * GiB,
        "platform": "linux",
        "versions": {
            "python": "3.12",
            "torch": "2.11",
            "transformers": "5.17",
            "peft": "0.18",
            "bitsandbytes": "0.50.2",
        },
        "cuda_runtime": "13.0",
        "memfit": {"commit": None, "digest": "abc"},
        "gpu_details": {
            "name": "NVIDIA H100 80GB HBM3",
            "total_memory_bytes": 80 * GiB,
            "compute_capability": "9.0",
            "driver": "580",
        },
    }
    _write(
        folder,
        "campaign.json",
        {
            "mode": "gpu",
            "gpu_key": "h100-80gb",
            "invocations": [
                {
                    "id": "1",
                    "started_at": "t",
                    "command": "python3 benchmarks/gpu_campaign.py --install",
                    "environment": env,
                    "parts": {"accuracy": {"status": "complete"}},
                    "seconds": 500,
                }
            ],
        },
    )
    close = {
        "id": "m/lora-on-1x2048",
        "plan": {"reserved_bytes": 10 * GiB, "allocated_bytes": 9 * GiB, "context_bytes": 512 * MiB},
        "measured": {
            "status": "ok",
            "reserved_bytes": int(10.1 * GiB),
            "allocated_bytes": 9 * GiB,
            "outside_allocator_bytes": 700 * MiB,
        },
        "error": {"reserved": -0.01, "allocated": 0.0, "device_total": -0.02},
    }
    far = {
        "id": "m/qlora-on-1x4096",
        "plan": {"reserved_bytes": 10 * GiB, "allocated_bytes": 9 * GiB, "context_bytes": 512 * MiB},
        "measured": {
            "status": "ok",
            "reserved_bytes": int(8.9 * GiB),
            "allocated_bytes": 8 * GiB,
            "outside_allocator_bytes": 700 * MiB,
        },
        "error": {"reserved": 0.12, "allocated": 0.125, "device_total": 0.1},
    }
    _write(
        folder,
        "accuracy.json",
        {
            "units": {close["id"]: close, far["id"]: far},
            "info": {"cases": [close["id"], far["id"]]},
            "summary": {"reserved": {"n": 2, "median_abs_error": 0.065, "p95_abs_error": 0.12, "max_abs_error": 0.12}},
        },
    )
    _write(
        folder,
        "context.json",
        {
            "info": {"model": "llama-3.1-8b", "knobs": {"rank": 32}, "card": "rtx-4090", "steps_per_length": 2},
            "units": {
                "memfit": {
                    "planned_max_seq_len": 131072,
                    "longest_ran": 122880,
                    "first_oom": 126976,
                    "step_tokens": 4096,
                    "finished": True,
                    "probes": [],
                }
            },
        },
    )
    _write(
        folder,
        "constants.json",
        {
            "units": {
                "constants": {
                    "status": "ok",
                    "arch": "hopper",
                    "assumed": {
                        "cuda_context_bytes": 512 * MiB,
                        "cublas_workspace_allocs_bytes": [32 * MiB, 32 * MiB],
                        "cublas_workspace_bytes": 64 * MiB,
                    },
                    "measured": {
                        "after_init": {"context_bytes": 500 * MiB},
                        "first_forward_matmul_bytes": 32 * MiB,
                        "first_backward_bytes_beyond_grad": 32 * MiB,
                        "cublas_workspaces_freed_bytes": 64 * MiB,
                        "single_requests_matching": 14,
                    },
                    "training_steps": [{"method": "lora", "context_bytes": 700 * MiB}],
                    "single_requests": [
                        {
                            "request_bytes": 1,
                            "model_allocated_bytes": 512,
                            "model_reserved_bytes": 2 * MiB,
                            "allocated_bytes": 512,
                            "reserved_bytes": 2 * MiB,
                        }
                    ],
                    "replay": {"events": 600, "mismatched_events": 0},
                }
            }
        },
    )
    doc = tmp_path / "gpu-results.md"
    write_report(tmp_path / "results", doc, None)
    text = doc.read_text()
    assert "## NVIDIA H100 80GB HBM3" in text and "is **not met**" in text
    assert "`m/qlora-on-1x4096`: the plan says" in text and "`m/lora-on-1x2048`: the plan says" not in text
    assert "**the plan's answer ran out of memory**" in text  # 131,072 planned, 122,880 ran
    assert "The CUDA context of a lora training process measures 700 MiB" in text
    assert "median over 2 runs: 700 MiB; the planner assumes 512 MiB. **They differ by more than 64 MiB**" in text
    assert "Not run yet." in text  # the tests and speed parts have no results
