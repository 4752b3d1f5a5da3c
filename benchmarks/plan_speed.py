"""How long `memfit plan` takes: warm (in-process, imports done) and cold (a fresh CLI process).

Goal (per GPU plan, on a 2-core CPU machine): an 8B model in <= 5 s, a 70B model in <= 10 s, in a
process that has planned before; a new `memfit plan llama-3.1-8b --method lora` process in <= 4 s.

Three figures per case:

- warm: ``memfit.plan()`` in this process after a first plan (imports done), with the simulation
  caches (in-process and on disk) cleared before each run: the simulation itself;
- cold, empty cache: ``python -m memfit plan ... --json`` in a new process with an empty plan-cache
  folder: imports plus the simulation, what a first plan costs;
- cold, cached: the same command again, the plan now on disk.

This process and its children use a new, empty temporary ``MEMFIT_CACHE`` folder (the user's cache
is neither read nor written); the CLI is run with this interpreter (``python -m memfit``), so that the
memfit measured is the one this interpreter imports. Results are kept per label (``--label
before``, ``--label after``) side by side in one file, each with the memfit commit it measured.

    python benchmarks/plan_speed.py --label after    # updates benchmarks/results/plan_speed.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Before memfit is imported: this process and its children plan into a folder of their own.
_CACHE_ROOT = tempfile.mkdtemp(prefix="memfit-plan-speed-")
os.environ["MEMFIT_CACHE"] = _CACHE_ROOT
import _memfit_api as api  # noqa: E402
from _machine import describe_machine, memfit_source, write_labeled_run  # noqa: E402

CASES = [
    ("llama-3.1-8b", dict(method="qlora", seq_len=4096, batch_size=2, checkpointing="on")),
    ("llama-3.1-8b", dict(method="lora", seq_len=2048, batch_size=1, checkpointing="off")),
    ("llama-3.1-8b", dict(method="full", seq_len=2048, batch_size=1, checkpointing="on")),
    ("qwen2.5-7b", dict(method="qlora", seq_len=8192, batch_size=1, checkpointing="on")),
    ("llama-3.1-70b", dict(method="qlora", seq_len=4096, batch_size=1, checkpointing="on")),
    ("llama-3.1-70b", dict(method="lora", seq_len=2048, batch_size=1, checkpointing="on")),
    ("qwen2.5-72b", dict(method="qlora", seq_len=2048, batch_size=1, checkpointing="on")),
]
GOALS_S = {"8b": 5.0, "70b": 10.0}
#: The cold-start command with a goal of its own: a LoRA plan of an 8B model in a new process.
COLD_LORA = ("llama-3.1-8b", dict(method="lora"))
COLD_LORA_GOAL_S = 4.0


_FILE_HEADER = {
    "benchmark": "plan_speed",
    "command": "python benchmarks/plan_speed.py --label LABEL",
    "notes": (
        "warm: memfit.plan() in a process that has already planned once (imports done), with the simulation caches "
        "(in-process and on disk) cleared before each run; cold_cli: a new `python -m memfit plan ... --json` "
        "process with an empty plan cache (imports and the simulation); cold_cli_cached: the same command again, "
        "its plan on disk; import_floor: a new process that imports only what a LoRA plan must (the planner, the "
        "model's transformers module, PEFT), run before each cold LoRA process. The machine is shared: timings are "
        "noisy, see load_average_1_5_15_min."
    ),
}


def _cli_args(model: str, knobs: dict) -> list[str]:
    args = [model]
    for key, value in knobs.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    return args


def cold_runs(model: str, knobs: dict, repeats: int) -> tuple[list[float], list[float]]:
    """``repeats`` new `memfit plan` processes, each with an empty cache folder, each followed by
    one with that folder filled: (empty-cache seconds, cached seconds)."""
    empty, cached = [], []
    command = [sys.executable, "-m", "memfit", "plan", *_cli_args(model, knobs), "--json"]
    for _ in range(repeats):
        folder = tempfile.mkdtemp(prefix="memfit-cold-", dir=_CACHE_ROOT)
        env = dict(os.environ, MEMFIT_CACHE=folder)
        try:
            for times in (empty, cached):
                t0 = time.perf_counter()
                subprocess.run(command, check=True, capture_output=True, env=env)
                times.append(time.perf_counter() - t0)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return empty, cached


#: What a LoRA plan of a Llama model must import, and nothing else: the planner, the model's
#: transformers module and PEFT (bitsandbytes kept out, as the planner keeps it out of LoRA plans).
#: A new process doing only this is the floor under a cold `memfit plan ... --method lora`.
IMPORT_FLOOR = (
    "import sys; import memfit.planner.exact.simulate, transformers.models.llama.modeling_llama; "
    "sys.modules['bitsandbytes'] = None; import peft"
)


def floor_seconds() -> float:
    """One new process importing :data:`IMPORT_FLOOR`: seconds."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", IMPORT_FLOOR], check=True, capture_output=True)
    return time.perf_counter() - t0


