"""How fast `memfit ui` answers: HTTP requests against a started server, cold and warm, with and without the plan cache.

Starts the real server (``python -m memfit ui --port 0`` with this interpreter) and times, from
this process, over HTTP:

- how long until the page is up (the address printed, ``GET /`` answered) and until the server's
  planner imports are done (``/api/status`` says warm);
- ``/api/plan``: the first request (the page's default, smollm2-135m), then new configurations
  (another length, an 8B model on an RTX 4090, and another length of it), each asked twice: the
  second time is the same plan again;
- ``/api/fit`` for the default search, ``memfit fit llama-3.1-8b --gpu rtx-4090`` (batch 8): the
  first row and the whole result, then (plan cache on) the same search again.

Once with the plan cache on (a private, empty MEMFIT_CACHE folder: the first search fills it),
once with it off (MEMFIT_PLAN_CACHE=0: every plan is made; the server's in-process caches still
help a plan asked for again). The goals: a plan within 1.5 s after the first request, the default
search within 20 s. The machine is shared: the load average is recorded with the figures.

    python benchmarks/ui_speed.py          # writes benchmarks/results/ui_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PLAN_GOAL_SECONDS = 1.5
FIT_GOAL_SECONDS = 20.0

PLANS = [
    ("first request: smollm2-135m (the page's default)", "model=smollm2-135m"),
    ("smollm2-135m, seq_len 1024", "model=smollm2-135m&seq_len=1024"),
    ("smollm2-135m, seq_len 1024, again", "model=smollm2-135m&seq_len=1024"),
    ("llama-3.1-8b on rtx-4090", "model=llama-3.1-8b&gpu=rtx-4090"),
    ("llama-3.1-8b on rtx-4090, again", "model=llama-3.1-8b&gpu=rtx-4090"),
    ("llama-3.1-8b on rtx-4090, seq_len 4096, qlora", "model=llama-3.1-8b&gpu=rtx-4090&seq_len=4096&method=qlora"),
    (
        "llama-3.1-8b on rtx-4090, seq_len 4096, qlora, again",
        "model=llama-3.1-8b&gpu=rtx-4090&seq_len=4096&method=qlora",
    ),
]
FIT = "model=llama-3.1-8b&gpu=rtx-4090"


def timed_get(url: str) -> tuple[float, int, bytes]:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=3600) as answer:
        body = answer.read()
        return time.perf_counter() - started, answer.status, body


def timed_fit(url: str) -> dict:
    """The search's stream: seconds to the first row, to the result, and what it found."""
    started = time.perf_counter()
    first_row = None
    with urllib.request.urlopen(url, timeout=3600) as answer:
        for line in answer:
            event = json.loads(line)
            if event["event"] == "found" and event["fits"] and first_row is None:
                first_row = time.perf_counter() - started
            if event["event"] in ("result", "error"):
                break
    total = time.perf_counter() - started
    result = event.get("result") or {}
    return {
        "first_row_seconds": round(first_row, 2) if first_row else None,
        "seconds": round(total, 2),
        "event": event["event"],
        "fits": len(result.get("fits", [])),
        "plans_made": (result.get("details") or {}).get("plans_made"),
        "meets_goal": total <= FIT_GOAL_SECONDS,
    }


def measure(cache_on: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="memfit-ui-speed-") as cache:
        env = {**os.environ, "MEMFIT_CACHE": cache, "MEMFIT_PLAN_CACHE": "1" if cache_on else "0"}
        started = time.perf_counter()
        server = subprocess.Popen(
            [sys.executable, "-m", "memfit", "ui", "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            base = server.stdout.readline().split()[2]
            address_s = time.perf_counter() - started
            timed_get(base)
            page_s = time.perf_counter() - started
            while not json.loads(timed_get(base + "api/status")[2])["warm"]:
                time.sleep(0.2)
            warm_s = time.perf_counter() - started
            plans = []
            for what, query in PLANS:
                seconds, status, _ = timed_get(f"{base}api/plan?{query}")
                plans.append(
                    {
                        "request": what,
                        "query": query,
                        "status": status,
                        "seconds": round(seconds, 2),
                        "meets_goal": seconds <= PLAN_GOAL_SECONDS,
                    }
                )
                print(f"  plan: {what}: {seconds:.2f} s", flush=True)
            fits = []
            # Without the plan cache a second search makes every plan again: one is timed.
            for what in ("first search", "the same search again")[: 2 if cache_on else 1]:
                fits.append({"request": what, "query": FIT, **timed_fit(f"{base}api/fit?{FIT}")})
                print(f"  fit: {what}: {fits[-1]}", flush=True)
        finally:
            server.terminate()
            server.communicate(timeout=120)
    return {
        "plan_cache": cache_on,
        "address_printed_seconds": round(address_s, 2),
        "page_served_seconds": round(page_s, 2),
        "planner_warm_seconds": round(warm_s, 2),
        "plans": plans,
        "fits": fits,
    }


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _machine import describe_machine, memfit_source, write_labeled_run

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="after")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "ui_speed.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    runs = []
    for cache_on in (True, False):
        print(f"plan cache {'on' if cache_on else 'off'}:", flush=True)
        runs.append(measure(cache_on))
    run = {
        "memfit": memfit_source(),
        "machine": describe_machine(),
        "load_average_1_5_15_min": {
            "start": [round(x, 2) for x in load_before],
            "end": [round(x, 2) for x in os.getloadavg()],
        },
        "servers": runs,
    }
    write_labeled_run(
        args.out,
        args.label,
        run,
        {
            "benchmark": "ui_speed",
            "command": "python benchmarks/ui_speed.py",
            "goal_plan_seconds_after_first_request": PLAN_GOAL_SECONDS,
            "goal_default_fit_seconds": FIT_GOAL_SECONDS,
            "notes": (
                "HTTP requests from this process against `python -m memfit ui --port 0`; seconds are wall time of the "
                "whole answer. Plan cache on: a private folder, empty when the server starts. The machine is shared "
                "by several processes: see load_average_1_5_15_min."
            ),
        },
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
