"""Record a run's memory step by step into ``memory.jsonl``, and warn while it runs.

Used by memfit's trainer and by :class:`memfit.watch.MemoryCallback` (Hugging Face ``Trainer``);
any loop can use it::

    recorder = MemoryRecorder(run_dir, plan=plan, expected_device="cuda:1", total_steps=1000)
    recorder.inspect(model, spec)                      # settings that silently cost memory
    for step in range(1000):
        if step == 0:
            recorder.attribute(model, optimizer)       # measure categories on the first steps
        loss, _ = train_step(model, batches, optimizer, observer=recorder.observer)
        for finding in recorder.end_step(step + 1, {"loss": float(loss)}):
            print("warning:", finding.message, finding.fix)
    recorder.close()

Each line is written and flushed at once, so a run that crashes keeps its timeline up to the crash.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

from memfit.run_files import MEMORY_FILE
from memfit.watch import readings
from memfit.watch.thresholds import Thresholds
from memfit.watch.timeline import (
    SCHEMA_VERSION,
    SEVERITY_RANK,
    Finding,
    Timeline,
    sort_findings,
)

log = logging.getLogger("memfit.watch")

#: Phase readings kept per step (grad accumulation repeats forward/backward; the first ones show the pattern).
MAX_PHASE_READINGS = 64

#: Step records kept in memory for the live detectors (the file keeps them all).
LIVE_WINDOW = 1000


class _Observer:
    """The :class:`~memfit.step.train_step.StepObserver` handed to ``train_step``: reads memory at each phase."""

    def __init__(self, recorder: MemoryRecorder) -> None:
        self._recorder = recorder

    def on_phase(self, name: str) -> None:
        self._recorder._on_phase(name)


class MemoryRecorder:
    """Appends the memory timeline of a run to ``<run_dir>/memory.jsonl`` and runs the detectors.

    Args:
        run_dir: the run folder (created if missing).
        devices: CUDA devices to read (``["cuda:0", 1]``...); default every visible one, so that
            memory on a device the run should not touch is seen.
        plan: the run's :class:`~memfit.planner.report.MemoryPlan` (or its JSON), for
            predicted-versus-measured and the planned peak in reports.
        expected_device: the device(s) the run is meant to use (``"cuda:1"``, ``"cpu"``, a list);
            memory elsewhere is reported as stray. None: unknown, stray memory is not judged.
        total_steps: the run's length, when known: a leak is an error if memory fills before it.
        spec: the run's knobs (RunSpec or dict), stored for the doctor.
        config: the run's settings as the training loop names them (``learning_rate``, ``max_steps``...),
            JSON values, stored for ``memfit report``'s configuration table.
        thresholds: detector limits (:class:`~memfit.watch.thresholds.Thresholds`).
        check_every: run the detectors every this many steps.
        resumed_from_step: the step a resumed run restarts from; records after it are superseded.
        source: who records (``memfit-train``, ``hf-trainer``, ``script``), stored in the start record.
        file_name: the timeline's name in ``run_dir`` (each process of a multi-GPU run writes its own,
            see :func:`memfit.run_files.memory_file_name`).
        rank: the process's rank in a multi-GPU run (stored in the start record); None for one process.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        devices: list[str | int] | None = None,
        plan: Any = None,
        expected_device: Any = None,
        total_steps: int | None = None,
        spec: Any = None,
        config: dict[str, Any] | None = None,
        thresholds: Thresholds = Thresholds(),
        check_every: int = 10,
        resumed_from_step: int | None = None,
        source: str = "script",
        file_name: str = MEMORY_FILE,
        rank: int | None = None,
    ) -> None:
        if check_every < 1:
            raise ValueError(f"check_every: {check_every} must be 1 or more (steps between detector runs)")
        if total_steps is not None and total_steps < 1:
            raise ValueError(f"total_steps: {total_steps} must be 1 or more, or None when unknown")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / file_name
        self.thresholds = thresholds
        self.check_every = check_every
        self._cuda_indices = _device_indices(devices)
        # Readings are taken for cuda:0..cuda:N-1 and filtered to the devices asked for.
        self._cuda_count = max(self._cuda_indices, default=-1) + 1
        self._nvml = readings.Nvml(self._cuda_count)
        self._plan = _plan_json(plan)
        self._phases: list[dict[str, Any]] = []
        self._started = time.perf_counter()
        self._steps_seen = 0
        self._reported: dict[tuple[str, str], Finding] = {}
        self._attribution: _Attribution | None = None
        self._closed = False

        host = readings.host_reading()
        start = {
            "kind": "start",
            "schema": SCHEMA_VERSION,
            "time": time.time(),
            "source": source,
            **({"rank": int(rank)} if rank is not None else {}),
            "expected_devices": _expected(expected_device),
            "cuda_devices": [f"cuda:{i}" for i in self._cuda_indices],
            "device_capacity_bytes": self._only_asked(readings.device_capacities(self._cuda_count, self._nvml)),
            "host_total_bytes": host["host_total_bytes"],
            "rss_bytes": host["rss_bytes"],
            # The process's peak before the first step (loading the model, the data).
            **({"peak_rss_bytes": host["peak_rss_bytes"]} if "peak_rss_bytes" in host else {}),
            "total_steps": total_steps,
            "resumed_from_step": resumed_from_step,
            "spec": _spec_json(spec),
            **({"config": _jsonable(config)} if config else {}),
            "plan": self._plan,
        }
        self._timeline = Timeline(start=start, steps=deque(maxlen=LIVE_WINDOW))  # type: ignore[arg-type]
        self._file = open(self.path, "a", encoding="utf-8")
        self._write(start)
        self.observer = _Observer(self)

    def _only_asked(self, per_device: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in per_device.items() if int(k.split(":")[1]) in self._cuda_indices}

    # ------------------------------------------------------------------------------ writing
    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        # Flushed every line: a run that crashes keeps its timeline up to the crash.
        self._file.flush()

    def _record_finding(self, finding: Finding) -> None:
        self._write({"kind": "finding", "time": time.time(), "finding": finding.to_dict()})

    # ------------------------------------------------------------------------------ phases and steps
    def _on_phase(self, name: str) -> None:
        if self._attribution is not None:
            self._attribution.tracker.set_phase(name)
        if len(self._phases) < MAX_PHASE_READINGS:
            reading = {"phase": name, **readings.phase_reading(self._cuda_count)}
            if "devices" in reading:
                reading["devices"] = self._only_asked(reading["devices"])
            if self._attribution is not None:
                reading["tracked_live_bytes"] = self._attribution.tracker.live_device_bytes
            self._phases.append(reading)

    def end_step(self, step: int, extra: dict[str, Any] | None = None) -> list[Finding]:
        """Record memory after optimizer step ``step`` (1-based, as logged) and return new findings.

        ``extra`` (loss, learning rate, tokens...) is stored with the step. Detectors run every
        ``check_every`` steps; each problem is returned once (again only if it becomes more severe).
        """
        if self._closed:
            raise RuntimeError("end_step: the recorder is closed")
        host = readings.host_reading()
        devices = self._only_asked(readings.device_reading(self._cuda_count, self._nvml))
        record: dict[str, Any] = {
            "kind": "step",
            "step": int(step),
            "time": time.time(),
            "elapsed_s": round(time.perf_counter() - self._started, 4),
            "rss_bytes": host["rss_bytes"],
            **{key: host[key] for key in ("peak_rss_bytes", "heap_bytes") if key in host},
            "host_available_bytes": host["host_available_bytes"],
            "devices": devices,
            "phases": self._phases,
        }
        if self._attribution is not None:
            record["tracked_live_bytes"] = self._attribution.tracker.live_device_bytes
        if extra:
            record["extra"] = _jsonable(extra)
        self._phases = []
        self._write(record)
        self._timeline.steps.append({k: v for k, v in record.items() if k != "phases"})
        self._steps_seen += 1

        new: list[Finding] = []
        if self._attribution is not None:
            self._attribution.steps_done += 1
            if self._attribution.steps_done >= self._attribution.steps:
                self._finish_attribution()
                new += self._check()  # plan-versus-measured can be judged now
        if self._steps_seen % self.check_every == 0:
            new += self._check()
        return new

    def _check(self) -> list[Finding]:
        from memfit.watch.detectors import detect_all

        timeline = Timeline(
            start=self._timeline.start, steps=list(self._timeline.steps), attribution=self._timeline.attribution
        )
        fresh = []
        for finding in detect_all(timeline, self._plan, self.thresholds):
            known = self._reported.get(finding.key)
            if known is not None and SEVERITY_RANK[finding.severity] >= SEVERITY_RANK[known.severity]:
                continue
            self._reported[finding.key] = finding
            self._record_finding(finding)
            fresh.append(finding)
        return sort_findings(fresh)

    @property
    def findings(self) -> list[Finding]:
        """Every finding reported so far, most important first."""
        return sort_findings(list(self._reported.values()))

    def comparison(self) -> list:
        """The plan's categories next to the measured ones (:class:`~memfit.watch.compare.CategoryRow`);
        empty without a plan. Print them with :func:`memfit.watch.compare.comparison_lines`."""
        from memfit.watch.compare import compare_categories

        if self._plan is None:
            return []
        timeline = Timeline(
            start=self._timeline.start, steps=list(self._timeline.steps), attribution=self._timeline.attribution
        )
        return compare_categories(self._plan, timeline)

    # ------------------------------------------------------------------------------ the model
    def inspect(self, model: Any, spec: Any = None) -> list[Finding]:
        """Check the model for settings that silently cost memory (see
        :func:`memfit.watch.detectors.inspect_model`); record and return the findings."""
        from memfit.watch.detectors import inspect_model

        found = []
        for finding in inspect_model(model, spec if spec is not None else self._timeline.start.get("spec")):
            if finding.key in self._reported:
                continue
            self._reported[finding.key] = finding
            self._record_finding(finding)
            found.append(finding)
        return sort_findings(found)

    def attribute(
        self, model: Any, optimizer: Any = None, steps: int = 2, device: Any = None, cuda_parity: bool = False
    ) -> None:
        """Measure memory by category on the next ``steps`` steps, for predicted-versus-measured.

        Runs the planner's :class:`~memfit.planner.exact.tracker.MemoryTracker` on the real tensors
        (weights and trainable parameters marked from ``model``, gradients as autograd fills them,
        optimizer states from ``optimizer``) from now until ``steps`` calls of :meth:`end_step`.
        Two steps match the plan, which simulates two (the second with optimizer states in place).
        Only tensors on ``device`` (default: the model's) are counted. The tracker costs time on
        every operation, so it is used only for these steps.

        ``cuda_parity`` (a CPU run only): count as the planner counts, with its rewrites of the ops
        whose memory differs on CUDA (:mod:`memfit.planner.exact.cuda_parity`) and host copies counted as
        host memory; the peak is then comparable byte for byte with the plan (the conformance check,
        :mod:`memfit.train.conformance`).
        """
        if self._attribution is not None:
            raise RuntimeError("attribute: an attribution is already running")
        if steps < 1:
            raise ValueError(f"attribute: steps={steps} must be 1 or more")
        self._attribution = _Attribution(
            model, optimizer, steps, device, first_step=self._steps_seen + 1, cuda_parity=cuda_parity
        )

    def _finish_attribution(self) -> None:
        attribution, self._attribution = self._attribution, None
        if attribution is None:
            return
        record = attribution.finish()
        self._timeline.attribution = record
        self._write(record)

    # ------------------------------------------------------------------------------ end
    def close(self, status: str = "completed") -> list[Finding]:
        """Finish (an unfinished attribution, a last detector run), write the end record, close the file.

        Returns the findings that were new at this last check.
        """
        if self._closed:
            return []
        try:
            if self._attribution is not None:
                self._finish_attribution()
            last = self._check() if self._timeline.steps else []
            self._write({"kind": "end", "time": time.time(), "status": status, "steps": self._steps_seen})
        finally:
            self._closed = True
            self._file.close()
            self._nvml.close()
        return last

    def __enter__(self) -> MemoryRecorder:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(status="failed" if exc_type is not None else "completed")


