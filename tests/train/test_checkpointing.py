"""Checkpoints: atomic, pruned, and a resumed run equal to one that never stopped; signals save one."""

from __future__ import annotations

import itertools
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import textwrap
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainer_helpers import (  # noqa: E402
    DEMO_DATA,
    REPO,
    read_metrics,
    step_losses,
    tiny_config,
    tiny_settings,
)

from memfit.step import train_step as step_module  # noqa: E402
from memfit.train.checkpointing import (  # noqa: E402
    CheckpointError,
    capture_rng,
    checkpoint_problem,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
    stale_temporary_folders,
)
from memfit.train.recipe import train  # noqa: E402
from memfit.train.run_folder import truncate_metrics  # noqa: E402

CPU = torch.device("cpu")


def _interrupt_after(monkeypatch, n_steps: int, signum=signal.SIGINT):
    """Make the process signal itself right after step ``n_steps``, like a user pressing Ctrl-C."""
    real_step = step_module.train_step
    calls = {"n": 0}

    def step_then_signal(*args, **kwargs):
        out = real_step(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == n_steps:
            os.kill(os.getpid(), signum)
        return out

    monkeypatch.setattr(step_module, "train_step", step_then_signal)
    return real_step


def test_interrupted_and_resumed_run_equals_an_uninterrupted_one(tmp_path, monkeypatch):
    # dropout makes the loss depend on the RNG, shuffling on the data position, warmup + cosine on
    # the scheduler and AdamW on its moments: all of them must be restored for the losses to match.
    settings = dict(max_steps=8, dropout=0.2, grad_accum=2, batch_size=2, warmup_steps=3, eval_split=0.05, eval_every=3)
    clean = train(tiny_config(tmp_path / "clean", **settings), progress=False)

    real_step = _interrupt_after(monkeypatch, 3)
    first = train(tiny_config(tmp_path / "run", **settings), progress=False)
    assert first.status == "interrupted" and first.signal_name == "SIGINT" and first.step == 3
    assert first.checkpoint.name == "step-00000003"
    assert not (tmp_path / "run" / "adapter").exists()  # no final output from an unfinished run
    monkeypatch.setattr(step_module, "train_step", real_step)

    ticks: list[float] = []

    def clock():  # 1 s a reading
        ticks.append(float(len(ticks)))
        return ticks[-1]

    resumed = train(tiny_config(tmp_path / "run", **settings), resume=True, progress=False, clock=clock)
    assert resumed.status == "completed" and resumed.step == 8
    got, want = step_losses(tmp_path / "run"), step_losses(tmp_path / "clean")
    assert sorted(got) == sorted(want) == list(range(1, 9))
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-6, (step, got[step], want[step])
    evals = lambda d: [(r["step"], r["eval_loss"]) for r in read_metrics(d) if "eval_loss" in r]  # noqa: E731
    assert [s for s, _ in evals(tmp_path / "run")] == [s for s, _ in evals(tmp_path / "clean")]
    for (_, a), (_, b) in zip(evals(tmp_path / "run"), evals(tmp_path / "clean")):
        assert abs(a - b) <= 1e-6
    # The end-of-run train_loss is the whole run's (the steps before the resume kept in the checkpoint),
    # not the resumed part's; the speeds are of the 5 steps this process trained, in its own time.
    assert abs(resumed.metrics["train_loss"] - clean.metrics["train_loss"]) <= 1e-6
    assert abs(resumed.metrics["train_loss"] - sum(loss for _, loss in resumed.losses) / 5) > 1e-4
    assert resumed.metrics["train_steps_per_second"] == round(5 / (ticks[-1] - ticks[0]), 3)
    stamps = lambda d: [(r["step"], r["epoch"]) for r in read_metrics(d)]  # noqa: E731
    assert stamps(tmp_path / "run") == stamps(tmp_path / "clean")
    for (name, a), (_, b) in zip(resumed.model.named_parameters(), clean.model.named_parameters()):
        if a.requires_grad:
            assert torch.allclose(a, b, atol=1e-6, rtol=0), name


def test_sigterm_in_a_subprocess_saves_and_exits_cleanly(tmp_path):
    out = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(
        (REPO / "examples" / "tiny.yaml")
        .read_text()
        .replace("../src/memfit/assets/data/tiny-instruct.jsonl", str(DEMO_DATA))
    )
    script = textwrap.dedent(
        """
        import sys, typer
        from memfit.train.command import train_command
        app = typer.Typer()
        app.command("train")(train_command)
        app.command("other")(lambda: None)
        app()
        """
    )
    cmd = [
        sys.executable,
        "-c",
        script,
        "train",
        str(config),
        "--output-dir",
        str(out),
        "--max-steps",
        "100000",
        "--set",
        "log_every=1",
        "--no-progress",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Waits for the run's second logged step, however slow the machine; the limit only catches a hang.
        deadline = time.monotonic() + 900
        metrics = out / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no second step logged in 15 minutes"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr
    assert "stopped by SIGTERM at step" in stderr and "to finish and write the adapter" in stderr
    # The command printed continues this run: the output folder and every other option are in it.
    again = shlex.split(stderr.split("; run `", 1)[1].split("`", 1)[0])
    assert again[:3] == ["memfit", "train", str(config)] and again[-1] == "--resume"
    pairs = set(itertools.pairwise(again))
    assert {("--output-dir", str(out)), ("--set", "log_every=1"), ("--max-steps", "100000")} <= pairs
    checkpoint = latest_checkpoint(out)
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert meta["reason"] == "interrupt" and meta["step"] >= 2
    assert json.loads((out / "run.json").read_text())["status"] == "interrupted"


class _Tiny(torch.nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(n))
        self.frozen = torch.nn.Parameter(torch.randn(n), requires_grad=False)


def _save(run_dir, step, model, opt, keep=2):
    return save_checkpoint(
        run_dir,
        step,
        model=model,
        optimizer=opt,
        scheduler=None,
        grad_scaler=None,
        data_state={"epoch": 0, "position": step},
        rng_state=capture_rng(CPU),
        reason="interval",
        keep=keep,
    )


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    model = _Tiny()
    opt = torch.optim.AdamW([model.a], lr=0.1)
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, model, opt, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003", "step-00000004"]
    # a save that died half-way leaves only a temporary folder, which resume ignores
    (tmp_path / "checkpoints" / ".tmp-step-00000005-123").mkdir()
    assert latest_checkpoint(tmp_path).name == "step-00000004"
    # saving the same step again replaces it whole
    _save(tmp_path, 4, model, opt, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "step-00000004").iterdir()) == [
        "meta.json",
        "state.pt",
        "trainable.safetensors",
    ]
    # only trainable tensors are stored
    from safetensors.torch import load_file

    assert set(load_file(str(latest_checkpoint(tmp_path) / "trainable.safetensors"))) == {"a"}


def test_load_restores_tensors_and_optimizer_and_refuses_other_models(tmp_path):
    model = _Tiny()
    opt = torch.optim.AdamW([model.a], lr=0.1)
    model.a.grad = torch.ones(4)
    opt.step()
    path = _save(tmp_path, 7, model, opt)
    other = _Tiny()
    other_opt = torch.optim.AdamW([other.a], lr=0.1)
    state = load_checkpoint(path, model=other, optimizer=other_opt, scheduler=None, grad_scaler=None, device=CPU)
    assert state.step == 7 and state.data == {"epoch": 0, "position": 7}
    assert torch.equal(other.a, model.a)
    assert torch.equal(other_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    wrong = _Tiny(n=5)
    with pytest.raises(CheckpointError, match="shape"):
        load_checkpoint(
            path, model=wrong, optimizer=torch.optim.AdamW([wrong.a]), scheduler=None, grad_scaler=None, device=CPU
        )
    (path / "state.pt").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        load_checkpoint(path, model=other, optimizer=other_opt, scheduler=None, grad_scaler=None, device=CPU)


def test_rng_states_round_trip():
    import numpy as np

    state = capture_rng(CPU)
    first = (random.random(), float(np.random.rand()), torch.rand(3))
    restore_rng(state, CPU)
    second = (random.random(), float(np.random.rand()), torch.rand(3))
    assert first[0] == second[0] and first[1] == second[1] and torch.equal(first[2], second[2])


def test_metrics_after_the_checkpoint_are_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 7)))
    truncate_metrics(tmp_path, 4)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]


