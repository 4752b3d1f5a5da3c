"""Checkpoints: atomic, pruned, and a resumed run equal to one that never stopped; signals save one."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainer_helpers import DEMO_DATA, REPO, read_metrics, step_losses, tiny_config  # noqa: E402

from memfit.step import train_step as step_module  # noqa: E402
from memfit.train.checkpointing import (  # noqa: E402
    CheckpointError,
    capture_rng,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
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

    resumed = train(tiny_config(tmp_path / "run", **settings), resume=True, progress=False)
    assert resumed.status == "completed" and resumed.step == 8
    got, want = step_losses(tmp_path / "run"), step_losses(tmp_path / "clean")
    assert sorted(got) == sorted(want) == list(range(1, 9))
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-6, (step, got[step], want[step])
    evals = lambda d: [(r["step"], r["eval_loss"]) for r in read_metrics(d) if "eval_loss" in r]  # noqa: E731
    assert [s for s, _ in evals(tmp_path / "run")] == [s for s, _ in evals(tmp_path / "clean")]
    for (_, a), (_, b) in zip(evals(tmp_path / "run"), evals(tmp_path / "clean")):
        assert abs(a - b) <= 1e-6
    for (name, a), (_, b) in zip(resumed.model.named_parameters(), clean.model.named_parameters()):
        if a.requires_grad:
            assert torch.allclose(a, b, atol=1e-6, rtol=0), name


def test_sigterm_in_a_subprocess_saves_and_exits_cleanly(tmp_path):
    out = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(
        (REPO / "examples" / "tiny.yaml").read_text().replace("../src/memfit/assets/data/tiny-instruct.jsonl", str(DEMO_DATA))
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
    cmd = [sys.executable, "-c", script, "train", str(config), "--output-dir", str(out), "--max-steps", "100000", "--set", "log_every=1", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 90
        metrics = out / "metrics.jsonl"
        while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr
    assert "stopped by SIGTERM" in stderr and "--resume" in stderr
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
        run_dir, step, model=model, optimizer=opt, scheduler=None, grad_scaler=None,
        data_state={"epoch": 0, "position": step}, rng_state=capture_rng(CPU), reason="interval", keep=keep,
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
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "step-00000004").iterdir()) == ["meta.json", "state.pt", "trainable.safetensors"]
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
        load_checkpoint(path, model=wrong, optimizer=torch.optim.AdamW([wrong.a]), scheduler=None, grad_scaler=None, device=CPU)
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


def test_resume_with_other_batch_or_rank_is_refused(tmp_path):
    from memfit.train.recipe import TrainError

    train(tiny_config(tmp_path / "run", max_steps=2), progress=False)
    with pytest.raises(TrainError, match="batch_size: saved 4, now 2"):
        train(tiny_config(tmp_path / "run", max_steps=4, batch_size=2), resume=True, progress=False)
    with pytest.raises(TrainError, match="does not fit this model|shape"):
        train(tiny_config(tmp_path / "run", max_steps=4, rank=8), resume=True, progress=False)
