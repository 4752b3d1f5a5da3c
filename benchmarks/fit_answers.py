"""What `memfit fit` answers for the fit_speed cases, to show that a change to the search leaves
its answers as they were.

Each case runs :func:`memfit.fit` in this process (one worker, so that the plans
each method's search makes can be counted) and writes down everything it answers: every fit (its
spec and its whole plan, the time it took left out), the faster settings that do not fit and by
how much, the longest sequence of each method and its spec. The number of plans each method's
search made is recorded too; it is what a faster search changes, and it is not compared.

    python benchmarks/fit_answers.py                 # writes benchmarks/results/fit_answers.json
    python benchmarks/fit_answers.py --check         # compares with that file; exit 1 on a difference
    python benchmarks/fit_answers.py --check --twice # each case again, its plans from the on-disk cache

The plan cache is a new, empty temporary folder (``MEMFIT_CACHE``): the user's is not touched.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
_CACHE_ROOT = tempfile.mkdtemp(prefix="memfit-fit-answers-")
os.environ["MEMFIT_CACHE"] = _CACHE_ROOT  # before memfit is imported
import _memfit_api as api  # noqa: E402
from _machine import memfit_source  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "fit_answers.json"

#: fit_speed's cases, as fit() arguments.
CASES: list[tuple[str, dict]] = [
    ("llama-3.1-8b", dict(gpu="rtx-4090")),
    ("llama-3.1-8b", dict(gpu="a100-80gb")),
    ("qwen2.5-7b", dict(budget="40GiB", seq_len=8192)),
]


def _plan_json(plan) -> dict:
    data = plan.to_dict()
    data["details"].pop("plan_seconds", None)
    return data


def fit_answer(model: str, options: dict) -> tuple[dict, dict[str, int], float]:
    """(everything the search answered, plans made per method, seconds)."""
    counts: Counter = Counter()

    def progress(message: str) -> None:
        counts[message.split(" ", 1)[0]] += 1  # each plan's description starts with its method

    started = time.perf_counter()
    result = api.fit(model, workers=1, progress=progress, **options)
    seconds = time.perf_counter() - started
    answer = {
        "model": model,
        "options": options,
        "fits": [
            {"spec": f.spec, "relative_speed": round(f.relative_speed, 6), "plan": _plan_json(f.plan)}
            for f in result.fits
        ],
        "not_fitting": [
            {"spec": m.spec, "device_total_bytes": m.device_total_bytes, "over_bytes": m.over_bytes}
            for m in result.misses
        ],
        "max_seq_len": result.max_seq_len,
        "max_seq_len_specs": result.max_seq_len_specs,
        "notes": result.notes,
    }
    return answer, dict(counts), seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the results file instead of writing it")
    parser.add_argument(
        "--twice", action="store_true", help="run each case a second time (its plans then come from the cache)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    expected = {}
    if args.check:
        expected = {
            json.dumps([c["model"], c["options"]], sort_keys=True): c for c in json.loads(args.out.read_text())["cases"]
        }
    rows, differences = [], 0
    for model, options in CASES:
        for attempt in range(2 if args.twice else 1):
            answer, counts, seconds = fit_answer(model, options)
            label = f"{model} {options}" + (" (again, from the cache)" if attempt else "")
            print(f"{label}: {seconds:.1f} s, plans per method {counts}", flush=True)
            if not args.check:
                rows.append({**answer, "plans_per_method": counts, "seconds": round(seconds, 1)})
                break
            old = expected.get(json.dumps([model, options], sort_keys=True))
            if old is None:
                print(f"  not in {args.out.name}")
                differences += 1
                continue
            print(f"  plans per method: {old['plans_per_method']} before, {counts} now")
            changed = sorted(key for key in answer if answer[key] != old.get(key))
            if changed:
                differences += 1
                for key in changed:
                    print(
                        f"  DIFFERENT {key}:\n    before {json.dumps(old.get(key))[:2000]}\n    now    {json.dumps(answer[key])[:2000]}"
                    )
    shutil.rmtree(_CACHE_ROOT, ignore_errors=True)
    if not args.check:
        payload = {
            "benchmark": "fit_answers",
            "command": "python benchmarks/fit_answers.py",
            "memfit": memfit_source(),
            "cases": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.out}")
        return 0
    runs = len(CASES) * (2 if args.twice else 1)
    print(f"{runs - differences} of {runs} fit answers unchanged")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