class _Attribution:
    """A MemoryTracker running over the first steps on real tensors."""

    def __init__(
        self, model: Any, optimizer: Any, steps: int, device: Any, first_step: int, cuda_parity: bool = False
    ) -> None:
        import contextlib

        import torch

        from memfit.planner.exact.tracker import MemoryTracker

        if device is None:
            first = next(iter(model.parameters()), None)
            device = first.device if first is not None else torch.device("cpu")
        device = torch.device(device)

        class _DeviceTracker(MemoryTracker):
            # Count the run's device only: a CUDA run's CPU tensors (the batch before it is moved,
            # loss.item()) are not device memory.
            def _note(self, tensor, func=None):
                if tensor.device.type != device.type or (
                    device.index is not None and tensor.device.index != device.index
                ):
                    return None
                return super()._note(tensor, func)

        self.tracker = _DeviceTracker()
        self.model, self.optimizer = model, optimizer
        self.steps, self.steps_done, self.first_step = steps, 0, first_step
        self.device = device
        self.tracker.__enter__()
        self._modes = contextlib.ExitStack()
        if cuda_parity:
            if device.type != "cpu":
                raise ValueError(
                    f"attribute: cuda_parity is for a CPU run (the rewrites make a CPU count as CUDA), not {device}"
                )
            from memfit.planner.exact.cuda_parity import CudaParityMode
            from memfit.step.offload import pinned_host_copies

            self._modes.enter_context(pinned_host_copies(lambda: self.tracker.outside_device("host")))
            self._modes.enter_context(CudaParityMode(self.tracker))
        self.tracker.mark_model(model)
        if optimizer is not None:
            self.tracker.mark_optimizer(optimizer)  # a resumed run already holds states
        self._hooks = self.tracker.watch_gradients(model)
        if hasattr(optimizer, "register_hooks"):
            # An optimizer stepping in backward frees each gradient in its hook: re-register its
            # hooks after the tracker's, so that the tracker sees every gradient first.
            optimizer.register_hooks()
        self.tracker.reset_peak()

    def finish(self) -> dict[str, Any]:
        try:
            if self.optimizer is not None:
                self.tracker.mark_optimizer(self.optimizer)
        finally:
            self._modes.close()
            self.tracker.__exit__(None, None, None)
            for hook in self._hooks:
                hook.remove()
        result = self.tracker.result()
        return {
            "kind": "attribution",
            "time": time.time(),
            "first_step": self.first_step,
            "steps": self.steps_done,
            "device": str(self.device),
            "peak_allocated_bytes": int(result.peak.allocated_bytes),
            "phase": result.peak.phase,
            "categories": {k: int(v) for k, v in result.peak.categories.items()},
            "phase_peaks_allocated_bytes": {k: int(v) for k, v in result.phase_peaks.items()},
        }