def test_a_resume_from_a_checkpoint_without_the_loss_sum_leaves_train_loss_out(tmp_path, monkeypatch):
    # A checkpoint written before it kept the sum of the step losses: the run's mean is not known.
    real_step = _interrupt_after(monkeypatch, 1)
    config = tiny_config(tmp_path / "run", max_steps=2, log_every=1)
    assert train(config, progress=False).status == "interrupted"
    monkeypatch.setattr(step_module, "train_step", real_step)
    state_path = latest_checkpoint(tmp_path / "run") / "state.pt"
    state = torch.load(state_path, weights_only=False)
    assert state["data"].pop("train_loss_sum") == pytest.approx(step_losses(tmp_path / "run")[1], rel=1e-12)
    torch.save(state, state_path)
    resumed = train(config, resume=True, progress=False)
    assert resumed.status == "completed" and "train_loss" not in resumed.metrics
    assert "train_runtime" in read_metrics(tmp_path / "run")[-1]


def test_resume_with_other_batch_or_rank_is_refused(tmp_path):
    from memfit.train.recipe import TrainError

    train(tiny_config(tmp_path / "run", max_steps=2), progress=False)
    with pytest.raises(TrainError, match="batch_size: saved 4, now 2"):
        train(tiny_config(tmp_path / "run", max_steps=4, batch_size=2), resume=True, progress=False)
    with pytest.raises(TrainError, match="does not fit this model|shape"):
        train(tiny_config(tmp_path / "run", max_steps=4, rank=8), resume=True, progress=False)


