"""The accuracy harness runs end to end as its own command (on a CPU, one tiny configuration) and its
plan matches its run. Both tiny configurations, measured and compared, are in the GPU campaign's dry
run (tests/benchmarks/test_gpu_campaign.py), which calls the same functions."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_harness_on_cpu(tmp_path):
    out = tmp_path / "accuracy.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "planner_accuracy.py"),
            "--tiny",
            "--max-cases",
            "1",
            "--device",
            "cpu",
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    assert len(result["cases"]) == 1 and result["machine"]["cpu_count"]
    assert all(case["measured"]["status"] == "ok" for case in result["cases"])
    # Real CPU tensors, measured by the same tracker: the plan is within 1%.
    assert result["summary"]["allocated"]["median_abs_error"] < 0.01
