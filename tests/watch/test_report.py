"""memfit report: a self-contained HTML page with inlined charts, PNGs beside it, written safely."""

from __future__ import annotations

import base64
import re

import pytest
from watch_helpers import GiB, MiB, start_record, step_records, tiny_plan, write_run

pytest.importorskip("matplotlib")

from memfit.watch.report import ReportError, write_report  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cuda_run(tmp_path):
    devices = lambda s: {"cuda:0": {"allocated_bytes": 10 * GiB + 3 * MiB * s, "reserved_bytes": 14 * GiB,  # noqa: E731
                                    "peak_allocated_bytes": 13 * GiB, "peak_reserved_bytes": 14 * GiB,
                                    "process_bytes": 14 * GiB + 500 * MiB, "nvml_used_bytes": 15 * GiB}}
    attribution = {"kind": "attribution", "first_step": 1, "steps": 2, "peak_allocated_bytes": 3 * GiB,
                   "categories": {"weights": GiB, "trainable": 64 * MiB, "gradients": 64 * MiB, "optimizer": 128 * MiB,
                                  "activations": 900 * MiB, "temporaries": 40 * MiB, "runtime": 0}}
    records = [start_record(("cuda:0",), 1000, plan=tiny_plan(allocated=12 * GiB), capacity={"cuda:0": 80 * GiB}),
               *step_records(100, devices=devices, rss=lambda s: 3 * GiB), attribution]
    return write_run(tmp_path / "run", records, metrics=[{"step": s, "loss": 4.0 - s / 50} for s in range(1, 101)])


def test_report_inlines_every_chart_and_writes_the_pngs(tmp_path):
    run = cuda_run(tmp_path)
    path = write_report(run)
    assert path == run / "report.html"
    page = path.read_text()
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)"', page)
    assert [alt for alt, _ in images] == ["memory: cuda0", "memory: host", "Loss", "Plan vs measured"]
    assert all(base64.b64decode(data).startswith(PNG_MAGIC) for _, data in images)
    for name in ("memory-cuda0", "memory-host", "loss", "categories"):
        assert (run / f"report-{name}.png").read_bytes().startswith(PNG_MAGIC)
    assert "src=\"http" not in page and "<script" not in page  # nothing fetched from elsewhere
    assert "leak" in page and "activations" in page and "not measured" not in page.split("Plan vs measured</h2>")[0][-10:]
    assert not list(run.glob(".*.tmp-*"))


def test_report_is_rewritten_but_never_over_someone_elses_file(tmp_path):
    run = cuda_run(tmp_path)
    write_report(run)
    write_report(run)  # its own earlier report: replaced
    mine = tmp_path / "notes.html"
    mine.write_text("<html>my notes</html>")
    with pytest.raises(ReportError, match="not written by memfit report"):
        write_report(run, mine)
    assert mine.read_text() == "<html>my notes</html>"
    with pytest.raises(ReportError, match="does not exist"):
        write_report(run, tmp_path / "missing" / "r.html")


def test_cpu_run_without_plan_or_metrics(tmp_path):
    run = write_run(tmp_path / "run", [start_record(), *step_records(20, rss=lambda s: 400 * MiB + s * MiB)])
    page = write_report(run, tmp_path / "out.html").read_text()
    assert page.count("<img") == 1 and "No memory problems found" in page
    assert (tmp_path / "out-memory-host.png").is_file()
