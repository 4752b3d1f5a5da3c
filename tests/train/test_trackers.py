"""``report_to``: TensorBoard, W&B and MLflow get the run's configuration and every metrics record
once, under the Trainer's names, from rank 0 only, and a resumed run continues their runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
from trainer_helpers import REPO, read_metrics, tiny_settings

from memfit.train import trackers
from memfit.train.config import ConfigError, validate_config
from memfit.train.trackers import (
    TRACKERS_FILE,
    Positions,
    Trackers,
    flat_params,
    parse_report_to,
    prefixed,
    report_to_problems,
    resolve_report_to,
    trainer_metrics,
)

WORKER = Path(__file__).with_name("distributed_worker.py")
INSTALLED = tuple(name for name in trackers.INTEGRATIONS if not trackers.missing_modules(name))


def _installed(name: str) -> None:
    if name not in INSTALLED:
        pytest.skip(f"{name} is not installed ({trackers.required_modules(name)[1]})")


def _hide(monkeypatch, *modules: str) -> None:
    """Make ``modules`` look not installed to the checks."""
    real = trackers._find_spec
    monkeypatch.setattr(trackers, "_find_spec", lambda module: None if module in modules else real(module))


# ------------------------------------------------------------------------------------------------
# What report_to takes


@pytest.mark.parametrize(
    "given, names",
    [
        (None, []),
        ("none", []),
        (["none"], []),
        ("None", []),
        ("all", ["all"]),
        ("wandb", ["wandb"]),
        (["tensorboard", "wandb"], ["tensorboard", "wandb"]),
        ("tensorboard, wandb", ["tensorboard", "wandb"]),
        (["tensorboard,mlflow", "wandb"], ["tensorboard", "mlflow", "wandb"]),
        (["wandb", "WandB"], ["wandb"]),
    ],
)
def test_report_to_takes_what_the_trainer_takes(given, names):
    assert parse_report_to(given) == names


@pytest.mark.parametrize("given", ["tensorboard,,wandb", "wandb,", ["tensorboard", ""], ""])
def test_an_empty_name_in_report_to_is_refused_not_dropped(tmp_path, given):
    from trainer_helpers import tiny_settings

    from memfit.train.config import ConfigError, validate_config

    with pytest.raises(ValueError, match="has an empty name"):
        parse_report_to(given)
    with pytest.raises(
        ConfigError, match=r"report_to: .*: has an empty name \(two commas in a row, or one at an end\)"
    ):
        validate_config(tiny_settings(tmp_path / "run", report_to=given))


def test_report_to_problems_name_the_field_the_value_and_the_fix(monkeypatch):
    assert report_to_problems(["tensorbord"]) == [
        "report_to: 'tensorbord' is not one of tensorboard, wandb, mlflow, none, all. Did you mean 'tensorboard'?"
    ]
    (mixed,) = report_to_problems(["all", "tensorboard"])
    assert mixed.startswith("report_to: ['all', 'tensorboard']: none and all stand alone")
    _hide(monkeypatch, "wandb")
    (missing,) = report_to_problems(["wandb"])
    assert missing.startswith("report_to: wandb needs wandb, which is not installed: pip install wandb ")
    assert "memfit[wandb]" in missing
    assert report_to_problems([]) == [] and report_to_problems(["all"]) == []  # all: whatever is installed


def test_mlflow_needs_sqlalchemy_only_for_a_database_store(monkeypatch):
    _hide(monkeypatch, "sqlalchemy", "alembic")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # default: a SQLite file in the run folder
    assert {"sqlalchemy", "alembic"} <= set(trackers.missing_modules("mlflow", {}))
    (problem,) = [p for p in report_to_problems(["mlflow"]) if "sqlalchemy" in p]
    assert "pip install mlflow-skinny sqlalchemy alembic" in problem
    server = {"MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"}
    assert "sqlalchemy" not in trackers.missing_modules("mlflow", server)
    assert trackers.mlflow_tracking_uri(Path("/runs/a"), {}) == "sqlite:////runs/a/mlflow.db"
    assert trackers.mlflow_tracking_uri(Path("/runs/a"), server) == "http://127.0.0.1:5000"


def test_all_is_every_installed_integration(monkeypatch):
    _hide(monkeypatch, "wandb", "mlflow")
    assert resolve_report_to(["all"]) == (("tensorboard",) if "tensorboard" in INSTALLED else ())
    assert resolve_report_to([]) == ()
    assert resolve_report_to(["mlflow", "tensorboard"]) == ("mlflow", "tensorboard")


def test_the_config_field_and_its_problems(tmp_path, monkeypatch):
    assert validate_config(tiny_settings(tmp_path / "a")).report_to == []
    assert validate_config(tiny_settings(tmp_path / "a", report_to="none")).report_to == []
    assert validate_config(tiny_settings(tmp_path / "a", report_to="all")).report_to == ["all"]
    _hide(monkeypatch, "wandb")
    with pytest.raises(ConfigError) as err:
        validate_config(tiny_settings(tmp_path / "a", report_to=["wandb", "mlfow"]))
    problems = err.value.problems
    assert any(p.startswith("report_to: 'mlfow' is not one of") and "Did you mean 'mlflow'?" in p for p in problems)
    assert any(p.startswith("report_to: wandb needs wandb") for p in problems)
    with pytest.raises(ConfigError) as err:
        validate_config(tiny_settings(tmp_path / "a", report_to={"wandb": True}))
    assert err.value.problems[0].startswith("report_to: {'wandb': True}:")


def test_the_command_line_refuses_before_any_work(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from memfit.cli import app

    _hide(monkeypatch, "wandb")
    out = tmp_path / "run"
    tiny = str(REPO / "examples" / "tiny.yaml")
    for flags, expected in [
        (["--report-to", "wandb"], "report_to: wandb needs wandb, which is not installed: pip install wandb"),
        (["--report-to", "tensorboard,wandbb"], "report_to: 'wandbb' is not one of"),
    ]:
        result = CliRunner().invoke(app, ["train", tiny, "-o", str(out), *flags])
        assert result.exit_code == 2, result.output
        text = " ".join(result.output.split())
        assert expected in text and "Traceback" not in result.output
        assert not out.exists()  # refused before the run folder, the data or the model


# ------------------------------------------------------------------------------------------------
# Names and values


def test_names_are_the_trainers(monkeypatch):
    record = {"step": 7, "loss": 2.5, "lr": 1e-3, "grad_norm": None, "tokens": 64, "tokens_per_second": 900.0}
    metrics = trainer_metrics(record)
    assert metrics == {"loss": 2.5, "learning_rate": 1e-3, "tokens": 64.0, "tokens_per_second": 900.0}
    assert trainer_metrics({"step": 7, "eval_loss": 2.0}) == {"eval_loss": 2.0}
    pytest.importorskip("transformers")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the module prints a line at import in offline mode
    from transformers.integrations.integration_utils import rewrite_logs

    both = {**metrics, "eval_loss": 2.0}
    assert prefixed(both) == rewrite_logs(both)
    assert {"train/loss", "train/learning_rate", "eval/loss"} <= set(prefixed(both))


def test_records_of_a_step_keep_their_order():
    positions = Positions()
    records = [
        {"step": 3, "loss": 1.0},
        {"step": 3, "eval_loss": 1.0},
        {"step": 3, "eval_samples": 2},
        {"step": 4, "loss": 1.0},
    ]
    assert [positions.of(r) for r in records] == [(3, 0), (3, 1), (3, 2), (4, 0)]


def test_flat_params():
    params = flat_params(
        {
            "config": {"lr": 0.01, "targets": ["q_proj"], "model": "m", "gpu": None},
            "plan": None,
            "big": "x" * 7000,
            "odd(name)": 1,
        }
    )
    assert params == {
        "config.lr": "0.01",
        "config.targets": '["q_proj"]',
        "config.model": "m",
        "config.gpu": "null",
        "plan": "null",
        "odd_name_": "1",
    }


# ------------------------------------------------------------------------------------------------
# Trackers: each record once, across resumes and failures (recording trackers)


class _Recording:
    """A tracker that keeps what it was sent (class-level, so the test can read it)."""

    sent: ClassVar[list] = []
    starts: ClassVar[list] = []
    fail_start = False
    fail_at_step: int | None = None

    def start(self, run_dir, config, state):
        if self.fail_start:
            raise RuntimeError("no login")
        self.starts.append(state)
        return {"id": (state or {}).get("id") or "run-1"}

    def where(self, run_dir):
        return "recording"

    def log(self, step, metrics):
        if step == self.fail_at_step:
            raise ConnectionError("server went away")
        self.sent.append((step, dict(metrics)))

    def finish(self, failed):
        self.sent.append(("finished", failed))


def _recording(**changes):
    return type("Recording", (_Recording,), {"sent": [], "starts": [], **changes})


def _open(run_dir, kind, lines=None):
    lines = lines if lines is not None else []
    return Trackers(
        run_dir, ["wandb"], {"config": {"lr": 0.1}}, say=lambda line: None, warn=lines.append, classes={"wandb": kind}
    )


def _write_metrics(run_dir, records):
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_resumed_run_sends_no_record_twice_and_a_new_tracker_gets_the_earlier_ones(tmp_path):
    first = _recording()
    log = _open(tmp_path, first)
    log.start()
    for step in (1, 2, 3, 4):
        log.send({"step": step, "loss": float(step), "lr": 0.1})
    log.send({"step": 4, "eval_loss": 9.0})
    log.finish(failed=True)
    assert [s for s, _ in first.sent[:-1]] == [1, 2, 3, 4, 4] and first.sent[-1] == ("finished", True)
    assert json.loads((tmp_path / TRACKERS_FILE).read_text())["wandb"] == {"id": "run-1", "reported": [4, 1]}

    # Resumed from the checkpoint at step 2: metrics.jsonl was cut there, steps 3 and 4 run again.
    _write_metrics(tmp_path, [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}])
    again = _recording()
    log = _open(tmp_path, again)
    log.start()
    assert again.starts == [{"id": "run-1", "reported": [4, 1]}]  # the same tracker run, continued
    for step in (3, 4, 5):
        log.send({"step": step, "loss": float(step)})
    assert [s for s, _ in again.sent] == [5]

    # A tracker new to the run (no state): the records metrics.jsonl holds, then the new ones.
    (tmp_path / TRACKERS_FILE).unlink()
    _write_metrics(tmp_path, [{"step": 1, "loss": 1.0}, {"step": 1, "eval_loss": 3.0}, "damaged", {"no": "step"}])
    fresh = _recording()
    log = _open(tmp_path, fresh)
    log.start()
    log.send({"step": 2, "loss": 2.0, "lr": 0.05})
    assert fresh.sent == [(1, {"loss": 1.0}), (1, {"eval_loss": 3.0}), (2, {"loss": 2.0, "learning_rate": 0.05})]


def test_a_failing_tracker_is_dropped_with_one_warning_and_caught_up_on_resume(tmp_path):
    lines = []
    flaky = _recording(fail_at_step=2)
    log = _open(tmp_path, flaky, lines)
    log.start()
    for step in (1, 2, 3):
        log.send({"step": step, "loss": float(step)})
    assert [s for s, _ in flaky.sent] == [1, "finished"]  # dropped at step 2, finished as failed
    assert len(lines) == 1 and "report_to: wandb failed at step 2 (ConnectionError: server went away)" in lines[0]
    _write_metrics(tmp_path, [{"step": s, "loss": float(s)} for s in (1, 2, 3)])
    healed = _recording()
    log = _open(tmp_path, healed)
    log.start()
    assert [s for s, _ in healed.sent] == [2, 3]

    lines.clear()
    log = _open(tmp_path, _recording(fail_start=True), lines)
    log.start()
    log.send({"step": 4, "loss": 4.0})
    log.finish()
    assert len(lines) == 1 and lines[0].startswith("report_to: wandb did not start (RuntimeError: no login)")
    assert json.loads((tmp_path / TRACKERS_FILE).read_text())["wandb"]["reported"] == [3, 0]  # kept for a resume


# ------------------------------------------------------------------------------------------------
# The real libraries, end to end: a tiny CPU run that crashes after its checkpoint, then resumes


def _offline_env(root: Path) -> dict[str, str]:
    """No network: W&B offline with its files under ``root``, MLflow in the run folder."""
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(root / "wandb-config"),
        "WANDB_CACHE_DIR": str(root / "wandb-cache"),
        "WANDB_DATA_DIR": str(root / "wandb-data"),
    }


_CLEARED = (
    "MLFLOW_TRACKING_URI",
    "MLFLOW_EXPERIMENT_NAME",
    "MLFLOW_EXPERIMENT_ID",
    "WANDB_DIR",
    "WANDB_RUN_ID",
    "WANDB_PROJECT",
    "WANDB_API_KEY",
)


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """Six steps with an eval at 3 and a checkpoint at 3: the first process reports to MLflow and
    W&B and crashes in step 5 (after logging step 4); the resumed one adds TensorBoard."""
    pytest.importorskip("torch")
    from memfit.step import train_step as step_module
    from memfit.train.recipe import train

    if not INSTALLED:
        pytest.skip("none of tensorboard, wandb, mlflow is installed")
    root = tmp_path_factory.mktemp("trackers")
    run_dir = root / "run"
    settings = dict(max_steps=6, save_every=3, eval_split=0.05, eval_every=3, log_every=1)
    first = [name for name in ("mlflow", "wandb") if name in INSTALLED]
    with pytest.MonkeyPatch.context() as mp:
        for name in _CLEARED:
            mp.delenv(name, raising=False)
        for name, value in _offline_env(root).items():
            mp.setenv(name, value)
        real_step, calls = step_module.train_step, {"n": 0}

        def crash_in_step_5(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 5:
                raise RuntimeError("the machine went away")
            return real_step(*args, **kwargs)

        mp.setattr(step_module, "train_step", crash_in_step_5)
        if first:
            with pytest.raises(RuntimeError, match="went away"):
                train(validate_config(tiny_settings(run_dir, report_to=first, **settings)), progress=False)
            assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [1, 2, 3, 4]
        else:
            settings["max_steps"] = 4
            train(validate_config(tiny_settings(run_dir, **settings)), progress=False)
            settings["max_steps"] = 6
        mp.setattr(step_module, "train_step", real_step)
        result = train(
            validate_config(tiny_settings(run_dir, report_to=list(INSTALLED), **settings)), resume=True, progress=False
        )
    assert result.status == "completed" and result.step == 6
    return run_dir


def _expected(run_dir: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(run_dir) if key in r}


def _assert_once_each(pairs: list[tuple[int, float]], want: dict[int, float]) -> None:
    steps = [step for step, _ in pairs]
    assert sorted(steps) == sorted(want), pairs  # every step, none twice
    for step, value in pairs:
        assert value == pytest.approx(want[step], rel=1e-5), (step, value, want[step])


@pytest.mark.slow
def test_metrics_jsonl_has_each_step_once(resumed_run):
    assert sorted(_expected(resumed_run, "loss")) == [1, 2, 3, 4, 5, 6]
    assert sorted(_expected(resumed_run, "eval_loss")) == [3, 6]


@pytest.mark.slow
def test_tensorboard_event_files_hold_every_scalar(resumed_run):
    _installed("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(resumed_run / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"train/loss", "train/learning_rate", "train/grad_norm", "train/tokens_per_second", "eval/loss"} <= set(
        scalars
    )
    # TensorBoard was named only on resume: the records before the checkpoint came from metrics.jsonl.
    _assert_once_each([(e.step, e.value) for e in events.Scalars("train/loss")], _expected(resumed_run, "loss"))
    _assert_once_each([(e.step, e.value) for e in events.Scalars("eval/loss")], _expected(resumed_run, "eval_loss"))
    _assert_once_each([(e.step, e.value) for e in events.Scalars("train/learning_rate")], _expected(resumed_run, "lr"))
    assert "run_config/text_summary" in events.Tags()["tensors"]


@pytest.mark.slow
def test_mlflow_store_in_the_run_folder_has_the_params_and_the_metric_history(resumed_run):
    _installed("mlflow")
    from mlflow.tracking import MlflowClient

    state = json.loads((resumed_run / TRACKERS_FILE).read_text())["mlflow"]
    assert state["tracking_uri"] == f"sqlite:///{resumed_run.resolve() / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=state["tracking_uri"])
    (run,) = client.search_runs(experiment_ids=["0"])  # the resumed process continued the same run
    assert run.info.run_id == state["run_id"] and run.info.status == "FINISHED"
    assert run.info.run_name == resumed_run.name
    run_json = json.loads((resumed_run / "run.json").read_text())
    assert run.data.params["config.lr"] == json.dumps(run_json["config"]["lr"])
    assert run.data.params["config.rank"] == "4" and run.data.params["spec.method"] == "lora"
    assert run.data.params["model_config.num_hidden_layers"] == "2"
    history = {
        key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        for key in ("loss", "learning_rate", "eval_loss", "tokens_per_second")
    }
    _assert_once_each(history["loss"], _expected(resumed_run, "loss"))
    _assert_once_each(history["learning_rate"], _expected(resumed_run, "lr"))
    _assert_once_each(history["eval_loss"], _expected(resumed_run, "eval_loss"))
    assert [step for step, _ in history["tokens_per_second"]] == [1, 2, 3, 4, 5, 6]


def _wandb_records(path: Path):
    """The records of a W&B ``.wandb`` file: a LevelDB-style log (32 KiB blocks of chunks with a
    7-byte header: checksum, length, type) of protobuf ``Record`` messages after a 7-byte file header."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block  # the end of a block too short for a header is padding
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            yield wandb_internal_pb2.Record.FromString(pending)
            pending = b""


