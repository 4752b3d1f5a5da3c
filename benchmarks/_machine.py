"""Describe the machine a benchmark ran on, for its results file."""

from __future__ import annotations

import os
import platform
import sys


def describe_machine() -> dict:
    """CPU, memory, OS and library versions (and the GPU, when there is one)."""
    import psutil
    import torch

    info = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    for name in ("transformers", "peft", "bitsandbytes"):
        try:
            info[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - optional libraries may be missing or fail to import
            info[name] = None
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
