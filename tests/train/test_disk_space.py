"""A disk that fills up while a checkpoint or the adapter is saved: one error line saying how much it
needed and how much is free, nothing half-written left, the checkpoint before it whole and resumable."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainer_helpers import step_losses, tiny_config, tiny_settings  # noqa: E402

from memfit.train import checkpointing, disk_space  # noqa: E402
from memfit.train.checkpointing import checkpoint_problem, latest_checkpoint, list_checkpoints  # noqa: E402
from memfit.train.errors import DiskFull, TrainError  # noqa: E402
from memfit.train.recipe import train  # noqa: E402

NO_SPACE = OSError(errno.ENOSPC, "No space left on device")


def _fail_nth_state_write(monkeypatch, n: int, error: BaseException = NO_SPACE) -> list[int]:
    """Make the ``n``-th checkpoint's state.pt write a few bytes and then fail with ``error``, as a
    full disk does in the middle of a file. Returns the call counter."""
    real_save = torch.save
    calls = [0]

    def save(obj, f, *args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            f.write(b"PK\x03\x04 partial")
            raise error
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(checkpointing.torch, "save", save)
    return calls


def _temporary_folders(run: Path) -> list[Path]:
    return [p for p in run.rglob(".tmp-*")]


def test_a_full_disk_while_checkpointing_keeps_the_one_before_and_resume_finishes_the_run(tmp_path, monkeypatch):
    settings = dict(max_steps=6, save_every=2, keep_checkpoints=1)
    clean = train(tiny_config(tmp_path / "clean", **settings), progress=False)
    _fail_nth_state_write(monkeypatch, 2)  # the checkpoint of step 4; the one of step 2 was saved
    with pytest.raises(DiskFull) as info:
        train(tiny_config(tmp_path / "run", **settings), progress=False)
    message = str(info.value)
    assert info.value.exit_code == 2
    assert message.startswith("no space left on the disk mounted at ")
    assert f"for checkpoint step-00000004 in {tmp_path / 'run' / 'checkpoints'}: it needs at least " in message
    assert "is free there" in message and "step-00000002, is whole" in message and "--resume" in message
    assert "\n" not in message
    run = tmp_path / "run"
    assert _temporary_folders(run) == []
    assert [p.name for p in list_checkpoints(run)] == ["step-00000002"]  # not pruned for the one that failed
    assert checkpoint_problem(run / "checkpoints" / "step-00000002") is None
    assert json.loads((run / "run.json").read_text())["status"] == "disk_full"

    monkeypatch.undo()  # space freed
    resumed = train(tiny_config(run, **settings), resume=True, progress=False)
    assert resumed.status == "completed" and resumed.step == 6
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    got, want = step_losses(run), step_losses(tmp_path / "clean")
    assert sorted(got) == sorted(want) == list(range(1, 7))
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-6, (step, got[step], want[step])
    for (name, a), (_, b) in zip(resumed.model.named_parameters(), clean.model.named_parameters()):
        if a.requires_grad:
            assert torch.allclose(a, b, atol=1e-6, rtol=0), name


def test_a_full_disk_while_writing_the_adapter_keeps_the_final_checkpoint(tmp_path, monkeypatch):
    import peft

    real_save = peft.PeftModel.save_pretrained

    def save_pretrained(self, folder, *args, **kwargs):
        Path(folder, "adapter_model.safetensors").write_bytes(b"\0" * 100)  # part of it, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device", str(Path(folder, "adapter_model.safetensors")))

    monkeypatch.setattr(peft.PeftModel, "save_pretrained", save_pretrained)
    with pytest.raises(DiskFull) as info:
        train(tiny_config(tmp_path / "run", max_steps=2), progress=False)
    run = tmp_path / "run"
    message = str(info.value)
    assert f"for the adapter in {run}: it needs at least " in message
    assert "step-00000002, is whole" in message and "--resume to write the adapter" in message
    assert _temporary_folders(run) == [] and not (run / "adapter").exists()
    assert checkpoint_problem(latest_checkpoint(run)) is None

    monkeypatch.setattr(peft.PeftModel, "save_pretrained", real_save)
    done = train(tiny_config(run, max_steps=2), resume=True, progress=False)
    assert done.status == "completed" and (run / "adapter" / "adapter_model.safetensors").is_file()


def test_torch_saves_position_error_on_a_full_disk_is_a_full_disk(tmp_path, monkeypatch):
    # torch.save writing to a path of its own reports a full disk as its zip writer's position
    # mismatch, with no errno: a failed write with less free space than it still had to write.
    cryptic = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    _fail_nth_state_write(monkeypatch, 1, cryptic)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda path: usage._replace(free=0))
    with pytest.raises(DiskFull, match="0 B is free there. No checkpoint was saved yet, so there is nothing to resume"):
        train(tiny_config(tmp_path / "run", max_steps=1), progress=False)
    assert _temporary_folders(tmp_path / "run") == []


def _fail_nth_metrics_write(monkeypatch, n: int) -> None:
    """Make the ``n``-th step's line of metrics.jsonl fail as a full disk fails a write to an open
    file: ENOSPC, and no file name."""
    from memfit.train import progress

    real_write = progress.MetricsLog.write
    steps = [0]

    def write(self, record):
        steps[0] += "loss" in record
        if "loss" in record and steps[0] == n:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, record)

    monkeypatch.setattr(progress.MetricsLog, "write", write)


def test_a_full_disk_before_the_first_checkpoint_does_not_advise_resume(tmp_path, monkeypatch):
    _fail_nth_metrics_write(monkeypatch, 1)
    with pytest.raises(DiskFull) as info:
        train(tiny_config(tmp_path / "run", max_steps=2), progress=False)
    message = str(info.value)
    assert message.startswith("no space left on the disk mounted at ") and "for the run's files" in message
    assert "No checkpoint was saved yet, so there is nothing to resume" in message and "--resume" not in message
    assert f"start the run again in a new output_dir, or delete {tmp_path / 'run'} first" in message
    assert latest_checkpoint(tmp_path / "run") is None
    with pytest.raises(TrainError, match="has no checkpoint to resume from"):
        train(tiny_config(tmp_path / "run", max_steps=2), resume=True, progress=False)  # what --resume would have said


def test_a_full_disk_after_a_checkpoint_advises_resuming_from_it(tmp_path, monkeypatch):
    _fail_nth_metrics_write(monkeypatch, 2)  # step 1's checkpoint is saved after its metrics line
    with pytest.raises(DiskFull) as info:
        train(tiny_config(tmp_path / "run", max_steps=3, save_every=1), progress=False)
    message = str(info.value)
    assert "The run's last checkpoint, " in message and "step-00000001, is whole" in message and "--resume." in message


def test_other_write_errors_are_not_called_a_full_disk(tmp_path, monkeypatch):
    _fail_nth_state_write(monkeypatch, 1, RuntimeError("something else went wrong"))
    with pytest.raises(RuntimeError, match="something else went wrong"):
        train(tiny_config(tmp_path / "run", max_steps=1), progress=False)
    assert _temporary_folders(tmp_path / "run") == []  # still cleaned up


def test_is_full_disk_reads_the_error_and_its_cause():
    assert disk_space.is_full_disk(OSError(errno.EDQUOT, "Disk quota exceeded"), 10**12, 10)
    assert disk_space.is_full_disk(
        Exception("Error while serializing: I/O error: No space left on device (os error 28)"), None, 10
    )
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("unexpected pos 704 vs 598")  # noqa: B904 - the implicit context is what is read
    except RuntimeError as err:
        assert disk_space.is_full_disk(err, 10**12, 10)  # raised while handling the file's OSError
    assert not disk_space.is_full_disk(OSError(errno.EACCES, "Permission denied"), 10**12, 10)
    assert not disk_space.is_full_disk(ValueError("bad"), 0, 10)  # not a write error


def test_the_command_line_says_it_in_one_line_with_exit_code_2(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from memfit.cli import app
    from memfit.train.config import write_config

    config = tmp_path / "run.yaml"
    write_config(tiny_settings(tmp_path / "run", max_steps=1), config)
    _fail_nth_state_write(monkeypatch, 1)
    result = CliRunner().invoke(app, ["train", str(config), "--no-progress"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and " ".join(result.stderr.split()).count("no space left on the disk mounted at") == 1
    assert _temporary_folders(tmp_path / "run") == []
