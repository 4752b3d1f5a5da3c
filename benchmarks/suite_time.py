"""How long the test suite takes on this machine, and its slowest tests.

Runs ``python -m pytest`` over tests/ (this interpreter, this checkout's memfit) the way ``make
test`` does, and writes to benchmarks/results/test_suite.json the wall time, the outcome counts,
the slowest tests (from pytest's JUnit XML) and the machine's load average before and after: on a
shared machine the same suite takes several times longer, and the load says how busy it was.

    python benchmarks/suite_time.py                 # the whole suite
    python benchmarks/suite_time.py -- -k "not slow"  # pytest options after --
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results" / "test_suite.json"
sys.path.insert(0, str(BENCH))
from _machine import describe_machine, memfit_source, write_results  # noqa: E402


def junit_tests(path: Path) -> list[dict]:
    """Every test case of a JUnit XML report: id, outcome and seconds."""
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
        module = case.get("classname", "").replace(".", "/")
        tests.append(
            {"id": f"{module}.py::{case.get('name')}", "outcome": outcome, "seconds": float(case.get("time") or 0)}
        )
    return tests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RESULTS), help="results file (default benchmarks/results/test_suite.json)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest options (after --)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="memfit-suite-") as scratch:
        junit = Path(scratch) / "junit.xml"
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            *args.pytest_args,
        ]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
        load_before = os.getloadavg()
        started = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, env=env)
        wall = time.perf_counter() - started
        load_after = os.getloadavg()
        tests = junit_tests(junit) if junit.is_file() else []
    counts: dict[str, int] = {}
    for test in tests:
        counts[test["outcome"]] = counts.get(test["outcome"], 0) + 1
    data = {
        "benchmark": "test_suite",
        "command": "python -m pytest " + " ".join(args.pytest_args),
        "exit_code": done.returncode,
        "wall_seconds": round(wall, 1),
        "wall_minutes": round(wall / 60, 1),
        "tests": len(tests),
        "counts": counts,
        "tests_seconds": round(sum(t["seconds"] for t in tests), 1),
        "slowest": sorted(tests, key=lambda t: -t["seconds"])[:40],
        "load_average_1_5_15_min": {
            "start": [round(x, 2) for x in load_before],
            "end": [round(x, 2) for x in load_after],
        },
        "machine": describe_machine(),
        "memfit": memfit_source(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    out = write_results(Path(args.out), data)
    print(f"{len(tests)} tests in {wall / 60:.1f} min (exit {done.returncode}); wrote {out}")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
