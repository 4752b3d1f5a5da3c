"""``memfit report``: one self-contained HTML page (charts inlined as PNG data URIs) and the PNGs.

The page, top to bottom: what the run was (steps, devices, peaks), its configuration, the findings
with their fixes, training (loss and eval loss, the end-of-run figures, a preference run's rewards in
training and evaluation, learning rate), memory over steps per CUDA device
and for the host, and the plan against the measured peaks by category, or one line saying why not.
Every section holds something or says in one line why it is empty; no chart is drawn without data.
The charts are :mod:`memfit.watch.charts` (matplotlib, imported when they are drawn).
"""

from __future__ import annotations

import base64
import html
import math
from dataclasses import dataclass, field
from pathlib import Path

from memfit.errors import UserError
from memfit.files import check_file_writable, check_not_an_input, write_atomic
from memfit.run_files import METRICS_FILE, RUN_FILE
from memfit.units import format_bytes
from memfit.watch.charts import EVAL_REWARD_METRICS, GENERATOR, REWARD_METRICS, chart_title, render_charts
from memfit.watch.compare import CategoryRow, compare_categories, compare_peaks, run_device
from memfit.watch.doctor import Diagnosis, diagnose
from memfit.watch.run_config import NO_CONFIGURATION, configuration_rows
from memfit.watch.thresholds import Thresholds
from memfit.watch.timeline import metric_curve

REPORT_FILE = "report.html"


class ReportError(UserError, ValueError):
    """The report cannot be written (an output path that is a folder, or holds another file)."""


def write_report(run_dir: str | Path, out: str | Path | None = None, thresholds: Thresholds = Thresholds()) -> Path:
    """Write the HTML report of ``run_dir`` to ``out`` (default ``<run_dir>/report.html``) and each
    chart as a PNG beside it (``<stem>-<chart>.png``); return the HTML path.

    Every file is written to a temporary name and renamed into place. An existing ``out`` (or chart
    PNG) is replaced only if an earlier ``memfit report`` wrote it. The paths are checked before the
    charts are drawn.
    """
    diagnosis = diagnose(run_dir, thresholds)  # validates the run folder first
    out = Path(out) if out is not None else diagnosis.run.path / REPORT_FILE
    check_not_an_input(out, "--out", run_inputs(diagnosis.run.path))
    check_report_path(out)
    section = plan_section(diagnosis)
    charts = render_charts(diagnosis, plan_compared=section.compared)
    ours = out.exists()  # checked above: an earlier report's page, so its charts beside it are ours too
    for name, _ in charts:
        png = _chart_path(out, name)
        if png.exists() and not _written_by_report(png, companion=ours):
            raise ReportError(
                f"--out: {str(png)!r} (a chart of the report) already exists and was not written by memfit "
                "report; choose another --out (memfit never overwrites other files)"
            )
    for name, png in charts:
        write_atomic(_chart_path(out, name), png)
    write_atomic(out, render_html(diagnosis, charts, section).encode("utf-8"))
    return out


def run_inputs(run_dir: Path) -> dict[str, Path]:
    """The files of ``run_dir`` a report is drawn from (what each is -> its path): never its output."""
    names = [RUN_FILE, METRICS_FILE, *sorted(p.name for p in run_dir.glob("memory*.jsonl"))]
    return {f"run's {name}": run_dir / name for name in names}


def check_report_path(out: Path) -> None:
    """Raise :class:`ReportError` (or :class:`~memfit.errors.PathError`) unless the report can be
    written at ``out``: not a folder, not a file someone else wrote, in a folder that exists and may
    be written."""
    if out.is_dir():
        raise ReportError(
            f"--out: {str(out)!r} is a folder; pass the HTML file to write (e.g. {str(out / REPORT_FILE)!r})"
        )
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
# Plan vs measured


@dataclass
class PlanSection:
    """What the page's plan-vs-measured section shows: the peaks and categories side by side, the
    line that says why they are not compared (a CPU run, no plan), a note on what was measured, and
    whether plan and measurement are both of the same GPU (then the categories are also drawn)."""

    peaks: list[CategoryRow] = field(default_factory=list)
    categories: list[CategoryRow] = field(default_factory=list)
    reason: str | None = None
    note: str | None = None
    compared: bool = False


