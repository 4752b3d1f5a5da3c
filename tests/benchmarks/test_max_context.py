"""The GPU half of the max-context benchmark runs end to end (tiny model, CPU), for both recipes."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_measure_harness_on_cpu(tmp_path):
    out = tmp_path / "max_context.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "max_context.py"), "--tiny", "--device", "cpu", "--out", str(out)],
        check=True,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    assert [run["recipe"] for run in result["runs"]] == ["memfit", "hf"]
    for run in result["runs"]:
        assert [r["tokens"] for r in run["runs"]] == [256, 512]
        assert all(r["status"] == "ok" and r["tokens_per_second"] > 0 for r in run["runs"])
        assert run["longest_measured"] == 512