# ------------------------------------------------------------------------------------------------
# Damaged checkpoints, finished runs, leftovers, permissions


def _tree(folder):
    return {str(p.relative_to(folder)): (None if p.is_dir() else p.read_bytes()) for p in sorted(folder.rglob("*"))}


def test_resume_falls_back_past_a_damaged_checkpoint_and_says_so(tmp_path):
    from io import StringIO

    from rich.console import Console

    clean = train(tiny_config(tmp_path / "clean", max_steps=4), progress=False)
    first = train(tiny_config(tmp_path / "run", max_steps=3, save_every=1), progress=False)
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step-00000002", "step-00000003"]
    damaged = tmp_path / "run" / "checkpoints" / "step-00000003" / "trainable.safetensors"
    damaged.write_bytes(b"")  # a full disk while it was written
    assert first.status == "completed"
    said = StringIO()
    resumed = train(
        tiny_config(tmp_path / "run", max_steps=4, save_every=1),
        resume=True,
        progress=False,
        console=Console(file=said, width=200),
    )
    assert "skipping damaged checkpoint" in said.getvalue() and "trainable.safetensors is empty" in said.getvalue()
    assert "resuming from" in said.getvalue() and "step-00000002" in said.getvalue()
    assert resumed.status == "completed" and resumed.step == 4
    got, want = step_losses(tmp_path / "run"), step_losses(tmp_path / "clean")
    assert sorted(got) == [1, 2, 3, 4] and all(abs(got[s] - want[s]) <= 1e-6 for s in want)
    assert clean.step == 4


