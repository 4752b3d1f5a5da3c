"""The host's peak memory of a recorded run, and which reading it comes from.

The recorder reads the process's RSS at the end of every step and when each phase of a step begins;
a peak reached between two readings (a forward pass that gathers, a checkpoint save) is missed by
them. Step records also carry ``peak_rss_bytes`` (files written before it was added do not), the
kernel's high-water mark (``getrusage``'s ``ru_maxrss``), which misses nothing. The peak reported
is the larger of the two, named, with the other beside it. Pure functions over a timeline.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.units import format_bytes
from memfit.watch.timeline import Timeline


@dataclass(frozen=True)
class Reading:
    """A peak and when it was reached, in words."""

    peak_bytes: int
    when: str


@dataclass(frozen=True)
class HostPeak:
    """The host peak of a run, from the two readings: the OS's high-water mark (``os``, None when
    not recorded) and the highest RSS the recorder read (``sampled``)."""

    os: Reading | None
    sampled: Reading | None

    @property
    def peak_bytes(self) -> int:
        """The larger of the two (ru_maxrss lags the kernel's page counts by up to a few hundred KiB)."""
        return max(r.peak_bytes for r in (self.os, self.sampled) if r is not None)

    @property
    def source(self) -> str:
        """``os`` when the OS's high-water mark is the peak, else ``sampled``."""
        return (
            "os"
            if self.os is not None and (self.sampled is None or self.os.peak_bytes >= self.sampled.peak_bytes)
            else "sampled"
        )

    def describe(self) -> str:
        """The peak, the reading it comes from and when; the other reading after it."""
        os_text = f"the process's peak RSS from the OS, getrusage ru_maxrss; {self.os.when}" if self.os else ""
        sampled_text = f"the highest RSS the recorder read; {self.sampled.when}" if self.sampled else ""
        if self.source == "os":
            text = f"{format_bytes(self.os.peak_bytes)} ({os_text})"
            other = (
                f"the recorder's highest reading {format_bytes(self.sampled.peak_bytes)} ({self.sampled.when})"
                if self.sampled
                else ""
            )
        else:
            text = f"{format_bytes(self.sampled.peak_bytes)} ({sampled_text})"
            other = f"ru_maxrss {format_bytes(self.os.peak_bytes)} ({self.os.when})" if self.os else ""
        return text + (f"; {other}" if other else "")


def host_peak(timeline: Timeline) -> HostPeak | None:
    """Both host peaks of ``timeline`` (see :class:`HostPeak`); None without any reading."""
    sampled, recorded = _highest_reading(timeline), _os_peak(timeline)
    return HostPeak(recorded, sampled) if sampled or recorded else None


def _highest_reading(timeline: Timeline) -> Reading | None:
    """The highest RSS among the start, step-end and phase readings (the first one, on a tie)."""
    best: tuple[int, str] | None = None

    def consider(value, when: str) -> None:
        nonlocal best
        if isinstance(value, (int, float)) and not isinstance(value, bool) and (best is None or value > best[0]):
            best = (int(value), when)

    consider(timeline.start.get("rss_bytes"), "before the first step")
    for record in timeline.steps:
        step = record.get("step")
        for phase in record.get("phases") or []:
            consider(phase.get("rss_bytes"), f"step {step}, when {phase.get('phase', '?')} began")
        consider(record.get("rss_bytes"), f"step {step}, after the step")
    return Reading(*best) if best is not None else None


def _os_peak(timeline: Timeline) -> Reading | None:
    """The largest ``peak_rss_bytes`` recorded, and the first record that shows it."""
    values = [(record.get("peak_rss_bytes"), record.get("step")) for record in timeline.steps]
    values = [(int(v), step) for v, step in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    before = timeline.start.get("peak_rss_bytes")
    if isinstance(before, (int, float)) and not isinstance(before, bool):
        values.insert(0, (int(before), None))
    if not values:
        return None
    peak = max(v for v, _ in values)
    first = next(step for v, step in values if v == peak)
    return Reading(
        peak, "reached before the first step (loading)" if first is None else f"reached by the end of step {first}"
    )