def plan_section(diagnosis: Diagnosis) -> PlanSection:
    """Decide the plan-vs-measured section of ``diagnosis``'s run (see :class:`PlanSection`)."""
    timeline, plan = diagnosis.run.timeline, diagnosis.run.plan
    attribution = timeline.attribution
    measured = compare_categories(plan, timeline) if attribution or plan else []
    gpu_run = any("cuda" in d for d in timeline.expected_devices) or (
        not timeline.expected_devices and timeline.device_names()
    )
    if not gpu_run:
        where = "the plan is of GPU memory" if plan else "memfit plans GPU memory, and no plan was made for this run"
        section = PlanSection(reason=f"CPU run: {where}; the measured host memory is shown instead (Memory, above).")
        if attribution:
            # Measured only: next to a GPU plan, a CPU's temporaries and missing allocator would read as misses.
            section.categories = compare_categories(None, timeline)
            section.note = (
                f"What the tensors of the first {attribution.get('steps', '?')} steps held on the CPU, by category "
                "(the planner's tracker on the real tensors): a GPU would hold the same tensors, plus its "
                "allocator's reserve and the CUDA context."
            )
        return section
    if not plan:
        return PlanSection(
            categories=measured,
            reason=(
                "No plan was recorded for this run, so there is nothing to compare: memfit train plans every GPU run "
                "before it loads a weight; give MemoryCallback or MemoryRecorder plan=memfit.plan(...)."
            ),
        )
    section = PlanSection(
        peaks=compare_peaks(plan, timeline), categories=measured, compared=run_device(timeline) is not None
    )
    if not section.compared:
        section.reason = (
            "The plan is of one GPU and this run's memory is on several (or its device was not recorded): "
            "the categories measured on the first steps are compared, the peaks are not."
        )
    if attribution is None:
        section.note = (
            "No first-step attribution was recorded, so the categories were not measured "
            "(memfit train measures its first 2 steps; MemoryCallback(attribute_steps=2) does too)."
        )
    return section


# ------------------------------------------------------------------------------------------------
# HTML


_CSS = """
body { font-family: system-ui, -apple-system, Segoe UI, sans-serif; margin: 2rem auto; max-width: 980px; color: #222; padding: 0 1rem; }
h1 { font-size: 1.5rem; } h2 { font-size: 1.15rem; margin-top: 2rem; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: .5rem 0; } th { white-space: nowrap; } td, th { padding: .25rem .7rem; border-bottom: 1px solid #eee; text-align: left; vertical-align: top; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
.finding { border-left: 4px solid #999; padding: .4rem .8rem; margin: .6rem 0; background: #fafafa; }
.error { border-color: #c62828; } .warning { border-color: #ef6c00; } .info { border-color: #1565c0; }
.sev { font-weight: bold; text-transform: uppercase; font-size: .8rem; } .fix { color: #2e7d32; }
img { max-width: 100%; display: block; margin: .5rem 0; } .ok { color: #2e7d32; font-weight: bold; }
.note { color: #555; }
"""

#: Evaluations listed one per row up to this many; more are summed up (first, lowest, last).
MAX_LISTED_EVALS = 20


def render_html(diagnosis: Diagnosis, charts: list[tuple[str, bytes]], section: PlanSection | None = None) -> str:
    """The page: facts, configuration, findings, training, memory, plan vs measured (charts inlined)."""
    e = html.escape
    section = section if section is not None else plan_section(diagnosis)
    images = {name: _img(name, png) for name, png in charts}
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta name="generator" content="{GENERATOR}">',
        f"<title>memfit report: {e(diagnosis.run.path.name)}</title><style>{_CSS}</style></head><body>",
        f"<h1>memfit report: {e(diagnosis.run.path.name)}</h1>",
        _table(diagnosis.facts),
        "<h2>Run configuration</h2>",
        _table(configuration_rows(diagnosis.run)) or f'<p class="note">{e(NO_CONFIGURATION)}.</p>',
        "<h2>Findings</h2>",
        *_findings_html(diagnosis),
        "<h2>Training</h2>",
        *_training_html(diagnosis, images),
        *_replies_html(diagnosis),
        "<h2>Memory</h2>",
        *_memory_html(diagnosis, images),
        "<h2>Plan vs measured</h2>",
        *_plan_html(section, images),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _img(name: str, png: bytes) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{html.escape(chart_title(name))}" src="data:image/png;base64,{data}">'


