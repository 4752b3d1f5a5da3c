"""``memfit doctor``: read a run folder and say, most important first, what went wrong with memory
and what to change.

Findings come from two places: the detectors run again over the whole recorded timeline (with the
thresholds of this version), and the findings recorded while the run was going (those about the
live model, which a timeline cannot show). No torch import: a run folder is JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.units import format_bytes
from memfit.watch.compare import CategoryRow, compare_categories
from memfit.watch.detectors import detect_all
from memfit.watch.peaks import host_peak
from memfit.watch.thresholds import Thresholds
from memfit.watch.timeline import Finding, RunFolder, load_run, merge_findings


@dataclass
class Diagnosis:
    """What ``memfit doctor`` found in a run folder."""

    run: RunFolder
    findings: list[Finding]
    comparison: list[CategoryRow] = field(default_factory=list)
    facts: list[tuple[str, str]] = field(default_factory=list)

    @property
    def has_errors(self) -> bool:
        return any(f.severity == "error" for f in self.findings)

    @property
    def exit_code(self) -> int:
        """0: nothing serious; 1: at least one error-level finding."""
        return 1 if self.has_errors else 0


def diagnose(run_dir: str | Path, thresholds: Thresholds = Thresholds()) -> Diagnosis:
    """Load ``run_dir`` and collect every finding, merged per problem and sorted by importance.

    Raises:
        TimelineError: the folder is missing, is not a run folder, or its memory.jsonl is damaged.
    """
    run = load_run(run_dir)
    timeline = run.timeline
    found = detect_all(timeline, run.plan, thresholds)
    found += _status_findings(run)
    findings = merge_findings(found, timeline.findings)
    return Diagnosis(
        run=run,
        findings=findings,
        comparison=compare_categories(run.plan, timeline) if run.plan else [],
        facts=run_facts(run),
    )


def _status_findings(run: RunFolder) -> list[Finding]:
    """How the run ended, when that is a memory matter (memfit train records it in run.json)."""
    status = (run.run or {}).get("status")
    if status != "oom":
        return []
    step = (run.run or {}).get("step")
    return [
        Finding(
            severity="error",
            code="oom",
            message=f"the run ran out of device memory at step {step + 1 if isinstance(step, int) else '?'}.",
            fix="See the other findings for the cause; `memfit plan` with the run's settings shows what to lower (the run saved a checkpoint to resume from).",
            step=step,
        )
    ]


def run_facts(run: RunFolder) -> list[tuple[str, str]]:
    """Short facts about the run for the top of the doctor's output and the report."""
    timeline = run.timeline
    facts: list[tuple[str, str]] = [("run folder", str(run.path))]
    if timeline.steps:
        first, last = timeline.steps[0].get("step"), timeline.steps[-1].get("step")
        total = f" of {timeline.total_steps:,}" if timeline.total_steps else ""
        facts.append(("steps recorded", f"{first}-{last}{total}"))
    else:
        facts.append(("steps recorded", "none"))
    if timeline.end is not None:
        facts.append(("ended", str(timeline.end.get("status", "?"))))
    else:
        facts.append(
            ("ended", "no end record: the process stopped without closing the recorder (crash, kill, or still running)")
        )
    facts.append(("expected devices", ", ".join(timeline.expected_devices) or "unknown"))
    rss = [r.get("rss_bytes", 0) for r in timeline.steps]
    peak = host_peak(timeline)
    if rss or peak:
        text = f"{format_bytes(rss[0])} after the first step, {format_bytes(rss[-1])} at the last; " if rss else ""
        facts.append(("host RSS", text + (f"peak {peak.describe()}" if peak else "no peak recorded")))
    for name in timeline.device_names():
        entries = [r["devices"][name] for r in timeline.steps if name in r.get("devices", {})]
        peak = max((e.get("peak_allocated_bytes", 0) for e in entries), default=0)
        reserved = max((e.get("peak_reserved_bytes", 0) for e in entries), default=0)
        used = max((e.get("nvml_used_bytes", 0) for e in entries), default=0)
        text = f"peak allocated {format_bytes(peak)}, peak reserved {format_bytes(reserved)}"
        if used:
            text += f", device used (NVML) up to {format_bytes(used)}"
        facts.append((name, text))
    plan = run.plan
    if plan:
        peak = plan.get("peak") or {}
        facts.append(
            (
                "plan",
                f"peak allocated {format_bytes(peak.get('allocated_bytes', 0))}, device total {format_bytes(peak.get('device_total_bytes', 0))} ({peak.get('phase', '?')})",
            )
        )
    return facts


def render(diagnosis: Diagnosis, console: Any = None) -> None:
    """Print the diagnosis: facts, findings with their fixes (most important first), predicted vs measured."""
    from rich.markup import escape
    from rich.table import Table

    from memfit.console import make_console

    console = console or make_console()
    # Through a pipe or into a file a line is never cut at the console's guessed width (80
    # columns): whoever reads it (grep, a log, a wider window) wraps it, or not, as they like.
    soft = not console.is_terminal
    if soft:
        width = max((len(key) for key, _ in diagnosis.facts), default=0)
        for key, value in diagnosis.facts:
            console.print(f"[dim]{escape(key.ljust(width))}[/]  {escape(value)}", highlight=False, soft_wrap=True)
    else:
        grid = Table.grid(padding=(0, 2))
        for key, value in diagnosis.facts:
            grid.add_row(f"[dim]{escape(key)}[/]", escape(value))
        console.print(grid)
    console.print()
    if not diagnosis.findings:
        steps = len(diagnosis.run.timeline.steps)
        console.print(f"[green]No memory problems found[/] in {steps} recorded steps.", soft_wrap=soft)
    styles = {"error": "bold red", "warning": "yellow", "info": "cyan"}
    for number, finding in enumerate(diagnosis.findings, 1):
        where = f" (step {finding.step})" if finding.step is not None else ""
        console.print(
            f"{number}. [{styles[finding.severity]}]{finding.severity}[/] [bold]{finding.code}[/]{where}: {escape(finding.message)}",
            highlight=False,
            soft_wrap=soft,
        )
        console.print(f"   [green]fix:[/] {escape(finding.fix)}", highlight=False, soft_wrap=soft)
    if diagnosis.comparison:
        console.print()
        table = Table(title="predicted vs measured (at the step's peak)", title_justify="left")
        table.add_column("category")
        table.add_column("plan", justify="right")
        table.add_column("measured", justify="right")
        table.add_column("measured / plan", justify="right")
        for row in diagnosis.comparison:
            table.add_row(
                row.name,
                format_bytes(row.predicted_bytes) if row.predicted_bytes is not None else "-",
                format_bytes(row.measured_bytes) if row.measured_bytes is not None else "not measured",
                f"{row.ratio:.2f}" if row.ratio is not None else "-",
            )
        console.print(table)
        if diagnosis.run.timeline.attribution is None:
            console.print(
                "[dim]no first-step attribution was recorded, so categories were not measured[/]", soft_wrap=soft
            )
