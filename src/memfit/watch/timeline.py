"""The memory timeline of a run: the records of ``memory.jsonl``, findings, and reading them back.

``memory.jsonl`` holds one JSON object per line, each with a ``kind``:

- ``start``: once, first: schema version, expected devices, device capacities, the plan (if any);
- ``step``: after every optimizer step: host and per-device readings, per-phase readings;
- ``attribution``: the live bytes by category measured at the peak of the first step(s);
- ``finding``: a problem found while the run was going (also those only the live model shows);
- ``end``: once, last, when the recorder is closed cleanly (a crashed run has none).

The full schema is in docs/watch.md. This module imports nothing heavy: ``memfit doctor`` and
``memfit report`` read timelines without torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from memfit.errors import UserError
from memfit.json_form import JsonForm
from memfit.run_files import MEMORY_FILE, METRICS_FILE, RUN_FILE, rank_of_memory_file

#: Version of the record layout; bumped when a field changes meaning.
SCHEMA_VERSION = 1


SEVERITIES = ("error", "warning", "info")
#: Errors first: lower is more severe.
SEVERITY_RANK = {name: rank for rank, name in enumerate(SEVERITIES)}


@dataclass
class Finding(JsonForm):
    """Something wrong (or worth knowing) about a run's memory, in plain words, with the fix.

    ``code`` is stable and machine-readable (``leak``, ``stray_device``...); ``data`` holds the
    figures behind the message (bytes, steps, device names).
    """

    severity: str
    code: str
    message: str
    fix: str
    step: int | None = None
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITY_RANK:
            raise ValueError(f"Finding.severity: {self.severity!r} is not one of {', '.join(SEVERITIES)}")

    @property
    def key(self) -> tuple[str, str]:
        """What makes two findings "the same problem": the code and the device it is about."""
        return self.code, str(self.data.get("device", ""))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Finding:
        return cls(
            severity=data["severity"],
            code=data["code"],
            message=data["message"],
            fix=data.get("fix", ""),
            step=data.get("step"),
            data=dict(data.get("data") or {}),
        )


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Most important first: errors, then warnings, then info; earlier steps first within a level."""
    return sorted(findings, key=lambda f: (SEVERITY_RANK[f.severity], f.step if f.step is not None else -1))


def merge_findings(*groups: list[Finding]) -> list[Finding]:
    """One finding per (code, device): the most severe, and the first seen among equals."""
    best: dict[tuple[str, str], Finding] = {}
    for group in groups:
        for f in group:
            known = best.get(f.key)
            if known is None or SEVERITY_RANK[f.severity] < SEVERITY_RANK[known.severity]:
                best[f.key] = f
    return sort_findings(list(best.values()))


@dataclass
class Timeline:
    """A parsed ``memory.jsonl``."""

    start: dict[str, Any]
    steps: list[dict[str, Any]]
    attribution: dict[str, Any] | None = None
    findings: list[Finding] = field(default_factory=list)
    end: dict[str, Any] | None = None

    @property
    def plan(self) -> dict[str, Any] | None:
        """The plan's JSON (``MemoryPlan.to_dict()``) the run was started with, if any."""
        return self.start.get("plan")

    @property
    def expected_devices(self) -> list[str]:
        return list(self.start.get("expected_devices") or [])

    @property
    def total_steps(self) -> int | None:
        return self.start.get("total_steps")

    def device_names(self) -> list[str]:
        """Every CUDA device that appears in any step record, in order."""
        names: list[str] = []
        for record in self.steps:
            for name in record.get("devices", {}):
                if name not in names:
                    names.append(name)
        return sorted(names, key=_device_sort_key)


def _device_sort_key(name: str) -> tuple[str, int]:
    kind, _, index = name.partition(":")
    return kind, int(index) if index.isdigit() else -1


class TimelineError(UserError, ValueError):
    """A run folder or memory.jsonl that cannot be read; the message names the file and the fix."""


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field_problem(value: Any, where: str) -> str | None:
    """The first field under ``value`` whose type readers cannot use: ``*_bytes`` fields are
    numbers, ``step`` fields whole numbers, ``devices`` a mapping of mappings (None when all is well)."""
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{where}.{key}" if where else str(key)
            if str(key).endswith("_bytes") and item is not None and not _number(item) and not isinstance(item, dict):
                return f"{path} is {item!r}, not a number of bytes"
            if (
                key in ("step", "first_step", "total_steps", "resumed_from_step")
                and item is not None
                and not _whole(item)
            ):
                return f"{path} is {item!r}, not a whole number"
            if (
                key in ("devices", "categories", "device_capacity_bytes")
                and item is not None
                and not isinstance(item, dict)
            ):
                return f"{path} is {item!r}, not a mapping"
            if key == "devices" and isinstance(item, dict):
                bad = next((name for name, entry in item.items() if not isinstance(entry, dict)), None)
                if bad is not None:
                    return f"{path}.{bad} is {item[bad]!r}, not a mapping of readings"
            if key == "categories" and isinstance(item, dict):
                bad = next((name for name, entry in item.items() if not _number(entry)), None)
                if bad is not None:
                    return f"{path}.{bad} is {item[bad]!r}, not a number of bytes"
            problem = _field_problem(item, path)
            if problem:
                return problem
    elif isinstance(value, list):
        for index, item in enumerate(value):
            problem = _field_problem(item, f"{where}[{index}]")
            if problem:
                return problem
    return None


