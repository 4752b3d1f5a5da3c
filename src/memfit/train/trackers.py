"""Where a run's metrics go besides ``metrics.jsonl``: TensorBoard, Weights & Biases, MLflow.

``report_to`` takes what the Hugging Face Trainer's does: ``none`` (the default), ``all`` (every
integration that is installed) or a list of ``tensorboard``, ``wandb``, ``mlflow``. Each goes
through its own library, imported only when the run reports to it: ``torch.utils.tensorboard``'s
``SummaryWriter``, ``wandb.init`` / ``log`` / ``finish``, MLflow's ``MlflowClient``. A tracker
gets the run's configuration (the dict ``run.json`` holds) once, and every ``metrics.jsonl`` record
at its step, named as the Trainer names it (:func:`trainer_metrics`, :func:`prefixed`).

What each tracker was sent is kept in ``trackers.json`` in the run folder: a resumed run continues
the same tracker run (W&B run id, MLflow run id, the same TensorBoard folder), sends no record a
second time, and sends a tracker that is new to the run, or that failed earlier, the records of
``metrics.jsonl`` it missed. A tracker that fails is dropped with a warning and the run goes on:
``metrics.jsonl`` keeps every record.

Importing this module imports none of the libraries: validating a config only asks whether they
are installed (:func:`report_to_problems`).
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from memfit.files import write_atomic
from memfit.run_files import METRICS_FILE

#: The integrations ``report_to`` can name, in the order ``all`` starts them.
INTEGRATIONS = ("tensorboard", "wandb", "mlflow")
#: What each tracker was sent, and which run of its own it writes to (ids, store).
TRACKERS_FILE = "trackers.json"
#: memfit's ``metrics.jsonl`` keys that the Trainer logs under another name.
TRAINER_KEYS = {"lr": "learning_rate"}
#: Where TensorBoard's event files go, inside the run folder.
TENSORBOARD_DIR = "tensorboard"

_WORDS = ("none", "all")
_DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
# MLflow refuses longer parameter values (MAX_PARAM_VAL_LENGTH) and more than 100 in one batch.
_MLFLOW_PARAM_CHARS = 6000
_MLFLOW_BATCH = 100


# ------------------------------------------------------------------------------------------------
# What report_to names (pure, no library imported)


def parse_report_to(value: Any) -> Any:
    """``report_to`` as YAML or flags give it -> a list of names: ``none`` / ``null`` -> ``[]``, a
    string (``wandb``, ``tensorboard,wandb``) or a list of them -> the names, lower case, once each.
    An empty name (``tensorboard,,wandb``, a comma at an end) is a ``ValueError``: a slip of the
    keyboard, not a name. Anything else is returned as it is, for the type check to name."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(item, str) for item in items):
        return value
    names: list[str] = []
    for item in items:
        for part in item.split(","):
            name = part.strip().lower()
            if not name:
                raise ValueError(
                    "has an empty name (two commas in a row, or one at an end): write names separated "
                    "by commas, e.g. report_to: tensorboard,wandb, or report_to: none"
                )
            if name not in names:
                names.append(name)
    return [] if names == ["none"] else names


def mlflow_tracking_uri(run_dir: Path, env: Mapping[str, str] | None = None) -> str:
    """Where MLflow stores the run: ``MLFLOW_TRACKING_URI``, else a SQLite database in the run
    folder (MLflow's own default, ``sqlite:///mlflow.db``, kept with the run it belongs to)."""
    env = os.environ if env is None else env
    return env.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"


def required_modules(name: str, env: Mapping[str, str] | None = None) -> tuple[tuple[str, ...], str]:
    """The modules integration ``name`` imports here, and the pip command that installs them."""
    if name != "mlflow":
        return (name,), f"pip install {name}"
    env = os.environ if env is None else env
    scheme = (env.get("MLFLOW_TRACKING_URI") or "sqlite:").split(":", 1)[0].split("+", 1)[0].lower()
    if scheme in _DATABASE_SCHEMES:  # MLflow's SQL store needs these beside mlflow-skinny
        return ("mlflow", "sqlalchemy", "alembic"), "pip install mlflow-skinny sqlalchemy alembic"
    return ("mlflow",), "pip install mlflow-skinny"


