"""What stops a run, handled so that it can go on: SIGINT / SIGTERM and running out of memory.

A signal asks the loop to stop after the current step and save a checkpoint; running out of
device memory frees what the failed step held, saves the run as it was before that step, and
explains what to change (:func:`handle_oom`).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from memfit.planner.search.run import Preflight
from memfit.train.errors import OutOfMemory
from memfit.train.preflight import oom_advice
from memfit.units import format_bytes


class StopOnSignal:
    """SIGINT / SIGTERM ask the loop to stop after the current step (and save); a second SIGINT
    stops at once. Handlers are installed only in the main thread and restored on exit."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None and name == "SIGINT":
            raise KeyboardInterrupt
        self.signal_name = name

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                signum = getattr(signal, name)
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def handle_oom(
    *,
    optimizer: torch.optim.Optimizer,
    step: int,
    save_before_step: Callable[[], Path | None],
    knobs: dict[str, Any],
    step_in_backward: bool,
    preflight: Preflight,
    replan: Callable[[], Any],
    device: torch.device,
    console: Any,
) -> OutOfMemory:
    """Free what the failed step held, save the run as it was before that step, explain what to change.

    ``save_before_step`` saves a checkpoint that replays the failed step (None when it cannot be
    taken, e.g. on one rank of a sharded run); ``replan`` plans the run when preflight did not.
    """
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    path = None
    if step_in_backward:
        # Some parameters were already updated inside the failed backward: the weights are neither
        # before nor after this step, so they are not saved; the last regular checkpoint stands.
        console.print(
            "step_in_backward: the failed step had already updated some weights; no emergency checkpoint "
            "is saved (continue from the last checkpoint with --resume)",
            highlight=False,
        )
    else:
        try:
            path = save_before_step()
        except Exception as err:  # noqa: BLE001 - the checkpoint is a courtesy; the OOM is the error to report
            console.print(f"[red]could not save an emergency checkpoint:[/] {err}", highlight=False)
    plan = preflight.plan
    if plan is None:
        try:
            plan = replan()
        except Exception:  # noqa: BLE001 - planning is advice here; never mask the OOM
            plan = None
    if plan is not None:
        plan.render(console)
    lines = [f"out of device memory at step {step + 1} on {device}."]
    if path is not None:
        lines.append(
            f"Saved the run as it was before this step to {path}; after changing the config, continue with --resume"
        )
        lines.append("(keep batch_size x grad_accum, the examples a step takes: the data order then stays the same).")
    if plan is not None:
        lines.append(f"The plan predicts {format_bytes(plan.device_total_bytes)} at the peak ({plan.phase}).")
    lines.append("To use less memory:")
    lines += [f"  - {a}" for a in oom_advice(knobs)]
    return OutOfMemory("\n".join(lines), path, plan)
