"""``memfit report``: one self-contained HTML page (charts inlined as PNG data URIs) and the PNGs.

Charts: memory over steps per CUDA device (allocated, reserved, peak; the plan's peak as a
horizontal line) and for the host (RSS), the loss curve from ``metrics.jsonl``, and the plan's
categories next to the measured ones. matplotlib is imported inside :func:`write_report`.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

from memfit.errors import UserError
from memfit.files import check_file_writable, write_atomic
from memfit.units import format_bytes
from memfit.watch.detectors import HOST, series
from memfit.watch.doctor import Diagnosis, diagnose
from memfit.watch.thresholds import Thresholds
from memfit.watch.timeline import loss_curve

#: Marks a file as written by this module: an existing ``out`` without it is never replaced.
GENERATOR = "memfit report"
REPORT_FILE = "report.html"


class ReportError(UserError, ValueError):
    """The report cannot be written (missing matplotlib, an output path that holds another file)."""


def write_report(run_dir: str | Path, out: str | Path | None = None, thresholds: Thresholds = Thresholds()) -> Path:
    """Write the HTML report of ``run_dir`` to ``out`` (default ``<run_dir>/report.html``) and each
    chart as a PNG beside it (``<stem>-<chart>.png``); return the HTML path.

    Every file is written to a temporary name and renamed into place. An existing ``out`` (or chart
    PNG) is replaced only if an earlier ``memfit report`` wrote it. The paths are checked before the
    charts are drawn.
    """
    diagnosis = diagnose(run_dir, thresholds)  # validates the run folder first
    out = Path(out) if out is not None else diagnosis.run.path / REPORT_FILE
    check_report_path(out)
    charts = render_charts(diagnosis)
    ours = out.exists()  # checked above: an earlier report's page, so its charts beside it are ours too
    for name, _ in charts:
        png = _chart_path(out, name)
        if png.exists() and not _written_by_report(png, companion=ours):
            raise ReportError(f"--out: {str(png)!r} (a chart of the report) already exists and was not written by memfit "
                              "report; choose another --out (memfit never overwrites other files)")
    for name, png in charts:
        write_atomic(_chart_path(out, name), png)
    write_atomic(out, render_html(diagnosis, charts).encode("utf-8"))
    return out


def check_report_path(out: Path) -> None:
    """Raise :class:`ReportError` (or :class:`~memfit.errors.PathError`) unless the report can be
    written at ``out``: not a folder, not a file someone else wrote, in a folder that exists and may
    be written."""
    if out.is_dir():
        raise ReportError(f"--out: {str(out)!r} is a folder; pass the HTML file to write (e.g. {str(out / REPORT_FILE)!r})")
    if out.exists() and not _written_by_report(out):
        raise ReportError(
            f"--out: {str(out)!r} already exists and was not written by memfit report; choose another path "
            "(memfit never overwrites other files)"
        )
    if not out.parent.is_dir():
        raise ReportError(f"--out: the folder {str(out.parent)!r} does not exist; create it or choose another path")
    check_file_writable(out, "--out")


def _chart_path(out: Path, name: str) -> Path:
    return out.with_name(f"{out.stem}-{name}.png")


def _written_by_report(path: Path, companion: bool = False) -> bool:
    """Whether ``path`` carries memfit report's mark (the page's generator tag, a chart's Software
    field). ``companion``: a chart beside a page of ours, drawn before charts were marked, counts too."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(4096)
    except OSError:
        return False
    return GENERATOR.encode() in head or (companion and path.suffix == ".png" and b"matplotlib" in head.lower())


# ------------------------------------------------------------------------------------------------
# Charts


