"""What a run shows and logs as it goes: the live progress bar, ``metrics.jsonl``, throughput.

Rank 0 (or the only process) shows and writes; the other ranks of a multi-GPU run get the
:class:`NullLog` and no progress bar.
"""

from __future__ import annotations

import json
import time
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


class NullLog:
    """Stands in for :class:`MetricsLog` on ranks other than 0."""

    def __enter__(self) -> "NullLog":
        return self

    def write(self, record: dict[str, Any]) -> None:
        pass

    def __exit__(self, *exc) -> None:
        pass


class MetricsLog:
    """Appends one JSON object a line to ``metrics.jsonl``; mirrors scalars to TensorBoard when the
    ``tensorboard`` package is installed."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / METRICS_FILE
        self._file = None
        self._tb = None
        self._run_dir = run_dir

    def __enter__(self) -> "MetricsLog":
        self._file = open(self.path, "a", encoding="utf-8")
        import importlib.util

        if importlib.util.find_spec("tensorboard") is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self._run_dir / "tensorboard"))
        return self

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        # Flushed every line: after a crash the metrics up to the crash are on disk.
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])

    def __exit__(self, *exc) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


class LiveProgress:
    """A Rich progress bar: step, loss, tokens/s and memory."""

    def __init__(self, console, total: int, start: int, enabled: bool = True):
        self.console, self.total, self.start, self.enabled = console, total, start, enabled
        self._progress = None
        self._task = None

    def __enter__(self) -> "LiveProgress":
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
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=False,
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
        self._progress.update(self._task, completed=step, info=info)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)