def _import_seconds(modules: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {modules}"], check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--label", default="after", help="the name these results are kept under in the file (before, after...)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="warm runs per case (the median is reported)")
    parser.add_argument("--cold-repeats", type=int, default=1, help="new processes per case (the median is reported)")
    parser.add_argument("--lora-repeats", type=int, default=3, help="new processes for the cold LoRA command")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "plan_speed.json")
    parser.add_argument(
        "--cold-lora-only",
        action="store_true",
        help="only the cold LoRA command and the import floor, kept under LABEL-cold-lora",
    )
    args = parser.parse_args()
    load_before = os.getloadavg()

    # The cold LoRA command first, while this process holds no memory worth mentioning; each new
    # process beside one that only imports what it must (the floor), so that both see the same load.
    lora_empty, lora_cached, floors = [], [], []
    for _ in range(args.lora_repeats):
        floors.append(floor_seconds())
        empty, cached = cold_runs(*COLD_LORA, 1)
        lora_empty += empty
        lora_cached += cached
    cold_lora = {
        "command": "python -m memfit plan " + " ".join(_cli_args(*COLD_LORA)) + " --json",
        "empty_cache_seconds_median": round(statistics.median(lora_empty), 3),
        "empty_cache_seconds": [round(s, 3) for s in lora_empty],
        "cached_seconds_median": round(statistics.median(lora_cached), 3),
        "cached_seconds": [round(s, 3) for s in lora_cached],
        "goal_seconds": COLD_LORA_GOAL_S,
        "empty_cache_meets_goal": statistics.median(lora_empty) <= COLD_LORA_GOAL_S,
        "import_floor": IMPORT_FLOOR,
        "import_floor_seconds_median": round(statistics.median(floors), 3),
        "import_floor_seconds": [round(s, 3) for s in floors],
        "empty_cache_over_floor_seconds": round(statistics.median(lora_empty) - statistics.median(floors), 3),
    }
    print(
        f"cold `{cold_lora['command']}`: empty cache {cold_lora['empty_cache_seconds_median']:.2f} s, "
        f"cached {cold_lora['cached_seconds_median']:.2f} s, import floor {cold_lora['import_floor_seconds_median']:.2f} s",
        flush=True,
    )
    if args.cold_lora_only:
        write_labeled_run(
            args.out,
            args.label + "-cold-lora",
            {
                "memfit": memfit_source(),
                "machine": describe_machine(),
                "load_average_1_5_15_min": {
                    "start": [round(x, 2) for x in load_before],
                    "end": [round(x, 2) for x in os.getloadavg()],
                },
                "cold_lora": cold_lora,
            },
            _FILE_HEADER,
        )
        shutil.rmtree(_CACHE_ROOT, ignore_errors=True)
        return

    started = time.perf_counter()
    import memfit

    memfit.plan("smollm2-135m", seq_len=128)  # pays the one-time imports and first-dispatch costs
    warmup_s = time.perf_counter() - started

    cases = []
    for model, knobs in CASES:
        warm = []
        for _ in range(args.repeats):
            api.clear_plan_cache()  # time the simulation, not the cache
            t0 = time.perf_counter()
            plan = memfit.plan(model, **knobs)
            warm.append(time.perf_counter() - t0)
        empty, cached = cold_runs(model, knobs, args.cold_repeats)
        size = "70b" if "70b" in model or "72b" in model else "8b"
        row = {
            "model": model,
            "knobs": knobs,
            "warm_seconds_median": round(statistics.median(warm), 3),
            "warm_seconds": [round(w, 3) for w in warm],
            "cold_cli_seconds": round(statistics.median(empty), 3),
            "cold_cli_cached_seconds": round(statistics.median(cached), 3),
            "goal_seconds": GOALS_S[size],
            "warm_meets_goal": statistics.median(warm) <= GOALS_S[size],
            "cold_meets_goal": statistics.median(empty) <= GOALS_S[size],
            "simulated_layers": plan.details["simulated_layers"],
            "device_total_bytes": plan.device_total_bytes,
        }
        cases.append(row)
        print(
            f"{model:16s} {knobs['method']:6s} warm {row['warm_seconds_median']:6.2f} s   cold CLI {row['cold_cli_seconds']:6.2f} s"
            f"   cold CLI, cached {row['cold_cli_cached_seconds']:6.2f} s",
            flush=True,
        )

    planner = api.planner_module_name()
    run = {
        "memfit": memfit_source(),
        "machine": describe_machine(),
        "load_average_1_5_15_min": {
            "start": [round(x, 2) for x in load_before],
            "end": [round(x, 2) for x in os.getloadavg()],
        },
        "first_plan_in_process_seconds": round(warmup_s, 3),
        # What importing costs a new process: the planner's own imports (what every plan needs), and
        # with PEFT and bitsandbytes (what a QLoRA plan needs) on top.
        "imports_seconds": {
            planner: round(_import_seconds(planner), 3),
            f"{planner}, peft, bitsandbytes": round(_import_seconds(f"{planner}, peft, bitsandbytes"), 3),
        },
        "cold_lora": cold_lora,
        "cases": cases,
    }
    out = write_labeled_run(args.out, args.label, run, _FILE_HEADER)
    shutil.rmtree(_CACHE_ROOT, ignore_errors=True)
    print(f"wrote {args.out} (runs: {', '.join(out['runs'])})")


if __name__ == "__main__":
    main()
