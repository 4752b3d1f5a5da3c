"""A modest load test of a started server (benchmarks/ui_load.py runs the full 200 requests a pass)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from ui_load import load_test


def test_mixed_concurrent_requests_get_no_server_error_and_memory_stays_flat():
    result = load_test(total=40, threads=6)
    for name in ("warm_up", "load"):
        assert result[name]["server_errors"] == 0, result
        assert result[name]["valid_not_ok"] == 0, result
        assert result[name]["invalid_not_4xx"] == 0, result
    assert result["server_alive_after"] and result["tracebacks_in_server_log"] == 0
    assert result["rss_growth_bytes"] <= result["max_growth_bytes"], result
