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


def test_search_goes_up_from_the_plan_until_the_first_oom():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from max_context import next_probes, probe_step, search_outcome

    planned = 8320
    step = probe_step(planned)
    assert step == 256
    assert next_probes(planned, step, []) == ("up", [8320, 8576, 8832, 9088])
    probes = [{"tokens": 8320, "status": "ok"}, {"tokens": 8576, "status": "oom"}]
    assert next_probes(planned, step, probes) is None
    assert search_outcome(planned, step, probes)["longest_ran"] == 8320
    # Nothing ran out of memory up to the last step allowed: done, no OOM found.
    ran = [{"tokens": t, "status": "ok"} for t in (8320, 8576, 8832, 9088)]
    assert next_probes(planned, step, ran) is None and search_outcome(planned, step, ran)["first_oom"] is None
    # A timeout is not an answer: that length is tried again.
    assert next_probes(planned, step, [{"tokens": 8320, "status": "ok"}, {"tokens": 8576, "status": "timeout"}]) == (
        "up",
        [8576, 8832, 9088],
    )


def test_search_goes_down_when_the_plan_runs_out_of_memory():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from max_context import next_probes, search_outcome

    oom = [{"tokens": 131072, "status": "oom"}]
    direction, lengths = next_probes(131072, 4096, oom)
    assert direction == "down" and lengths[:2] == [126976, 122880] and len(lengths) == 6
    probes = oom + [{"tokens": 126976, "status": "oom"}, {"tokens": 122880, "status": "ok"}]
    assert next_probes(131072, 4096, probes) is None
    outcome = search_outcome(131072, 4096, probes)
    assert (outcome["longest_ran"], outcome["first_oom"], outcome["finished"]) == (122880, 126976, True)
    # Down to the limit without a length that ran: done, and said so.
    nothing = [{"tokens": 131072 - k * 4096, "status": "oom"} for k in range(7)]
    assert next_probes(131072, 4096, nothing) is None
    assert search_outcome(131072, 4096, nothing)["longest_ran"] is None
