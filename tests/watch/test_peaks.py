"""The host peak of a timeline: the OS's high-water mark against the recorder's own readings."""

from __future__ import annotations

from watch_helpers import MiB, start_record, step_records

from memfit.watch.peaks import host_peak
from memfit.watch.timeline import Timeline


def timeline(steps, **start) -> Timeline:
    return Timeline(start=start_record(**start), steps=steps)


def test_the_os_high_water_mark_wins_over_step_end_readings():
    steps = step_records(5, rss=lambda s: 1800 * MiB + s * MiB)
    for record in steps:
        record["peak_rss_bytes"] = 1900 * MiB if record["step"] < 3 else 2048 * MiB
    peak = host_peak(timeline(steps))
    assert peak.peak_bytes == 2048 * MiB and peak.source == "os"
    assert peak.describe() == (
        "2.0 GiB (the process's peak RSS from the OS, getrusage ru_maxrss; reached by the end of step 3); "
        "the recorder's highest reading 1.8 GiB (step 5, after the step)"
    )


def test_a_peak_reached_while_loading_is_said_so():
    steps = step_records(3)
    for record in steps:
        record["peak_rss_bytes"] = 3000 * MiB
    peak = host_peak(timeline(steps, peak_rss_bytes=3000 * MiB))
    assert peak.os.when == "reached before the first step (loading)"


def test_without_an_os_peak_the_highest_reading_is_named_phases_included():
    steps = step_records(4, rss=lambda s: 500 * MiB)
    steps[2]["phases"] = [{"phase": "forward", "rss_bytes": 520 * MiB}, {"phase": "backward", "rss_bytes": 700 * MiB}]
    peak = host_peak(timeline(steps))
    assert peak.source == "sampled" and peak.os is None and peak.peak_bytes == 700 * MiB
    assert peak.describe() == "700.0 MiB (the highest RSS the recorder read; step 3, when backward began)"


def test_a_reading_just_above_a_lagging_os_peak_is_the_peak_and_both_are_named():
    # ru_maxrss trails the kernel's page counts by up to a few hundred KiB while memory grows.
    steps = step_records(2, rss=lambda s: 540 * MiB)
    for record in steps:
        record["peak_rss_bytes"] = 540 * MiB - 200 * 1024
    peak = host_peak(timeline(steps))
    assert peak.peak_bytes == 540 * MiB and peak.source == "sampled"
    assert "ru_maxrss 539.8 MiB (reached by the end of step 1)" in peak.describe()


def test_no_reading_no_peak():
    assert host_peak(Timeline(start={"kind": "start"}, steps=[])) is None