def test_checkpoint_problem_finds_files_cut_short(tmp_path):
    model = _Tiny()
    opt = torch.optim.AdamW([model.a], lr=0.1)
    path = _save(tmp_path, 1, model, opt)
    assert checkpoint_problem(path) is None
    weights = (path / "trainable.safetensors").read_bytes()
    (path / "trainable.safetensors").write_bytes(weights[:-3])
    assert "cut short" in checkpoint_problem(path)
    (path / "trainable.safetensors").write_bytes(weights)
    state = (path / "state.pt").read_bytes()
    (path / "state.pt").write_bytes(state[: len(state) // 2])
    assert "state.pt is incomplete" in checkpoint_problem(path)
    assert latest_checkpoint(tmp_path) is None


def test_resume_of_a_finished_run_changes_nothing(tmp_path):
    from typer.testing import CliRunner

    from memfit.cli import app
    from memfit.train.config import write_config

    done = train(tiny_config(tmp_path / "run", max_steps=2), progress=False)
    assert done.status == "completed"
    before = _tree(tmp_path / "run")
    again = train(tiny_config(tmp_path / "run", max_steps=2), resume=True, progress=False)
    assert again.status == "finished" and again.output_dir == tmp_path / "run" / "adapter" and again.step == 2
    assert _tree(tmp_path / "run") == before
    # On the command line: it says so, with the output folder, and exits 0.
    config = tmp_path / "run.yaml"
    write_config(tiny_settings(tmp_path / "run", max_steps=2), config)
    result = CliRunner().invoke(app, ["train", str(config), "--resume"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "already finished" in text and str(tmp_path / "run" / "adapter") in text and "nan" not in text
    assert _tree(tmp_path / "run") == before


def test_resume_removes_what_interrupted_saves_left_and_nothing_else(tmp_path):
    train(tiny_config(tmp_path / "run", max_steps=2), progress=False)
    folder = tmp_path / "run" / "checkpoints"
    dead = [
        folder / ".tmp-step-00000003-999999999",
        tmp_path / "run" / ".tmp-adapter-999999999",
        folder / ".old-step-00000002-999999999",
    ]
    kept = [
        folder / f".tmp-step-00000004-{os.getpid()}",  # a live process's save
        folder / ".tmp-step-00000005",  # a multi-process save: no pid to prove it abandoned
        tmp_path / "run" / "my-notes",
    ]
    for path in dead + kept:
        path.mkdir()
    assert stale_temporary_folders(tmp_path / "run") == sorted(dead)
    train(tiny_config(tmp_path / "run", max_steps=3), resume=True, progress=False)
    assert not any(p.exists() for p in dead) and all(p.exists() for p in kept)


def test_checkpoints_and_outputs_get_the_permissions_of_the_umask(tmp_path):
    previous = os.umask(0o022)
    try:
        train(tiny_config(tmp_path / "run", max_steps=1), progress=False)
    finally:
        os.umask(previous)
    run = tmp_path / "run"
    files = [p for p in run.rglob("*") if p.is_file()]
    assert files and {oct(p.stat().st_mode & 0o777) for p in files} == {oct(0o644)}, [
        (str(p), oct(p.stat().st_mode & 0o777)) for p in files if p.stat().st_mode & 0o777 != 0o644
    ]
    assert {oct(p.stat().st_mode & 0o777) for p in run.rglob("*") if p.is_dir()} == {oct(0o755)}


def test_a_signal_during_the_last_step_still_writes_the_adapter(tmp_path, monkeypatch):
    _interrupt_after(monkeypatch, 4, signal.SIGTERM)  # arrives while the last of 4 steps runs
    result = train(tiny_config(tmp_path / "run", max_steps=4, eval_split=0.05), progress=False)
    assert result.status == "completed" and result.step == 4 and result.signal_name == "SIGTERM"
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    assert json.loads((result.checkpoint / "meta.json").read_text())["reason"] == "final"
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "completed"
    assert not [r for r in read_metrics(tmp_path / "run") if "eval_loss" in r]  # the final evaluation waits for nobody
    again = train(tiny_config(tmp_path / "run", max_steps=4, eval_split=0.05), resume=True, progress=False)
    assert again.status == "finished"  # nothing left to do


def test_a_signal_while_the_adapter_is_written_does_not_cut_it_short(tmp_path, monkeypatch):
    import memfit.train.world as world_module

    received = []
    previous = signal.signal(
        signal.SIGTERM, lambda signum, frame: received.append(signum)
    )  # what would end the process
    real_write = world_module.write_outputs

    def signal_then_write(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(world_module, "write_outputs", signal_then_write)
    try:
        result = train(tiny_config(tmp_path / "run", max_steps=2), progress=False)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert received == []  # the run's handler had it, not the one outside the run
    assert result.status == "completed" and result.signal_name == "SIGTERM"
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


def test_a_signal_before_the_last_step_says_how_to_finish(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from memfit.cli import app
    from memfit.train.config import write_config

    config = tmp_path / "run.yaml"
    write_config(tiny_settings(tmp_path / "run", max_steps=4), config)
    _interrupt_after(monkeypatch, 3, signal.SIGTERM)
    result = CliRunner().invoke(app, ["train", str(config), "--no-progress"])
    assert result.exit_code == 128 + signal.SIGTERM, result.output
    text = " ".join(result.stderr.split())
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000003"
    assert (
        f"stopped by SIGTERM at step 3 of 4; checkpoint at {checkpoint}; run `memfit train {config} --no-progress --resume` to finish and write the adapter"
        in text
    )
    assert not (tmp_path / "run" / "adapter").exists()