def missing_modules(name: str, env: Mapping[str, str] | None = None) -> list[str]:
    """The modules integration ``name`` needs that are not installed."""
    modules, _ = required_modules(name, env)
    return [module for module in modules if _find_spec(module) is None]


def _find_spec(module: str) -> Any:
    return importlib.util.find_spec(module)


def report_to_problems(names: list[str], env: Mapping[str, str] | None = None) -> list[str]:
    """One line for each problem of a parsed ``report_to``: an unknown name (with "did you mean"),
    ``none`` or ``all`` beside other names, an integration that is not installed (with the pip
    command). Cheap: nothing is imported."""
    known = INTEGRATIONS + _WORDS
    problems = []
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            problems.append(f"report_to: {name!r} is not one of {', '.join(known)}.{hint}")
    if len(names) > 1 and set(names) & set(_WORDS):
        problems.append(
            f"report_to: {names}: none and all stand alone; write report_to: all, or list the "
            "integrations, e.g. report_to: [tensorboard, wandb]"
        )
    for name in names:
        missing = missing_modules(name, env) if name in INTEGRATIONS else []
        if missing:
            problems.append(
                f"report_to: {name} needs {', '.join(missing)}, which is not installed: "
                f"{required_modules(name, env)[1]} (memfit's extra: pip install 'memfit[{name}]'), "
                "or remove it from report_to"
            )
    return problems