@pytest.mark.slow
def test_wandb_offline_run_holds_the_config_and_every_metric(resumed_run):
    _installed("wandb")
    run_id = json.loads((resumed_run / TRACKERS_FILE).read_text())["wandb"]["id"]
    files = sorted((resumed_run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [f.name for f in files] == [f"run-{run_id}.wandb"] * 2  # the crashed process, then the resumed one
    history, config = [], set()
    for path in files:
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                history.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
            elif kind == "config":
                config |= {item.key for item in record.config.update}
    assert {"config", "spec", "model_config", "setup", "versions"} <= config
    loss = [(h["train/global_step"], h["train/loss"]) for h in history if "train/loss" in h]
    _assert_once_each(loss, _expected(resumed_run, "loss"))
    evals = [(h["train/global_step"], h["eval/loss"]) for h in history if "eval/loss" in h]
    _assert_once_each(evals, _expected(resumed_run, "eval_loss"))
    assert all("train/learning_rate" in h for h in history if "train/loss" in h)


# ------------------------------------------------------------------------------------------------
# Several processes: rank 0 alone reports


@pytest.mark.slow
def test_only_rank_0_reports(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.distributed.is_available():  # pragma: no cover - depends on the build
        pytest.skip("this PyTorch has no torch.distributed")
    if not INSTALLED:
        pytest.skip("none of tensorboard, wandb, mlflow is installed")
    # Which ranks report is decided above the trackers (MetricsLog or NullLog): one is enough, the
    # quickest to start.
    names = ["tensorboard"] if "tensorboard" in INSTALLED else list(INSTALLED[:1])
    run_dir = tmp_path / "run"
    settings = tiny_settings(run_dir, gpus=2, shard="ddp", batch_size=2, max_steps=3, report_to=names)
    (tmp_path / "jobs.json").write_text(json.dumps([{"settings": settings}]))
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    env.update(
        _offline_env(tmp_path),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")]),
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(WORKER),
        str(tmp_path / "jobs.json"),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    assert set(json.loads((run_dir / TRACKERS_FILE).read_text())) == set(names)
    if "tensorboard" in names:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
        events = EventAccumulator(str(run_dir / "tensorboard"))
        events.Reload()
        assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    if "wandb" in names:
        assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1
    if "mlflow" in names:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.resolve() / 'mlflow.db'}")
        (run,) = client.search_runs(experiment_ids=["0"])
        assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3]
