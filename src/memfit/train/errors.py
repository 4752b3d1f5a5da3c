"""Why a training run cannot start or continue; each message says what to do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memfit.errors import EXIT_DOES_NOT_FIT, UserError


class TrainError(UserError, RuntimeError):
    """The run cannot start or continue; the message says why and what to do."""


class OutOfMemory(TrainError):
    """The device ran out of memory; an emergency checkpoint was saved (``checkpoint``)."""

    exit_code = EXIT_DOES_NOT_FIT

    def __init__(self, message: str, checkpoint: Path | None, plan: Any):
        self.checkpoint = checkpoint
        self.plan = plan
        super().__init__(message)


class DiskFull(TrainError):
    """The disk filled up while a checkpoint or the run's output was saved. What was being written
    is removed and what was saved before is whole; the message says how much was needed, how much is
    free, on which disk, and how to go on. Exit code 2, as for any full disk (a path problem)."""
