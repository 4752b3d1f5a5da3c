"""The doctor and report command functions, registered on a Typer app as the CLI does."""

from __future__ import annotations

import subprocess
import sys

import typer
from typer.testing import CliRunner
from watch_helpers import MiB, start_record, step_records, write_run

from memfit.watch.command import doctor_command, report_command

app = typer.Typer()
app.command("doctor")(doctor_command)
app.command("report")(report_command)
runner = CliRunner()


def test_doctor_exit_codes(tmp_path):
    clean = write_run(tmp_path / "clean", [start_record(), *step_records(40)])
    leaky = write_run(tmp_path / "leaky", [start_record(), *step_records(100, rss=lambda s: 400 * MiB + 3 * MiB * s)])
    assert runner.invoke(app, ["doctor", str(clean)]).exit_code == 0
    result = runner.invoke(app, ["doctor", str(leaky)])
    assert result.exit_code == 1 and "leak" in result.output
    result = runner.invoke(app, ["doctor", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_report_command(tmp_path):
    run = write_run(tmp_path / "run", [start_record(), *step_records(20)])
    result = runner.invoke(app, ["report", str(run)])
    assert result.exit_code == 0 and (run / "report.html").is_file()
    long = write_run(tmp_path / ("a-long-folder-name-" * 6), [start_record(), *step_records(20)])
    result = runner.invoke(app, ["report", str(long)])  # through a pipe: one line, however long
    assert result.output == f"wrote {long / 'report.html'}\n"
    (tmp_path / "mine.html").write_text("x")
    result = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "mine.html")])
    assert result.exit_code == 2 and "not written by memfit report" in result.output


def test_importing_the_commands_loads_neither_torch_nor_matplotlib():
    code = (
        "import sys, memfit.watch.command, memfit.watch.doctor, memfit.watch.report; "
        "print(sorted(m for m in ('torch', 'matplotlib', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