def _record_problem(record: dict[str, Any]) -> str | None:
    """Why a parsed record cannot be read (None when it can): a field of the wrong type."""
    kind = record.get("kind")
    if kind == "step" and not _whole(record.get("step")):
        return f"step is {record.get('step')!r}, not a whole number"
    devices = record.get("expected_devices")
    if devices is not None and not (isinstance(devices, list) and all(isinstance(d, str) for d in devices)):
        return f"expected_devices is {devices!r}, not a list of device names"
    for key in ("plan", "spec"):
        if record.get(key) is not None and not isinstance(record[key], dict):
            return f"{key} is {record[key]!r}, not a mapping"
    if kind == "finding":
        try:
            Finding.from_json(record["finding"])
        except (KeyError, TypeError, ValueError):
            return f"finding is {record.get('finding')!r}, not a finding (severity, code, message, fix)"
    return _field_problem(record, "")


def parse_timeline(lines: list[str], source: str = MEMORY_FILE) -> Timeline:
    """Build a :class:`Timeline` from the lines of a ``memory.jsonl``.

    A damaged *last* line is dropped: a run killed mid-write leaves one, and everything before it
    is still good. A damaged line elsewhere, or a record with a field of the wrong type, is an
    error naming the line and the field.
    """
    start: dict[str, Any] | None = None
    timeline = Timeline(start={}, steps=[])
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    for position, (number, line) in enumerate(numbered):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as err:
            if position == len(numbered) - 1:
                break  # cut short by a crash
            raise TimelineError(f"{source} line {number} is not a JSON object ({err}); the file is damaged") from None
        problem = _record_problem(record)
        if problem:
            raise TimelineError(
                f"{source} line {number}: {problem}; the file was edited or damaged "
                "(memfit's recorder writes it, see docs/watch.md for its fields)"
            )
        kind = record.get("kind")
        if kind == "start":
            # A later start record is a resumed run (records after its resume step are replaced)
            # or a new run in the same folder (everything before it is replaced).
            resumed = record.get("resumed_from_step")
            if resumed is None:
                timeline = Timeline(start={}, steps=[])
            else:
                timeline.steps = [r for r in timeline.steps if r.get("step", 0) <= resumed]
                timeline.end = None
            start = record
        elif kind == "step":
            timeline.steps.append(record)
        elif kind == "attribution":
            timeline.attribution = record
        elif kind == "finding":
            timeline.findings.append(Finding.from_json(record["finding"]))
        elif kind == "end":
            timeline.end = record
        # unknown kinds are skipped: newer writers may add records older readers do not know
    if start is None:
        raise TimelineError(
            f"{source} has no start record: it was not written by memfit's recorder "
            "(memfit train, or memfit.watch.MemoryCallback / MemoryRecorder)"
        )
    timeline.start = start
    return timeline


def load_timeline(path: str | Path) -> Timeline:
    """Read and parse a ``memory.jsonl`` file.

    Lines are decoded one by one: a last line cut inside a character (a crash mid-write) is
    dropped like any damaged last line; bytes that are not UTF-8 elsewhere are an error.
    """
    path = Path(path)
    try:
        raw = path.read_bytes().split(b"\n")
    except OSError as err:
        raise TimelineError(f"{path} cannot be read ({err.strerror}); check its permissions") from None
    lines = []
    last = max((i for i, line in enumerate(raw) if line.strip()), default=-1)
    for number, line in enumerate(raw, 1):
        try:
            lines.append(line.decode("utf-8"))
        except UnicodeDecodeError as err:
            if number - 1 == last:
                break  # cut short by a crash
            raise TimelineError(
                f"{path} line {number} is not UTF-8 text (byte {err.start}): not a memory.jsonl memfit "
                "wrote, or the file is damaged"
            ) from None
    return parse_timeline(lines, source=str(path))


