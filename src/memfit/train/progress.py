"""What a run shows and logs as it goes: the live progress bar, ``metrics.jsonl``, throughput.

Rank 0 (or the only process) shows, writes and reports to the trackers ``report_to`` names; the
other ranks of a multi-GPU run get the :class:`NullLog` and no progress bar.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from memfit.run_files import METRICS_FILE
from memfit.units import format_bytes


def warn(console: Any, finding: Any) -> None:
    """Print a watch finding (leak, stray device, switched-off optimisation...) with its fix."""
    color = "red" if finding.severity == "error" else "yellow"
    console.print(f"[{color}]{finding.severity}:[/] {finding.message} {finding.fix}", highlight=False)


class Throughput:
    """Tokens per second of the steps (batch collation and the step; logging and evaluation not)."""

    def __init__(self) -> None:
        self._t0 = 0.0
        self._last = (0, 0.0)
        self.tokens = 0
        self.seconds = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self, tokens: int) -> None:
        elapsed = time.perf_counter() - self._t0
        self._last = (tokens, elapsed)
        self.tokens += tokens
        self.seconds += elapsed

    def rate(self) -> float:
        tokens, seconds = self._last
        return tokens / seconds if seconds > 0 else 0.0

    def overall_rate(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


def end_of_run_metrics(
    *, runtime_s: float, samples: int, steps: int, loss_sum: float | None, steps_done: int
) -> dict[str, float]:
    """The figures the Hugging Face Trainer logs when training ends, named and rounded as it does
    (``speed_metrics``): ``train_runtime`` (``runtime_s``), ``train_samples_per_second`` and
    ``train_steps_per_second`` (the ``samples`` and ``steps`` trained in those seconds), and
    ``train_loss``, the mean step loss of the run's ``steps_done`` steps (``loss_sum`` their sum; a
    resumed run's covers the steps before the resume too; None: not known, left out). No
    ``total_flos``: its estimate, 6 x parameters x tokens, is not what a LoRA, checkpointed or
    preference step computes."""
    record: dict[str, float] = {"train_runtime": round(runtime_s, 4)}
    if runtime_s > 0:
        record["train_samples_per_second"] = round(samples / runtime_s, 3)
        record["train_steps_per_second"] = round(steps / runtime_s, 3)
    if loss_sum is not None and steps_done > 0:
        record["train_loss"] = loss_sum / steps_done
    return record


def with_epoch(record: dict[str, Any], epoch: float | None) -> dict[str, Any]:
    """``record`` with ``epoch`` after its step, as the Trainer adds it to every log (None: as it is)."""
    if epoch is None or "epoch" in record:
        return record
    return {"step": record["step"], "epoch": epoch, **record} if "step" in record else {"epoch": epoch, **record}


class NullLog:
    """Stands in for :class:`MetricsLog` on ranks other than 0."""

    epoch: float | None = None

    def __enter__(self) -> NullLog:
        return self

    def write(self, record: dict[str, Any]) -> None:
        pass

    def __exit__(self, *exc) -> None:
        pass


class MetricsLog:
    """Appends one JSON object a line to ``metrics.jsonl`` and sends each to the trackers
    ``report_to`` names (TensorBoard, W&B, MLflow: :mod:`memfit.train.trackers`), with the run's
    configuration ``run_config`` (what ``run.json`` holds). Every record gets the run's ``epoch``
    once the loop has set it (training, evaluation and end-of-run records alike, as the Trainer's)."""

    epoch: float | None = None

    def __init__(
        self,
        run_dir: Path,
        report_to: Iterable[str] = (),
        run_config: dict[str, Any] | None = None,
        console: Any = None,
    ):
        self.path = run_dir / METRICS_FILE
        self._file = None
        self._trackers = None
        self._run_dir = run_dir
        self._report_to = list(report_to)
        self._run_config = run_config or {}
        self._console = console

    def __enter__(self) -> MetricsLog:
        self._file = open(self.path, "a", encoding="utf-8")
        from memfit.train.trackers import Trackers, resolve_report_to

        names = resolve_report_to(self._report_to)
        if names:
            self._trackers = Trackers(self._run_dir, names, self._run_config, say=self._say, warn=self._warn)
            self._trackers.start()
        elif self._report_to == ["all"]:
            self._say(
                "report_to: all, but none of tensorboard, wandb, mlflow is installed: metrics go to metrics.jsonl only"
            )
        return self

    def write(self, record: dict[str, Any]) -> None:
        record = with_epoch(record, self.epoch)
        self._file.write(json.dumps(record) + "\n")
        # Flushed every line: after a crash the metrics up to the crash are on disk.
        self._file.flush()
        if self._trackers is not None:
            self._trackers.send(record)

    def __exit__(self, exc_type, *exc) -> None:
        self._file.close()
        if self._trackers is not None:
            self._trackers.finish(failed=exc_type is not None)

    def _say(self, line: str) -> None:
        if self._console is not None:
            self._console.print(line, highlight=False, markup=False, soft_wrap=True)

    def _warn(self, line: str) -> None:
        if self._console is not None:
            from rich.markup import escape

            self._console.print(f"[yellow]warning:[/] {escape(line)}", highlight=False, soft_wrap=True)


class LiveProgress:
    """A Rich progress bar: step, loss, tokens/s and memory."""

    def __init__(self, console, total: int, start: int, enabled: bool = True):
        self.console, self.total, self.start, self.enabled = console, total, start, enabled
        self._progress = None
        self._task = None

    def __enter__(self) -> LiveProgress:
        if not self.enabled:
            return self
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._progress.__enter__()
        self._task = self._progress.add_task("train", total=self.total, completed=self.start, info="")
        return self

    def update(self, step: int, record: dict[str, Any]) -> None:
        if self._progress is None:
            return
        memory = record.get("peak_allocated_bytes", record.get("rss_bytes"))
        label = "peak" if "peak_allocated_bytes" in record else "rss"
        info = f"loss {record['loss']:.4f}  {record['tokens_per_second']:.0f} tok/s  {label} {format_bytes(memory) if memory else '-'}"
        if "rewards/accuracies" in record:  # a preference run: how often the chosen answer wins
            info += f"  acc {record['rewards/accuracies']:.2f}  margin {record['rewards/margins']:.3f}"
        self._progress.update(self._task, completed=step, info=info)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)
