"""`memfit merge` on the command line: typed options, red one-line errors, exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from memfit.merge.command import merge_command


def _app():
    app = typer.Typer()
    app.command("merge")(merge_command)

    @app.callback()
    def _root():  # keeps "merge" a named sub-command, as in memfit's CLI
        pass

    return app


def test_importing_the_command_does_not_import_torch():
    code = "import sys, memfit.merge.command; print('torch' in sys.modules, 'transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False False"


def test_help_lists_the_options():
    result = CliRunner().invoke(_app(), ["merge", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for option in ("--base", "--adapter", "--out", "--dtype", "--device", "--overwrite", "--safe"):
        assert option in result.output


def test_bad_input_exits_2_without_traceback(tmp_path):
    result = CliRunner().invoke(
        _app(),
        [
            "merge",
            "--base",
            str(tmp_path / "b"),
            "--adapter",
            str(tmp_path / "a"),
            "--out",
            str(tmp_path / "o"),
            "--dtype",
            "int4",
        ],
    )
    assert result.exit_code == 2
    assert "--dtype 'int4' is not supported" in result.output
    assert "Traceback" not in result.output


def test_merge_runs(tmp_path, llama_bf16, plain_adapter):
    pytest.importorskip("torch")
    out = tmp_path / "merged"
    result = CliRunner().invoke(
        _app(),
        [
            "merge",
            "--base",
            str(llama_bf16),
            "--adapter",
            str(plain_adapter),
            "--out",
            str(out),
            "--dtype",
            "bf16",
            "--safe",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "merged 6 tensors" in result.output
    assert (out / "model.safetensors.index.json").is_file()

    again = CliRunner().invoke(
        _app(), ["merge", "--base", str(llama_bf16), "--adapter", str(plain_adapter), "--out", str(out)]
    )
    assert again.exit_code == 2 and "--overwrite" in again.output