def _table(rows: list[tuple[str, str]]) -> str:
    """A two-column table, or "" for no rows (the caller then says why)."""
    if not rows:
        return ""
    e = html.escape
    return "<table>" + "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in rows) + "</table>"


def _findings_html(diagnosis: Diagnosis) -> list[str]:
    e = html.escape
    if not diagnosis.findings:
        return ['<p class="ok">No memory problems found.</p>']
    parts = []
    for f in diagnosis.findings:
        where = f" (step {f.step})" if f.step is not None else ""
        parts.append(
            f'<div class="finding {e(f.severity)}"><span class="sev">{e(f.severity)}</span> <b>{e(f.code)}</b>{e(where)}: '
            f'{e(f.message)}<br><span class="fix">fix: {e(f.fix)}</span></div>'
        )
    return parts


def _training_html(diagnosis: Diagnosis, images: dict[str, str]) -> list[str]:
    e = html.escape
    metrics = diagnosis.run.metrics
    losses, evals = metric_curve(metrics, "loss"), metric_curve(metrics, "eval_loss")
    parts = []
    if losses:
        (first_step, first), (last_step, last) = losses[0], losses[-1]
        parts.append(
            f"<p>training loss {first:.4f} at step {first_step} &rarr; {last:.4f} at step {last_step} "
            f"({len(losses):,} logged steps)</p>"
        )
    if evals:
        shown = evals if len(evals) <= MAX_LISTED_EVALS else _eval_summary(evals)
        label = (
            "eval loss" if len(shown) == len(evals) else f"eval loss ({len(evals):,} evaluations: first, lowest, last)"
        )
        parts.append(
            f"<table><tr><th>step</th><th class=num>{e(label)}</th></tr>"
            + "".join(f"<tr><td>{step}</td><td class=num>{value:.4f}</td></tr>" for step, value in shown)
            + "</table>"
        )
    elif losses:
        parts.append(
            '<p class="note">no eval loss in metrics.jsonl: the run had no eval data, or ended before its first '
            "evaluation.</p>"
        )
    parts += _end_of_run_html(metrics)
    parts += _rewards_html(metrics, REWARD_METRICS, "preference metric")
    parts += _rewards_html(metrics, EVAL_REWARD_METRICS, "preference metric (evaluation)")
    parts += _grpo_html(metrics)
    parts += [images[name] for name in ("loss", "rewards", "grpo-rewards", "lr") if name in images]
    if not parts:
        parts.append(
            '<p class="note">metrics.jsonl holds no loss, eval loss or learning rate '
            f"({'it is missing' if not metrics else f'{len(metrics):,} records without them'}).</p>"
        )
    return parts


def _end_of_run_html(metrics: list) -> list[str]:
    """The end-of-run record the Trainer (and memfit train) logs, in one line, or nothing."""
    ends = [r for r in metrics if _finite(r.get("train_runtime"))]
    if not ends:
        return []
    end = ends[-1]
    parts = [f"{name} {end[name]:.4f}" for name in ("train_loss",) if _finite(end.get(name))]
    parts.append(f"train_runtime {end['train_runtime']:,.1f} s")
    parts += [
        f"{end[name]:,.3f} {unit}"
        for name, unit in (("train_samples_per_second", "samples/s"), ("train_steps_per_second", "steps/s"))
        if _finite(end.get(name))
    ]
    return [f"<p>end of run (step {end.get('step', '?')}): {html.escape(', '.join(parts))}</p>"]


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _rewards_html(metrics: list, names: tuple[str, ...], title: str) -> list[str]:
    """A preference run's rewards (TRL's ``names``), at their first and last record: one table, or nothing."""
    curves = {name: metric_curve(metrics, name) for name in names}
    shown = [name for name in names if curves[name]]
    accuracies = next(name for name in names if name.endswith("rewards/accuracies"))  # the table's steps
    if accuracies not in shown:
        return []
    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td class=num>{curves[name][0][1]:.4f}</td>"
        f"<td class=num>{curves[name][-1][1]:.4f}</td></tr>"
        for name in shown
    )
    first, last = curves[accuracies][0][0], curves[accuracies][-1][0]
    return [
        f"<table><tr><th>{html.escape(title)}</th><th class=num>step {first}</th><th class=num>step {last}</th></tr>{rows}</table>"
    ]


