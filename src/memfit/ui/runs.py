"""A run's measured memory next to its plan, for the page: from files dropped on it or a run folder.

The page never names a folder on the server: a run reaches it either as its ``memory.jsonl`` (and
``run.json``) dropped on the page, read as data, size-limited, or as the folder given to
``memfit ui --run RUN_DIR`` on the command line by the person who started the server. Both are
read by the readers ``memfit report`` uses (:mod:`memfit.watch.timeline`) and compared by
:mod:`memfit.watch.compare`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memfit.ui.dropped_files import decode_text
from memfit.ui.uploads import UploadError, check_size, read_json_object


def _rows(rows) -> list[dict[str, Any]]:
    return [
        {"name": r.name, "predicted_bytes": r.predicted_bytes, "measured_bytes": r.measured_bytes, "ratio": r.ratio}
        for r in rows
    ]


def comparison(
    timeline, run: dict[str, Any] | None, source: str, fallback_plan: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Predicted against measured for a parsed run: categories, the three peaks, and step by step.

    The plan is the run's own (its start record or ``run.json``); without one, ``fallback_plan``
    (the plan on the page) stands in, and the answer says so. A CPU run is shown as ``memfit
    report`` shows it: its measured categories alone, and ``note`` says why.
    """
    from memfit.watch.compare import compare_categories, compare_peaks, measured_peak_allocated, run_device

    plan = timeline.plan or (run or {}).get("plan")
    plan_source = "the run's own plan" if plan else None
    if plan is None and fallback_plan:
        plan, plan_source = fallback_plan, "the plan on the page (the run has none)"
    device = run_device(timeline)
    reason = None
    if not any("cuda" in d for d in timeline.expected_devices):
        # As memfit report shows a CPU run: measured only. Next to a plan of GPU memory, the CPU's
        # temporaries and its missing allocator reserve and CUDA context would read as misses.
        plan, plan_source = None, None
        steps_measured = (timeline.attribution or {}).get("steps", "?")
        reason = (
            f"a CPU run: the plan is of GPU memory, so the categories are what the tensors of the first "
            f"{steps_measured} steps held on the CPU (the planner's tracker on the real tensors); a GPU would "
            "hold the same tensors, plus its allocator's reserve and the CUDA context"
        )
    steps = []
    for record in timeline.steps:
        reading = (record.get("devices") or {}).get(device, {}) if device else {}
        steps.append(
            {
                "step": record.get("step"),
                "peak_allocated_bytes": reading.get("peak_allocated_bytes"),
                "peak_reserved_bytes": reading.get("peak_reserved_bytes"),
                "device_total_bytes": reading.get("process_bytes"),
                "rss_bytes": record.get("rss_bytes"),
            }
        )
    peak, peak_source = measured_peak_allocated(timeline)
    return {
        "source": source,
        "device": device,
        "plan": plan,
        "plan_source": plan_source,
        "categories": _rows(compare_categories(plan, timeline)),
        "peaks": _rows(compare_peaks(plan, timeline)),
        "measured_peak_allocated_bytes": peak,
        "measured_peak_source": peak_source,
        "steps": steps,
        "findings": [f.to_dict() for f in timeline.findings],
        "note": reason,
    }


def from_uploads(
    memory: bytes,
    run_json: bytes | None,
    fallback_plan: dict[str, Any] | None = None,
    memory_name: str = "memory.jsonl",
    run_name: str = "run.json",
) -> dict[str, Any]:
    """:func:`comparison` for a dropped ``memory.jsonl`` (and ``run.json``), read as data."""
    from memfit.watch.timeline import TimelineError, parse_timeline

    check_size(memory, memory_name)
    text = decode_text(memory, memory_name, "the memory.jsonl a run wrote")
    try:
        timeline = parse_timeline(text.splitlines(), source=memory_name)
    except TimelineError as err:
        raise UploadError(str(err)) from None
    run = None
    if run_json is not None:
        check_size(run_json, run_name)
        run = read_json_object(run_json, run_name)
        timeline.start.setdefault("expected_devices", [])
        if not timeline.start.get("expected_devices") and run.get("device"):
            timeline.start["expected_devices"] = [str(run["device"])]
    return comparison(timeline, run, memory_name, fallback_plan)


def from_folder(run_dir: str | Path, fallback_plan: dict[str, Any] | None = None) -> dict[str, Any]:
    """:func:`comparison` for a run folder named on the command line (``memfit ui --run``)."""
    from memfit.watch.timeline import load_run

    folder = load_run(run_dir)
    return comparison(folder.timeline, folder.run, str(folder.path), fallback_plan)


def check_run_folder(run_dir: str | Path) -> Path:
    """``--run``'s folder, read once before the server starts: a bad folder is one line, exit 2."""
    from_folder(run_dir)
    return Path(run_dir).resolve()
