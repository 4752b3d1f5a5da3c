"""memfit train on Hub datasets (served by the local Hub), end to end: a dataset id, a mix, a stream
that resumes exactly, the cache offline, and every refusal before the model is loaded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import yaml

pytest.importorskip("datasets")
torch = pytest.importorskip("torch")

from hub_datasets import CHAT, GATED_DATA, PAIRS, VISION, VISION_EXAMPLE, set_datasets_offline  # noqa: E402
from trainer_helpers import DEMO_DATA, read_metrics, step_losses, tiny_config, tiny_settings  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from memfit.cli import app  # noqa: E402
from memfit.step import train_step as step_module  # noqa: E402
from memfit.train.recipe import train  # noqa: E402

runner = CliRunner()


def train_cli(tmp_path, out: str = "run", **changes):
    settings = tiny_settings(tmp_path / out, max_steps=2, **changes)
    path = tmp_path / f"{out}.yaml"
    path.write_text(yaml.safe_dump(settings))
    result = runner.invoke(app, ["train", str(path), "--no-progress"])
    assert "Traceback" not in result.output, result.output
    return result


def run_record(tmp_path, out: str = "run") -> dict:
    return json.loads((tmp_path / out / "run.json").read_text())


def test_a_new_user_trains_on_a_hub_dataset_id(data_hub, tmp_path):
    result = train_cli(tmp_path, data=CHAT)
    assert result.exit_code == 0, result.output
    run = run_record(tmp_path)
    assert run["status"] == "completed" and run["step"] == 2
    assert run["data"]["data"] == [
        {"path": CHAT, "subset": None, "split": None, "revision": None, "commit": data_hub.commits[CHAT]}
    ]


def test_a_vision_language_model_trains_on_a_hub_dataset_of_pictures(data_hub, tmp_path):
    # The pictures come in the rows (a datasets Image feature), not as paths next to a local file.
    settings = {
        "model": str(VISION_EXAMPLE / "config.json"),
        "init": "random",
        "data": VISION,
        "images": 1,
        "method": "lora",
        "rank": 4,
        "precision": "fp32",
        "batch_size": 2,
        "seq_len": 64,
        "max_steps": 2,
        "device": "cpu",
        "output_dir": str(tmp_path / "run"),
        "seed": 0,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(settings))
    result = runner.invoke(app, ["train", str(path), "--no-progress"])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    run = run_record(tmp_path)
    assert run["status"] == "completed" and run["step"] == 2
    assert run["data"]["data"][0]["commit"] == data_hub.commits[VISION]


def test_a_mix_of_a_hub_dataset_and_a_local_file(data_hub, tmp_path):
    pairs = {
        "path": PAIRS,
        "subset": "easy",
        "split": "train_sft",
        "columns": {"prompt": "question", "completion": "answer"},
        "weight": 0.7,
    }
    result = train_cli(
        tmp_path, data=[pairs, {"path": str(DEMO_DATA), "weight": 0.3}], eval_data={"path": CHAT, "split": "test"}
    )
    assert result.exit_code == 0, result.output
    record = run_record(tmp_path)["data"]
    assert [entry["commit"] for entry in record["data"]] == [data_hub.commits[PAIRS], None]
    assert record["eval_data"][0]["commit"] == data_hub.commits[CHAT] and record["streaming"] is False


def _interrupt_after(monkeypatch, n_steps: int, real_step):
    """The process signals itself right after the ``n_steps``-th step from now, like a user pressing Ctrl-C."""
    calls = {"n": 0}

    def step_then_signal(*args, **kwargs):
        out = real_step(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == n_steps:
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(step_module, "train_step", step_then_signal)


def test_a_streamed_run_resumes_exactly(data_hub, tmp_path, monkeypatch):
    # 8 examples a step from a stream of 64 rows: the stream ends after step 8 and starts again.
    # The second interruption (after step 9) comes after that, with the shuffle buffer part full.
    settings = dict(
        data=CHAT,
        streaming=True,
        max_steps=10,
        batch_size=4,
        grad_accum=2,
        shuffle_buffer_size=16,
        dropout=0.1,
        warmup_steps=2,
        eval_data={"path": CHAT, "split": "test"},
        eval_every=4,
    )
    clean = train(tiny_config(tmp_path / "clean", **settings), progress=False)
    assert clean.status == "completed"

    real_step = step_module.train_step
    _interrupt_after(monkeypatch, 3, real_step)
    first = train(tiny_config(tmp_path / "run", **settings), progress=False)
    assert first.status == "interrupted" and first.step == 3
    _interrupt_after(monkeypatch, 6, real_step)
    second = train(tiny_config(tmp_path / "run", **settings), resume=True, progress=False)
    assert second.status == "interrupted" and second.step == 9
    monkeypatch.setattr(step_module, "train_step", real_step)
    resumed = train(tiny_config(tmp_path / "run", **settings), resume=True, progress=False)
    assert resumed.status == "completed" and resumed.step == 10

    got, want = step_losses(tmp_path / "run"), step_losses(tmp_path / "clean")
    assert sorted(got) == sorted(want) == list(range(1, 11))
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-6, (step, got[step], want[step])
    evals = lambda d: [(r["step"], r["eval_loss"]) for r in read_metrics(d) if "eval_loss" in r]  # noqa: E731
    assert [s for s, _ in evals(tmp_path / "run")] == [s for s, _ in evals(tmp_path / "clean")] == [4, 8, 10]
    assert [loss for _, loss in evals(tmp_path / "run")] == pytest.approx(
        [loss for _, loss in evals(tmp_path / "clean")], abs=1e-6
    )
    state = torch.load(tmp_path / "run" / "checkpoints" / "step-00000009" / "state.pt", weights_only=True)
    assert state["data"]["stream"] and state["data"]["epoch"] == 1 and len(state["data"]["buffer"]) > 0
    # A stream has no length: its epoch is the share of max_steps done, as the Trainer counts it for such data.
    assert all(r["epoch"] == r["step"] / 10 for r in read_metrics(tmp_path / "run"))
    # Two resumes later, the run's train_loss is still the mean over all 10 steps.
    assert resumed.metrics["train_loss"] == pytest.approx(clean.metrics["train_loss"], abs=1e-6)
    assert clean.metrics["train_loss"] == pytest.approx(sum(want.values()) / 10, rel=1e-12)


def test_the_cache_serves_a_second_run_offline(data_hub, tmp_path, monkeypatch):
    assert train_cli(tmp_path, "online", data=CHAT).exit_code == 0
    data_hub.server.down()
    set_datasets_offline(monkeypatch)
    result = train_cli(tmp_path, "offline", data=CHAT)
    assert result.exit_code == 0, result.output
    assert (
        run_record(tmp_path, "offline")["data"]["data"][0]["commit"] is None
    )  # read from the cache, the Hub not asked


@pytest.mark.parametrize(
    "data, expected",
    [
        ("memfit-test/no-such-data", "data: 'memfit-test/no-such-data' is not a dataset on"),
        (
            {"path": CHAT, "split": "train_sft"},
            f"data: {CHAT}: no split 'train_sft'; its splits are train, test: set split: train",
        ),
        (
            {"path": CHAT, "columns": {"messages": "conversation"}},
            f"data: {CHAT}: columns: messages: no column 'conversation'",
        ),
        (GATED_DATA, f"data: {GATED_DATA} is gated: accept its terms at"),
    ],
    ids=["unknown-id", "missing-split", "missing-column", "gated-without-token"],
)
@pytest.mark.parametrize("streaming", [False, True], ids=["in-memory", "streaming"])
def test_dataset_problems_stop_the_run_before_the_model_is_loaded(
    data_hub, tmp_path, monkeypatch, data, expected, streaming
):
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("memfit.train.recipe.load_model", no_model)
    result = train_cli(tmp_path, data=data, streaming=streaming)
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {expected}"), result.output
    assert result.output.strip().endswith(errors[0].split()[-1])  # the one line is the whole of the error


def test_a_stream_without_max_steps_is_refused_in_one_line(tmp_path):
    settings = tiny_settings(tmp_path / "run", data=CHAT, streaming=True)
    del settings["max_steps"]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(settings))
    result = runner.invoke(app, ["train", str(path)])
    assert result.exit_code == 2
    assert (
        "streaming: true needs max_steps: a stream has no length to count epochs in. Add max_steps: N" in result.output
    )


def test_planning_imports_no_datasets():
    code = (
        "import sys; from typer.testing import CliRunner; from memfit.cli import app; "
        "result = CliRunner().invoke(app, ['plan', 'smollm2-135m', '--seq-len', '64']); "
        "assert result.exit_code == 0, result.output; print('datasets' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == "False"