def load_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (damaged lines skipped: metrics are only drawn)."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def metric_curve(metrics: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) pairs of one metric, in the file's order: ``loss`` (training records),
    ``eval_loss`` (evaluation records), ``lr``... Records without a finite number there are skipped."""
    points = []
    for record in metrics:
        step, value = record.get("step"), record.get(key)
        if _number(step) and _number(value) and math.isfinite(value):
            points.append((int(step), float(value)))
    return points


@dataclass
class RunFolder:
    """Everything memfit can read from a run folder."""

    path: Path
    timeline: Timeline
    metrics: list[dict[str, Any]]
    run: dict[str, Any] | None

    @property
    def plan(self) -> dict[str, Any] | None:
        """The plan: from the recorder's start record, else from memfit train's ``run.json``."""
        return self.timeline.plan or (self.run or {}).get("plan")


def load_run(run_dir: str | Path) -> RunFolder:
    """Read a run folder; raise :class:`TimelineError` with a clear message when it is not one."""
    path = Path(run_dir)
    if not path.exists():
        raise TimelineError(f"run folder {str(path)!r} does not exist; pass the output_dir of a run")
    if not path.is_dir():
        raise TimelineError(f"{str(path)!r} is a file, not a run folder; pass the folder that holds {MEMORY_FILE}")
    memory = path / MEMORY_FILE
    if memory.exists() and not memory.is_file():
        raise TimelineError(f"{str(memory)!r} is a folder, not the memory file; pass a run folder memfit wrote")
    if not memory.is_file():
        raise TimelineError(
            f"{str(path)!r} has no {MEMORY_FILE}: memory was not recorded for this run. Record it with "
            "memfit train, or add memfit.watch.MemoryCallback(run_dir) to your Trainer's callbacks."
        )
    timeline = load_timeline(memory)
    for rank, rank_file in _rank_files(path):
        merge_rank(timeline, load_timeline(rank_file), rank)
    run = None
    run_file = path / RUN_FILE
    if run_file.is_file():
        try:
            run = json.loads(run_file.read_text(encoding="utf-8"))
        except ValueError as err:  # UnicodeDecodeError too
            raise TimelineError(
                f"{run_file} is not valid JSON ({err}); it is rewritten atomically, so it was edited by hand"
            ) from None
        if not isinstance(run, dict):
            raise TimelineError(f"{run_file} holds a {type(run).__name__}, not a JSON object; it was edited by hand")
        problem = _record_problem({key: run.get(key) for key in ("plan", "spec", "total_steps", "step") if key in run})
        if problem:
            raise TimelineError(f"{run_file}: {problem}; it is rewritten atomically, so it was edited by hand")
    # Fill what the recorder did not know from run.json (memfit train writes the resolved config there).
    if run:
        if not timeline.start.get("total_steps") and run.get("total_steps"):
            timeline.start["total_steps"] = run["total_steps"]
        if not timeline.start.get("expected_devices") and run.get("device"):
            timeline.start["expected_devices"] = [str(run["device"])]
        if not timeline.start.get("spec") and run.get("spec"):
            timeline.start["spec"] = run["spec"]
    return RunFolder(path=path, timeline=timeline, metrics=load_metrics(path / METRICS_FILE), run=run)


def _rank_files(path: Path) -> list[tuple[int, Path]]:
    """``memory-rank<N>.jsonl`` files of a multi-process run (rank 0 writes ``memory.jsonl``), by rank."""
    found = []
    for file in path.glob("memory-rank*.jsonl"):
        rank = rank_of_memory_file(file.name)
        if rank:
            found.append((rank, file))
    return sorted(found)


def rank_device_name(rank: int, name: str) -> str:
    """How another rank's device is named in the merged timeline: ``rank1/cuda:1``."""
    return f"rank{rank}/{name}"


def merge_rank(timeline: Timeline, other: Timeline, rank: int) -> None:
    """Add rank ``rank``'s device readings and findings to rank 0's ``timeline``, step by step.

    Each of that rank's devices becomes ``rank<N>/<device>``, so every detector (leaks, stray
    devices, fragmentation) and every chart covers each rank's devices on their own; its expected
    devices are renamed the same way, so a rank's own GPU is never taken for a stray one.
    """
    by_step = {record.get("step"): record for record in timeline.steps}
    for record in other.steps:
        target = by_step.get(record.get("step"))
        if target is None:
            continue  # a step rank 0 did not record (a crash in between): nothing to line it up with
        devices = target.setdefault("devices", {})
        for name, entry in (record.get("devices") or {}).items():
            devices[rank_device_name(rank, name)] = entry
    expected = list(timeline.start.get("expected_devices") or [])
    expected += [rank_device_name(rank, name) for name in other.expected_devices]
    timeline.start["expected_devices"] = expected
    for finding in other.findings:
        data = dict(finding.data)
        if "device" in data:
            data["device"] = rank_device_name(rank, str(data["device"]))
        timeline.findings.append(
            Finding(finding.severity, finding.code, f"rank {rank}: {finding.message}", finding.fix, finding.step, data)
        )
