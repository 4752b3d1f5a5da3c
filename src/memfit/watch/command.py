"""``memfit doctor``, ``memfit report`` and ``memfit calibrate``: typed command functions for the CLI to register.

No torch (or matplotlib) import happens when this module is imported. Errors are printed by
:func:`memfit.errors.cli_errors`, which wraps each command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from memfit.errors import cli_errors
from memfit.options import GPU, command_options, with_options


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


@cli_errors
@with_options(command_options("calibrate", (GPU,)))
def calibrate_command(
    run_dir: Path = typer.Argument(
        ...,
        help="A run folder (memory.jsonl with its plan), or a folder with a "
        "torch.cuda.memory_stats() dump (memory_stats.json) and the run's plan (plan.json).",
    ),
    **options: Any,
) -> None:
    """Measure the CUDA context and the allocator's reserve of a run on its card, and keep them for
    later plans of that card (shown in them as "calibrated on <card> from <run>").

    Exit code 0: kept; 2: not a run that can calibrate a card."""
    from memfit.console import make_console
    from memfit.planner.calibration import save
    from memfit.units import format_bytes
    from memfit.watch.calibrate import calibrate

    calibration = calibrate(run_dir, options["gpu"])
    path = save(calibration)
    context = (
        "not measured (a memory_stats dump)"
        if calibration.context_bytes is None
        else format_bytes(calibration.context_bytes)
    )
    lines = [
        f"{calibration.describe()}: CUDA context {context}, allocator reserve beyond the plan's "
        f"{calibration.allocator_extra_fraction:.2%} of the allocated peak",
        f"measured peak allocated {format_bytes(calibration.measured['allocated_bytes'])}, reserved "
        f"{format_bytes(calibration.measured['reserved_bytes'])}; planned {format_bytes(calibration.planned['allocated_bytes'])}, "
        f"{format_bytes(calibration.planned['reserved_bytes'])}",
        f"kept in {path}",
    ]
    make_console().print("\n".join(lines), highlight=False, markup=False, soft_wrap=True)
