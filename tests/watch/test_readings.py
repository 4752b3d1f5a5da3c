"""Device readings: the host always; NVML through a stand-in module (no GPU here); CUDA for real
only under the gpu mark."""

from __future__ import annotations

import os
import sys
import types
from types import SimpleNamespace

import pytest

from memfit.watch import readings

GiB = 2**30


def test_host_reading_is_positive_bytes():
    host = readings.host_reading()
    assert 0 < host["rss_bytes"] < host["host_total_bytes"]
    assert 0 < host["host_available_bytes"] <= host["host_total_bytes"]
    assert set(readings.phase_reading(0)) == {"rss_bytes"}


def test_peak_rss_is_the_os_high_water_mark_in_bytes():
    before = readings.peak_rss_bytes()
    grown = bytearray(64 * 2**20)
    for i in range(0, len(grown), 4096):  # touched, so the pages are resident
        grown[i] = 1
    after = readings.host_reading()
    del grown
    # It never goes down, and it saw the 64 MiB (ru_maxrss trails the page counts by a few hundred KiB).
    assert after["peak_rss_bytes"] >= before
    assert after["peak_rss_bytes"] >= after["rss_bytes"] - 2**20
    assert readings.peak_rss_bytes() >= after["peak_rss_bytes"] > readings.rss_bytes()


def fake_nvml(processes_by_index):
    """A stand-in for the ``pynvml`` module: two GPUs with UUIDs and running processes."""
    module = types.ModuleType("pynvml")
    uuids = ["GPU-aaaa-0000", "GPU-bbbb-1111"]
    module.nvmlInit = lambda: None
    module.nvmlShutdown = lambda: None
    module.nvmlDeviceGetCount = lambda: 2
    module.nvmlDeviceGetHandleByIndex = lambda i: i
    module.nvmlDeviceGetUUID = lambda h: uuids[h]
    module.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(total=80 * GiB, used=(h + 1) * 10 * GiB)
    module.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in processes_by_index[h]
    ]
    return module


def test_nvml_splits_this_process_from_others_and_follows_cuda_visible_devices(monkeypatch):
    me = os.getpid()
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml({0: [(me, 1 * GiB)], 1: [(me, 5 * GiB), (me + 1, 3 * GiB)]}))
    monkeypatch.setattr(readings, "cuda_in_use", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # the process's cuda:0 is the machine's GPU 1
    nvml = readings.Nvml(1)
    assert nvml.reading(0) == {
        "total_bytes": 80 * GiB,
        "nvml_used_bytes": 20 * GiB,
        "process_bytes": 5 * GiB,
        "other_processes_bytes": 3 * GiB,
    }
    assert readings.device_reading(1, nvml) == {"cuda:0": nvml.reading(0)}
    assert readings.device_capacities(1, nvml) == {"cuda:0": 80 * GiB}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa")  # by UUID prefix
    assert readings.Nvml(1).reading(0)["process_bytes"] == 1 * GiB
    nvml.close()


def test_nvml_without_this_pid_leaves_the_split_unknown(monkeypatch):
    # In a container NVML may list host PIDs: then "mine" and "others" cannot be told apart.
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml({0: [(1, GiB)], 1: []}))
    monkeypatch.setattr(readings, "cuda_in_use", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    reading = readings.Nvml(2).reading(0)
    assert "process_bytes" not in reading and reading["nvml_used_bytes"] == 10 * GiB


def test_no_nvml_package_means_no_nvml_readings(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    nvml = readings.Nvml(1)
    assert not nvml.available and nvml.reading(0) == {}


@pytest.mark.gpu
def test_real_cuda_run_records_its_device_and_a_stray_tensor(tmp_path):
    import torch

    from memfit.watch.detectors import detect_stray_device
    from memfit.watch.recorder import MemoryRecorder
    from memfit.watch.timeline import load_timeline

    with MemoryRecorder(tmp_path, expected_device="cpu", check_every=1) as recorder:
        stray = torch.empty(128 * 2**20, dtype=torch.uint8, device="cuda:0")  # the bug
        recorder.observer.on_phase("forward")
        found = recorder.end_step(1)
    timeline = load_timeline(tmp_path / "memory.jsonl")
    entry = timeline.steps[0]["devices"]["cuda:0"]
    assert entry["allocated_bytes"] >= stray.nbytes and entry["reserved_bytes"] >= entry["allocated_bytes"]
    assert timeline.steps[0]["phases"][0]["devices"]["cuda:0"]["allocated_bytes"] >= stray.nbytes
    assert [f.code for f in found] == ["stray_device"] and found[0].severity == "error"
    assert detect_stray_device(timeline)[0].data["device"] == "cuda:0"
