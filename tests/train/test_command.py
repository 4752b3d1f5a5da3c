"""`memfit train` on the command line: flags reach the config as the knobs they are, and a run that
needs several processes says how to start them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from trainer_helpers import tiny_settings
from typer.testing import CliRunner

from memfit.cli import app


def _config(tmp_path: Path, **changes) -> Path:
    settings = tiny_settings(tmp_path / "run", **changes)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(settings, sort_keys=False))
    return path


def _error(result) -> str:
    """The error message, as one line (Rich wraps long lines on narrow terminals)."""
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return " ".join(result.stderr.split())


@pytest.mark.parametrize("args", [["--gpus", "2"], ["--set", "gpus=2"]], ids=["flag", "set"])
def test_several_gpus_without_a_shard_mode_say_how_to_start_them(tmp_path, args):
    result = CliRunner().invoke(app, ["train", str(_config(tmp_path)), *args])
    text = _error(result)
    assert result.exit_code == 2, result.output
    assert text.startswith("error: invalid training configuration") and text.count("error:") == 1
    assert "shard: 'none' with gpus: 2" in text and "--nproc 2" in text and "shard: fsdp" in text
    assert not (tmp_path / "run").exists()


def test_several_gpus_in_one_process_say_how_to_start_them(tmp_path):
    result = CliRunner().invoke(app, ["train", str(_config(tmp_path)), "--gpus", "2", "--shard", "fsdp"])
    text = _error(result)
    assert result.exit_code == 2, result.output
    assert "gpus: 2, but this is a single process" in text and "--nproc 2" in text and "torchrun" in text
    assert not (tmp_path / "run").exists()


def test_a_set_is_not_undone_by_a_flag_left_off(tmp_path):
    # --lr is a flag too: left off, it must not put lr back to the file's value over --set lr=...
    result = CliRunner().invoke(
        app, ["train", str(_config(tmp_path, max_steps=1)), "--set", "lr=0.0125", "-b", "2", "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    import json

    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["config"]["lr"] == 0.0125
    assert record["config"]["batch_size"] == 2  # -b 2 arrived as text; the run took the number


def test_a_resumed_run_s_summary_starts_from_the_run_s_first_loss(tmp_path):
    from trainer_helpers import step_losses

    config = _config(tmp_path, max_steps=2)
    assert CliRunner().invoke(app, ["train", str(config), "--no-progress"]).exit_code == 0
    result = CliRunner().invoke(app, ["train", str(config), "--max-steps", "4", "--resume", "--no-progress"])
    assert result.exit_code == 0, result.output
    losses = step_losses(tmp_path / "run")
    assert sorted(losses) == [1, 2, 3, 4]
    # From the run's first step (in metrics.jsonl), not from the first step this process took (step 3).
    assert f"done: 4 steps, loss {losses[1]:.4f} -> {losses[4]:.4f}" in _error(result)


def test_a_folder_of_the_user_s_is_not_a_run_to_resume(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    result = CliRunner().invoke(app, ["train", str(_config(tmp_path)), "-o", str(mine), "--no-progress"])
    text = _error(result)
    assert result.exit_code == 2, result.output
    assert (
        f"output_dir {str(mine)!r} holds files and is not a memfit run folder (it has no run.json): memfit will not "
        "write into it. Choose a new folder for the run"
    ) in text
    assert "--resume" not in text and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def test_the_output_folder_is_never_one_of_the_run_s_inputs(tmp_path):
    import shutil

    from trainer_helpers import DEMO_DATA

    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(DEMO_DATA, data / "train.jsonl")
    config = _config(tmp_path, data=str(data))
    result = CliRunner().invoke(app, ["train", str(config), "-o", str(data), "--no-progress"])
    assert result.exit_code == 2
    assert (
        f"output_dir {str(data)!r} is the data source, which this command reads: memfit never writes over its inputs"
        in _error(result)
    )
    result = CliRunner().invoke(app, ["train", str(config), "-o", str(config), "--no-progress"])
    assert result.exit_code == 2
    assert f"output_dir {str(config)!r} is the config file, which this command reads" in _error(result)
    assert sorted(p.name for p in data.iterdir()) == ["train.jsonl"]