def render_charts(diagnosis: Diagnosis) -> list[tuple[str, bytes]]:
    """(name, PNG bytes) for every chart the run has data for."""
    try:
        import matplotlib
    except ImportError:
        raise ReportError("memfit report draws its charts with matplotlib, which is not installed: pip install matplotlib") from None
    matplotlib.use("Agg", force=True)  # files only, no display
    from matplotlib.figure import Figure

    timeline = diagnosis.run.timeline
    plan = diagnosis.run.plan
    charts = []
    for name in timeline.device_names():
        charts.append((f"memory-{name.replace(':', '')}", _device_chart(Figure, timeline, name, plan, diagnosis.findings)))
    if series(timeline, HOST):
        charts.append(("memory-host", _host_chart(Figure, timeline, diagnosis.findings)))
    losses = loss_curve(diagnosis.run.metrics)
    if losses:
        charts.append(("loss", _loss_chart(Figure, losses)))
    # Only categories measured on both sides are drawn (the table lists all): on a CPU run the
    # CUDA context alone would dwarf every bar.
    compared = [r for r in diagnosis.comparison if r.measured_bytes is not None and r.predicted_bytes is not None]
    if compared:
        charts.append(("categories", _categories_chart(Figure, compared)))
    return charts


def _unit(max_bytes: float) -> tuple[float, str]:
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if max_bytes >= scale:
            return scale, unit
    return 1, "B"


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight", metadata={"Software": GENERATOR})
    return buffer.getvalue()


def _leak_steps(findings, where: str) -> list[int]:
    return [f.step for f in findings if f.code == "leak" and f.step is not None and f.data.get("device") == where]


def _device_chart(Figure, timeline, name: str, plan: dict[str, Any] | None, findings) -> bytes:
    lines: dict[str, list[tuple[int, int]]] = {}
    for record in timeline.steps:
        entry = record.get("devices", {}).get(name)
        if not entry:
            continue
        for key, label in (("allocated_bytes", "allocated after step"), ("reserved_bytes", "reserved"),
                           ("peak_allocated_bytes", "peak allocated (so far)"), ("nvml_used_bytes", "device used (NVML)")):
            if key in entry:
                lines.setdefault(label, []).append((record["step"], entry[key]))
    planned = None
    if plan and name in timeline.expected_devices:
        planned = (plan.get("peak") or {}).get("allocated_bytes")
    top = max([v for pts in lines.values() for _, v in pts] + [planned or 0, 1])
    scale, unit = _unit(top)
    fig = Figure(figsize=(9, 3.6))
    ax = fig.subplots()
    for label, pts in lines.items():
        ax.plot([s for s, _ in pts], [v / scale for _, v in pts], label=label, linewidth=1.4)
    if planned:
        ax.axhline(planned / scale, color="crimson", linestyle="--", linewidth=1.2, label=f"planned peak allocated ({format_bytes(planned)})")
    for step in _leak_steps(findings, name):
        ax.axvline(step, color="crimson", linestyle=":", linewidth=1, label=f"climb detected from step {step}")
    ax.set_title(f"{name} memory" + ("" if name in timeline.expected_devices or not timeline.expected_devices else " (not a device this run should use)"))
    ax.set_xlabel("step")
    ax.set_ylabel(unit)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return _png(fig)


def _host_chart(Figure, timeline, findings) -> bytes:
    points = series(timeline, HOST)
    heap = series(timeline, HOST, "heap_bytes")
    scale, unit = _unit(max(p.value for p in points))
    fig = Figure(figsize=(9, 3.2))
    ax = fig.subplots()
    ax.plot([p.step for p in points], [p.value / scale for p in points], color="tab:purple", linewidth=1.4, label="process RSS after step")
    if heap:
        ax.plot([p.step for p in heap], [p.value / scale for p in heap], color="tab:brown", linewidth=1.2, label="malloc heap in use")
    for step in _leak_steps(findings, HOST):
        ax.axvline(step, color="crimson", linestyle=":", linewidth=1, label=f"climb detected from step {step}")
    ax.set_title("host memory of the training process")
    ax.set_xlabel("step")
    ax.set_ylabel(unit)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return _png(fig)