def _grpo_html(metrics: list) -> list[str]:
    """A grpo run's reward, each reward function's, the completions' length and the policy's metrics
    (TRL's names) at their first and last record: one table, or nothing."""
    from memfit.watch.charts import GRPO_METRICS, grpo_reward_names

    names = list(GRPO_METRICS[:2]) + grpo_reward_names(metrics) + list(GRPO_METRICS[2:])
    curves = {name: metric_curve(metrics, name) for name in names}
    if not curves["reward"]:
        return []
    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td class=num>{curves[name][0][1]:.4f}</td>"
        f"<td class=num>{curves[name][-1][1]:.4f}</td></tr>"
        for name in names
        if curves[name]
    )
    first, last = curves["reward"][0][0], curves["reward"][-1][0]
    return [
        f"<table><tr><th>grpo metric</th><th class=num>step {first}</th><th class=num>step {last}</th></tr>{rows}</table>"
    ]


def _replies_html(diagnosis: Diagnosis) -> list[str]:
    """The replies to ``eval_prompts`` at the first and the last evaluation, side by side (a run
    without ``eval_prompts`` has no such section)."""
    e = html.escape
    records = [r for r in diagnosis.run.metrics if isinstance(r.get("generations"), list) and r["generations"]]
    if not records:
        return []
    first, last = records[0], records[-1]
    steps = [first] if first is last else [first, last]
    header = "".join(f"<th>reply at step {e(str(r.get('step')))}</th>" for r in steps)
    rows = []
    for index, item in enumerate(last["generations"]):
        messages = item.get("messages") or []
        prompt = messages[-1].get("content", "") if messages and isinstance(messages[-1], dict) else ""
        replies = []
        for record in steps:
            generations = record["generations"]
            reply = generations[index].get("generation", "") if index < len(generations) else ""
            replies.append(f"<td>{e(str(reply))}</td>")
        rows.append(f"<tr><td>{e(str(prompt))}</td>{''.join(replies)}</tr>")
    return [
        "<h2>Replies to eval_prompts</h2>",
        f'<p class="note">greedy, at most {e(str(last.get("max_new_tokens", "")))} new tokens; '
        f"{len(records):,} evaluations in metrics.jsonl</p>",
        f"<table><tr><th>prompt</th>{header}</tr>{''.join(rows)}</table>",
    ]


def _eval_summary(evals: list[tuple[int, float]]) -> list[tuple[int, float]]:
    lowest = min(evals, key=lambda point: point[1])
    return sorted({evals[0], lowest, evals[-1]})


def _memory_html(diagnosis: Diagnosis, images: dict[str, str]) -> list[str]:
    parts = [img for name, img in images.items() if name.startswith("memory-")]
    if not parts:
        steps = len(diagnosis.run.timeline.steps)
        why = {
            0: "no step was recorded",
            1: "one step was recorded, too few for a timeline: its readings are at the top of the page",
        }
        parts.append(f'<p class="note">{why.get(steps, "no step record holds a memory reading")}.</p>')
    return parts


def _plan_html(section: PlanSection, images: dict[str, str]) -> list[str]:
    e = html.escape
    parts = []
    if section.reason:
        parts.append(f'<p class="note">{e(section.reason)}</p>')
    for rows in (section.peaks, section.categories):
        if rows:
            parts.append(_comparison_table(rows, "peak" if rows is section.peaks else "category"))
    if "categories" in images:
        parts.append(images["categories"])
    if section.note:
        parts.append(f'<p class="note">{e(section.note)}</p>')
    return parts or ['<p class="note">nothing to compare.</p>']


def _comparison_table(rows: list[CategoryRow], heading: str) -> str:
    """Plan, measured and their ratio per row; the measured column alone when nothing was planned."""
    e = html.escape
    planned = any(r.predicted_bytes is not None for r in rows)
    columns = ["plan", "measured", "measured / plan"] if planned else ["measured"]
    lines = [f"<table><tr><th>{heading}</th>" + "".join(f"<th class=num>{c}</th>" for c in columns) + "</tr>"]
    for r in rows:
        cells = [format_bytes(r.measured_bytes) if r.measured_bytes is not None else "not measured"]
        if planned:
            cells = [
                format_bytes(r.predicted_bytes) if r.predicted_bytes is not None else "-",
                *cells,
                f"{r.ratio:.2f}" if r.ratio is not None else "-",
            ]
        lines.append(f"<tr><td>{e(r.name)}</td>" + "".join(f"<td class=num>{e(c)}</td>" for c in cells) + "</tr>")
    return "".join(lines) + "</table>"
