"""``memfit doctor`` and ``memfit report``: typed command functions for the CLI to register.

No torch (or matplotlib) import happens when this module is imported. Errors are printed by
:func:`memfit.errors.cli_errors`, which wraps each command.
"""

from __future__ import annotations

from pathlib import Path

import typer

from memfit.errors import cli_errors


@cli_errors
def doctor_command(
    run_dir: Path = typer.Argument(..., help="A run folder (memfit train's output_dir, or MemoryCallback's run_dir)."),
) -> None:
    """Explain what went wrong with a run's memory and what to change, most important first.

    Exit code 0: nothing serious; 1: at least one error; 2: not a readable run folder.
    """
    from memfit.console import make_console
    from memfit.watch.doctor import diagnose, render

    diagnosis = diagnose(run_dir)
    render(diagnosis, make_console())
    raise typer.Exit(code=diagnosis.exit_code)


@cli_errors
def report_command(
    run_dir: Path = typer.Argument(..., help="A run folder (memfit train's output_dir, or MemoryCallback's run_dir)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="HTML file to write (default: RUN_DIR/report.html)."),
) -> None:
    """Write a self-contained HTML report (memory per device, loss, plan vs measured) and its PNGs.

    Exit code 0: written; 2: not a readable run folder, or --out cannot be written (checked before
    the charts are drawn; a file memfit report did not write is never replaced)."""
    from memfit.console import make_console
    from memfit.watch.report import write_report

    path = write_report(run_dir, out)
    make_console().print(f"wrote {path}", highlight=False, markup=False, soft_wrap=True)