def _loss_chart(Figure, losses: list[tuple[int, float]]) -> bytes:
    fig = Figure(figsize=(9, 3.0))
    ax = fig.subplots()
    ax.plot([s for s, _ in losses], [v for _, v in losses], color="tab:green", linewidth=1.4)
    ax.set_title("training loss (metrics.jsonl)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    return _png(fig)


def _categories_chart(Figure, rows) -> bytes:
    top = max([r.predicted_bytes for r in rows] + [r.measured_bytes for r in rows] + [1])
    scale, unit = _unit(top)
    fig = Figure(figsize=(9, 0.45 * len(rows) + 1.2))
    ax = fig.subplots()
    y = list(range(len(rows)))
    ax.barh([i - 0.2 for i in y], [r.predicted_bytes / scale for r in rows], height=0.4, label="plan", color="tab:blue")
    ax.barh([i + 0.2 for i in y], [r.measured_bytes / scale for r in rows], height=0.4, label="measured", color="tab:orange")
    ax.set_yticks(y, [r.name for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title("plan vs measured, by category (at the step's peak)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return _png(fig)


# ------------------------------------------------------------------------------------------------
# HTML


_CSS = """
body { font-family: system-ui, -apple-system, Segoe UI, sans-serif; margin: 2rem auto; max-width: 980px; color: #222; }
h1 { font-size: 1.5rem; } h2 { font-size: 1.15rem; margin-top: 2rem; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: .5rem 0; } td, th { padding: .25rem .7rem; border-bottom: 1px solid #eee; text-align: left; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
.finding { border-left: 4px solid #999; padding: .4rem .8rem; margin: .6rem 0; background: #fafafa; }
.error { border-color: #c62828; } .warning { border-color: #ef6c00; } .info { border-color: #1565c0; }
.sev { font-weight: bold; text-transform: uppercase; font-size: .8rem; } .fix { color: #2e7d32; }
img { max-width: 100%; display: block; margin: .5rem 0; } .ok { color: #2e7d32; font-weight: bold; }
"""


def render_html(diagnosis: Diagnosis, charts: list[tuple[str, bytes]]) -> str:
    """The page: facts, findings, charts (inlined), and the predicted-vs-measured table."""
    e = html.escape
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f'<meta name="generator" content="{GENERATOR}">',
        f"<title>memfit report: {e(diagnosis.run.path.name)}</title><style>{_CSS}</style></head><body>",
        f"<h1>memfit report: {e(diagnosis.run.path.name)}</h1>",
        "<table>" + "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in diagnosis.facts) + "</table>",
        "<h2>Findings</h2>",
    ]
    if not diagnosis.findings:
        parts.append('<p class="ok">No memory problems found.</p>')
    for f in diagnosis.findings:
        where = f" (step {f.step})" if f.step is not None else ""
        parts.append(
            f'<div class="finding {e(f.severity)}"><span class="sev">{e(f.severity)}</span> <b>{e(f.code)}</b>{e(where)}: '
            f'{e(f.message)}<br><span class="fix">fix: {e(f.fix)}</span></div>'
        )
    titles = {"loss": "Loss", "categories": "Plan vs measured"}
    parts.append("<h2>Charts</h2>")
    for name, png in charts:
        alt = titles.get(name, name.replace("memory-", "memory: "))
        data = base64.b64encode(png).decode("ascii")
        parts.append(f'<img alt="{e(alt)}" src="data:image/png;base64,{data}">')
    if diagnosis.comparison:
        parts.append("<h2>Plan vs measured</h2><table><tr><th>category</th><th class=num>plan</th><th class=num>measured</th><th class=num>measured / plan</th></tr>")
        for r in diagnosis.comparison:
            plan_text = format_bytes(r.predicted_bytes) if r.predicted_bytes is not None else "-"
            measured = format_bytes(r.measured_bytes) if r.measured_bytes is not None else "not measured"
            ratio = f"{r.ratio:.2f}" if r.ratio is not None else "-"
            parts.append(f"<tr><td>{e(r.name)}</td><td class=num>{e(plan_text)}</td><td class=num>{e(measured)}</td><td class=num>{ratio}</td></tr>")
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


