"""The accuracy harness runs end to end (on a CPU, with tiny models) and its plan matches its run."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_harness_on_cpu(tmp_path):
    out = tmp_path / "accuracy.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "planner_accuracy.py"), "--tiny", "--device", "cpu", "--out", str(out)],
        check=True,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    assert len(result["cases"]) == 2
    assert all(case["measured"]["status"] == "ok" for case in result["cases"])
    # Real CPU tensors, measured by the same tracker: the plan is within 1%.
    assert result["summary"]["allocated"]["median_abs_error"] < 0.01