# ------------------------------------------------------------------------------------------------
# Small helpers


def _device_indices(devices: list[str | int] | None) -> list[int]:
    if devices is None:
        return list(range(readings.visible_cuda_count()))
    indices = []
    for d in devices:
        text = str(d)
        if text.isdigit():
            indices.append(int(text))
        elif text.startswith("cuda:") and text[5:].isdigit():
            indices.append(int(text[5:]))
        elif text == "cuda":
            indices.append(0)
        elif text == "cpu":
            continue
        else:
            raise ValueError(f"devices: {d!r} is not a CUDA device; use 'cuda:N' or N (the host is always recorded)")
    return sorted(set(indices))


def _expected(expected_device: Any) -> list[str]:
    if expected_device is None:
        return []
    items = expected_device if isinstance(expected_device, (list, tuple, set)) else [expected_device]
    names = []
    for item in items:
        text = str(item)
        names.append("cuda:0" if text == "cuda" else text)
    return sorted(set(names))


def _plan_json(plan: Any) -> dict[str, Any] | None:
    if plan is None:
        return None
    if isinstance(plan, dict):
        return plan
    if hasattr(plan, "to_dict"):
        return plan.to_dict()
    raise TypeError(f"plan: expected a MemoryPlan or its JSON dict, not {type(plan).__name__}")


def _spec_json(spec: Any) -> dict[str, Any] | None:
    if spec is None:
        return None
    if isinstance(spec, dict):
        return dict(spec)
    if hasattr(spec, "knobs"):
        return spec.knobs()
    raise TypeError(f"spec: expected a RunSpec or a dict, not {type(spec).__name__}")


def _jsonable(extra: dict[str, Any]) -> dict[str, Any]:
    """Plain JSON values only (lists of them too): tensors become numbers (a 0-d tensor) or are dropped."""
    plain = (str, int, float, bool)
    out = {}
    for key, value in extra.items():
        if isinstance(value, plain) or value is None:
            out[str(key)] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, plain) for v in value):
            out[str(key)] = list(value)
        elif hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:
            out[str(key)] = value.item()
    return out
