"""``memfit doctor`` and ``memfit report``: typed command functions for the CLI to register.

No torch (or matplotlib) import happens when this module is imported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def doctor_command(
    run_dir: Path = typer.Argument(..., help="A run folder (memfit train's output_dir, or MemoryCallback's run_dir)."),
) -> None:
    """Explain what went wrong with a run's memory and what to change, most important first.

    Exit code 0: nothing serious; 1: at least one error; 2: not a readable run folder.
    """
    from rich.console import Console

    from memfit.watch.doctor import diagnose, render
    from memfit.watch.timeline import TimelineError

    try:
        diagnosis = diagnose(run_dir)
    except TimelineError as err:
        Console(stderr=True).print(f"[bold red]error:[/] {err}", highlight=False)
        raise typer.Exit(code=2) from None
    render(diagnosis, Console())
    raise typer.Exit(code=diagnosis.exit_code)


def report_command(
    run_dir: Path = typer.Argument(..., help="A run folder (memfit train's output_dir, or MemoryCallback's run_dir)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="HTML file to write (default: RUN_DIR/report.html)."),
) -> None:
    """Write a self-contained HTML report (memory per device, loss, plan vs measured) and its PNGs."""
    from rich.console import Console

    from memfit.watch.report import ReportError, write_report
    from memfit.watch.timeline import TimelineError

    try:
        path = write_report(run_dir, out)
    except (TimelineError, ReportError) as err:
        Console(stderr=True).print(f"[bold red]error:[/] {err}", highlight=False)
        raise typer.Exit(code=2) from None
    Console().print(f"wrote {path}", highlight=False)
