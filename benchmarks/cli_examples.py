"""What memfit's commands print for the examples README.md and docs/ show, recorded as they ran.

Each example runs the real command line (``python -m memfit ...`` with this interpreter and this
checkout's memfit) in a fresh process, in an empty temporary folder, offline, with the plan cache
off and 100 columns, and its output is written to benchmarks/results/cli_examples.json with the
memfit commit, the machine and the load. The docs show that output through benchmarks/figures.py
(the ``plan-example`` block) and quote the demo run's figures from it.

    python benchmarks/cli_examples.py              # every example
    python benchmarks/cli_examples.py --only plan  # one of them (the others keep their record)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results" / "cli_examples.json"
sys.path.insert(0, str(BENCH))
from _machine import describe_machine, memfit_source, write_results  # noqa: E402

#: name -> the command's arguments ({run}: an output folder in the temporary working folder).
EXAMPLES = {
    "plan": [
        "plan",
        "llama-3.1-8b",
        "--method",
        "qlora",
        "--seq-len",
        "4096",
        "--batch-size",
        "2",
        "--checkpointing",
        "on",
        "--gpu",
        "rtx-4090",
    ],
    "plan-dpo": [
        "plan",
        "llama-3.1-8b",
        "--method",
        "qlora",
        "--objective",
        "dpo",
        "--seq-len",
        "2048",
        "--gpu",
        "rtx-4090",
    ],
    "train-demo": ["train", str(REPO / "examples" / "tiny.yaml"), "--output-dir", "{run}", "--no-progress"],
    "train-fit": [
        "train",
        str(REPO / "examples" / "tiny.yaml"),
        "--fit",
        "--budget",
        "600MiB",
        "--max-steps",
        "2",
        "--output-dir",
        "{run}",
        "--no-progress",
    ],
}


_DONE = re.compile(
    r"^done: (?P<steps>\d+) steps, loss (?P<first>[\d.]+) -> (?P<last>[\d.]+)(?:, eval loss (?P<eval>[\d.]+))?", re.M
)


def run_summary(run: Path, output: str) -> dict:
    """What a finished run says: steps, epochs (run.json), the first and last training loss and the
    last evaluation loss (its ``done:`` line, as the user reads them), and the seconds of the
    training loop (metrics.jsonl)."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [m for m in lines if "loss" in m and "eval_loss" not in m]
    config = json.loads((run / "run.json").read_text()).get("config", {})
    return {
        "epochs": config.get("epochs"),
        "loop_seconds": steps[-1].get("elapsed_s") if steps else None,
        **done_line(output),
    }


def done_line(output: str) -> dict:
    """The figures of a run's ``done: N steps, loss A -> B, eval loss C`` line (empty without one)."""
    match = _DONE.search(output)
    if match is None:
        return {}
    return {
        "steps": int(match["steps"]),
        "first_loss": float(match["first"]),
        "last_loss": float(match["last"]),
        "eval_loss": float(match["eval"]) if match["eval"] else None,
    }


def run_example(args: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="memfit-cli-example-") as cwd:
        run = Path(cwd) / "run"
        argv = [a.format(run=run) for a in args]
        env = dict(
            os.environ,
            HF_HUB_OFFLINE="1",
            MEMFIT_PLAN_CACHE="0",
            COLUMNS="100",
            NO_COLOR="1",
            TERM="dumb",
            PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
        )
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "memfit", *argv], cwd=cwd, env=env, capture_output=True, text=True)
        record = {
            "command": "memfit "
            + " ".join(a.replace(str(REPO) + "/", "") if a != str(run) else "runs/tiny" for a in argv),
            "exit_code": done.returncode,
            "stdout": done.stdout,
            "stderr": done.stderr[-4000:],
            "wall_seconds": round(time.perf_counter() - started, 1),
        }
        if (run / "metrics.jsonl").is_file():
            record["run"] = run_summary(run, done.stdout + done.stderr)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=sorted(EXAMPLES), help="run only this example (repeatable)")
    args = parser.parse_args(argv)
    data = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    data.update(benchmark="cli_examples", command="python benchmarks/cli_examples.py")
    examples = data.setdefault("examples", {})
    failed = False
    for name in args.only or list(EXAMPLES):
        load = os.getloadavg()
        record = run_example(EXAMPLES[name])
        record.update(
            memfit=memfit_source(),
            machine=describe_machine(),
            load_average_1_5_15_min=[round(x, 2) for x in load],
            measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        )
        examples[name] = record
        failed |= record["exit_code"] != 0
        print(f"{name}: exit {record['exit_code']}, {record['wall_seconds']} s")
    write_results(RESULTS, data)
    print(f"wrote {RESULTS.relative_to(REPO)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