def resolve_report_to(names: Iterable[str], env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The integrations a run reports to: ``all`` is every installed one (as the Trainer does)."""
    names = list(names)
    if names == ["all"]:
        return tuple(name for name in INTEGRATIONS if not missing_modules(name, env))
    return tuple(name for name in names if name in INTEGRATIONS)


# ------------------------------------------------------------------------------------------------
# Names and values (pure)


def trainer_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """The scalars of a ``metrics.jsonl`` record (not its step), named as the Trainer logs them
    (``lr`` -> ``learning_rate``; ``loss``, ``grad_norm``, ``eval_loss``... as they are). What
    MLflow gets."""
    out = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # a missing grad_norm (no clipping) is null: nothing to plot
        out[TRAINER_KEYS.get(key, key)] = float(value)
    return out


def prefixed(metrics: Mapping[str, float]) -> dict[str, float]:
    """The Trainer's TensorBoard and W&B names (transformers' ``rewrite_logs``): ``eval_loss`` ->
    ``eval/loss``, ``test_x`` -> ``test/x``, everything else ``train/<name>``."""
    out = {}
    for key, value in metrics.items():
        if key.startswith("eval_"):
            out["eval/" + key[len("eval_") :]] = value
        elif key.startswith("test_"):
            out["test/" + key[len("test_") :]] = value
        else:
            out["train/" + key] = value
    return out


class Positions:
    """Where each record stands in the run: (its step, how many records of that step came before
    it). The loop writes a step's records in the same order every time (training, then evaluation),
    so a step trained again after a resume gives its records the positions they had; a tracker that
    was sent a position is not sent it, or anything before it, again."""

    def __init__(self) -> None:
        self._step, self._index = None, 0

    def of(self, record: Mapping[str, Any]) -> tuple[int, int]:
        step = int(record["step"])
        self._index = self._index + 1 if step == self._step else 0
        self._step = step
        return step, self._index


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested configuration as MLflow parameters: ``{"config": {"lr": 0.01}}`` ->
    ``{"config.lr": "0.01"}``; lists and values as JSON, text as it is. Values MLflow refuses
    (longer than 6,000 characters) are left out: ``run.json`` holds them."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = _mlflow_name(f"{prefix}{key}")
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, prefix=f"{name}."))
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        if len(text) <= _MLFLOW_PARAM_CHARS:
            out[name] = text
    return out


def _mlflow_name(name: str) -> str:
    # The characters MLflow allows in names (the Trainer's MLflowCallback replaces the same ones).
    return re.sub(r"[^0-9A-Za-z_\-. :/]", "_", name)


def _jsonable(config: Mapping[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(dict(config), default=str))


# ------------------------------------------------------------------------------------------------
# The integrations


class TensorBoardTracker:
    """Scalars to ``<run>/tensorboard`` with ``SummaryWriter``; the configuration as text."""

    name = "tensorboard"

    def start(self, run_dir: Path, config: Mapping[str, Any], state: dict[str, Any] | None) -> dict[str, Any]:
        from torch.utils.tensorboard import SummaryWriter

        reported = (state or {}).get("reported")
        # A resumed run writes to the same folder; events an earlier process wrote past what it
        # recorded as sent are hidden from TensorBoard (purge_step), so no step shows twice.
        purge = reported[0] + 1 if reported else None
        self.writer = SummaryWriter(str(run_dir / TENSORBOARD_DIR), purge_step=purge)
        self.writer.add_text("run_config", json.dumps(_jsonable(config), indent=2), global_step=purge or 0)
        return {"log_dir": TENSORBOARD_DIR}

    def where(self, run_dir: Path) -> str:
        return f"TensorBoard in {run_dir / TENSORBOARD_DIR} (tensorboard --logdir {run_dir / TENSORBOARD_DIR})"

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in prefixed(metrics).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # on disk before trackers.json says it was sent

    def finish(self, failed: bool) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run (``WANDB_PROJECT``, default ``memfit``; named after the run folder; files in
    ``<run>/wandb`` unless ``WANDB_DIR`` says otherwise), resumed by its id. ``WANDB_MODE=offline``
    needs no network."""

    name = "wandb"

    def start(self, run_dir: Path, config: Mapping[str, Any], state: dict[str, Any] | None) -> dict[str, Any]:
        import wandb

        # A new run takes WANDB_RUN_ID, else an id wandb makes; a resumed one the id it had.
        run_id = (state or {}).get("id")
        where = {} if os.environ.get("WANDB_DIR") else {"dir": str(run_dir)}
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "memfit"),
            name=run_dir.name,
            id=run_id,
            resume="allow",
            reinit="create_new",
            **where,
        )
        self.run.config.update(_jsonable(config), allow_val_change=True)  # a resume may change some
        # The Trainer's x-axis: every metric against train/global_step.
        self.run.define_metric("train/global_step")
        self.run.define_metric("*", step_metric="train/global_step", step_sync=True)
        return {"id": self.run.id}

    def where(self, run_dir: Path) -> str:
        return f"W&B run {self.run.id} ({self.run.settings.mode}, files in {self.run.dir})"

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log({**prefixed(metrics), "train/global_step": step})

    def finish(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowTracker:
    """An MLflow run in ``MLFLOW_TRACKING_URI``, else in ``<run>/mlflow.db`` (experiment
    ``MLFLOW_EXPERIMENT_NAME``, else MLflow's default), named after the run folder; the
    configuration as flattened parameters. Through ``MlflowClient``, so the caller's own active
    MLflow run and tracking URI are left alone."""

    name = "mlflow"

    def start(self, run_dir: Path, config: Mapping[str, Any], state: dict[str, Any] | None) -> dict[str, Any]:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.uri = mlflow_tracking_uri(run_dir)
        self.client = MlflowClient(tracking_uri=self.uri)
        state = state or {}
        if state.get("tracking_uri") == self.uri and state.get("run_id"):
            self.run_id = state["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:  # a new run, or the store changed since: a new MLflow run there
            self.run_id = self.client.create_run(self._experiment_id(), run_name=run_dir.name).info.run_id
        # Parameters cannot change once logged: a resumed run adds only the ones it did not have.
        logged = self.client.get_run(self.run_id).data.params
        params = [Param(key, value) for key, value in flat_params(_jsonable(config)).items() if key not in logged]
        for first in range(0, len(params), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=params[first : first + _MLFLOW_BATCH], synchronous=True)
        return {"tracking_uri": self.uri, "run_id": self.run_id}

    def _experiment_id(self) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            return os.environ.get("MLFLOW_EXPERIMENT_ID", "0")
        found = self.client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else self.client.create_experiment(name)

    def where(self, run_dir: Path) -> str:
        return f"MLflow run {self.run_id} in {self.uri} (mlflow ui --backend-store-uri {self.uri})"

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        batch = [Metric(_mlflow_name(key), value, now_ms, step) for key, value in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch, synchronous=True)

    def finish(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


TRACKER_CLASSES: dict[str, Callable[[], Any]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}


# ------------------------------------------------------------------------------------------------
# The trackers of one run


class Trackers:
    """The trackers ``report_to`` names for the run in ``run_dir``: started together, sent each
    metrics record, finished together; what each was sent is kept in ``trackers.json``.

    ``say`` prints a line (where each tracker writes); ``warn`` one about a tracker that failed and
    was dropped. ``classes`` replaces the integrations (tests)."""

    def __init__(
        self,
        run_dir: Path,
        names: Iterable[str],
        run_config: Mapping[str, Any],
        *,
        say: Callable[[str], None] = print,
        warn: Callable[[str], None] = print,
        classes: Mapping[str, Callable[[], Any]] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.names = tuple(names)
        self.run_config = run_config
        self.say, self.warn = say, warn
        self.classes = dict(classes or TRACKER_CLASSES)
        self.path = self.run_dir / TRACKERS_FILE
        self.active: dict[str, Any] = {}
        self.state: dict[str, dict[str, Any]] = {}
        self.positions = Positions()

    def start(self) -> None:
        """Start each tracker (continuing its run where ``trackers.json`` names one), then send it
        the records of ``metrics.jsonl`` it has not had."""
        self.state = _read_state(self.path)
        for name in self.names:
            before = self.state.get(name) or {}
            tracker = self.classes[name]()
            try:
                ids = tracker.start(self.run_dir, self.run_config, before or None)
                where = tracker.where(self.run_dir)
            except Exception as err:  # noqa: BLE001 - any library error: the run goes on without it
                self.warn(
                    f"report_to: {name} did not start ({_one_line(err)}); metrics.jsonl has every record, "
                    "and --resume sends this tracker the ones it missed"
                )
                continue
            continued = all(before.get(key) == value for key, value in ids.items())
            self.state[name] = {**ids, "reported": before.get("reported") if continued else None}
            self.active[name] = tracker
            self.say(f"reporting to {where}")
        self._save()
        for record in _read_records(self.run_dir / METRICS_FILE):
            self.send(record)

    def send(self, record: Mapping[str, Any]) -> None:
        """Send one ``metrics.jsonl`` record to each tracker that has not had it."""
        if not self.active or not isinstance(record.get("step"), int):
            return
        position = self.positions.of(record)
        metrics = trainer_metrics(record)
        sent = False
        for name, tracker in list(self.active.items()):
            reported = self.state[name].get("reported")
            if reported is not None and tuple(reported) >= position:
                continue  # sent before a resume, or by the backfill
            try:
                if metrics:
                    tracker.log(position[0], metrics)
            except Exception as err:  # noqa: BLE001
                self._drop(name, f"failed at step {position[0]} ({_one_line(err)})")
                continue
            self.state[name]["reported"] = list(position)
            sent = True
        if sent:
            self._save()

    def finish(self, failed: bool = False) -> None:
        """Finish every tracker's run (``failed``: the run ended by an error)."""
        for name, tracker in list(self.active.items()):
            try:
                tracker.finish(failed)
            except Exception as err:  # noqa: BLE001
                self.warn(f"report_to: {name} did not finish cleanly ({_one_line(err)})")
        self.active.clear()

    def _drop(self, name: str, why: str) -> None:
        self.warn(
            f"report_to: {name} {why}; it gets nothing more in this process (metrics.jsonl has every "
            "record, and --resume sends it the ones it missed)"
        )
        tracker = self.active.pop(name)
        try:
            tracker.finish(True)
        except Exception:  # noqa: BLE001 - already failing: the first error is the one to report
            pass

    def _save(self) -> None:
        write_atomic(self.path, json.dumps(self.state, indent=2) + "\n")


def _read_state(path: Path) -> dict[str, dict[str, Any]]:
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in state.items() if isinstance(v, dict)} if isinstance(state, dict) else {}


def _read_records(path: Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` (a damaged line is skipped: trackers only plot them)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:300]}" if text else type(err).__name__
