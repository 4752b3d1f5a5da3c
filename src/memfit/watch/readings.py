"""Read memory off the machine: process RSS, PyTorch's CUDA allocator, and NVML.

The only module of :mod:`memfit.watch` that talks to devices. torch and NVML (``nvidia-ml-py``,
optional) are imported inside the functions that need them.

Reading allocator counters (``memory_allocated``...) does not synchronise with the GPU and does
not create a CUDA context, so it is cheap enough to do at every phase of every step. CUDA is never
initialised by a reading: when this process has not initialised CUDA, PyTorch holds nothing on
any GPU, and only NVML (which needs no context) is asked.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def host_reading() -> dict[str, int]:
    """The process's resident memory and its peak so far (the OS's high-water mark), its malloc
    heap in use (glibc only), and the machine's available and total RAM, in bytes."""
    import psutil

    rss_bytes = psutil.Process().memory_info().rss
    vm = psutil.virtual_memory()
    reading = {
        "rss_bytes": int(rss_bytes),
        "host_available_bytes": int(vm.available),
        "host_total_bytes": int(vm.total),
    }
    peak = peak_rss_bytes()
    if peak is not None:
        reading["peak_rss_bytes"] = peak
    heap = heap_bytes()
    if heap is not None:
        reading["heap_bytes"] = heap
    return reading


def peak_rss_bytes() -> int | None:
    """The most resident memory this process has held since it started (``getrusage``'s
    ``ru_maxrss``, the kernel's high-water mark); None where the OS has no such call (Windows).

    Readings taken at phase and step boundaries miss a peak reached in between (a forward pass
    that gathers, a checkpoint save, loading the weights); the kernel tracks every page.
    """
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    # Linux (and the BSDs) count kilobytes; macOS counts bytes.
    return peak if sys.platform == "darwin" else peak * 1024


_MALLINFO2: Any = False  # False: not looked up yet; None: not available


def heap_bytes() -> int | None:
    """Bytes in use through malloc (glibc ``mallinfo2``: in-use chunks + mmapped chunks, all arenas).

    RSS alone hides a leak while the process has freed-but-resident memory to reuse: new tensors
    land in pages that were already counted, and RSS stays flat until that pool runs out. The
    heap in use counts every live allocation at once (CPU tensors are malloc'd). Python's own small
    objects live in pymalloc arenas outside malloc; RSS still sees those. None off glibc.
    """
    global _MALLINFO2
    if _MALLINFO2 is False:
        _MALLINFO2 = _load_mallinfo2()
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


def _load_mallinfo2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        class Mallinfo2(ctypes.Structure):
            _fields_ = [
                (name, ctypes.c_size_t)
                for name in (
                    "arena",
                    "ordblks",
                    "smblks",
                    "hblks",
                    "hblkhd",
                    "usmblks",
                    "fsmblks",
                    "uordblks",
                    "fordblks",
                    "keepcost",
                )
            ]

        function = ctypes.CDLL(None).mallinfo2  # glibc 2.33+
        function.restype = Mallinfo2
        function.argtypes = []
        function()
        return function
    except (OSError, AttributeError):
        return None


def rss_bytes() -> int:
    """Resident memory of this process (cheap: one read of /proc on Linux)."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def cuda_in_use() -> bool:
    """True when this process has initialised CUDA through PyTorch (so it may hold GPU memory)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a CPU-only build without the cuda module state
        return False


def visible_cuda_count() -> int:
    """Number of CUDA devices PyTorch can see (0 without CUDA); does not create a context."""
    try:
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no torch, or a build without CUDA: no device
        return 0


def allocator_reading(index: int) -> dict[str, int]:
    """PyTorch's caching-allocator counters for ``cuda:index`` (no sync, no context)."""
    import torch

    return {
        "allocated_bytes": int(torch.cuda.memory_allocated(index)),
        "reserved_bytes": int(torch.cuda.memory_reserved(index)),
        "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(index)),
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(index)),
    }


def phase_reading(cuda_count: int) -> dict[str, Any]:
    """The cheap reading taken when a step changes phase: RSS and allocated/reserved per device."""
    reading: dict[str, Any] = {"rss_bytes": rss_bytes()}
    if cuda_count and cuda_in_use():
        import torch

        reading["devices"] = {
            f"cuda:{i}": {
                "allocated_bytes": int(torch.cuda.memory_allocated(i)),
                "reserved_bytes": int(torch.cuda.memory_reserved(i)),
            }
            for i in range(cuda_count)
        }
    return reading


class Nvml:
    """NVML handles for the CUDA devices this process sees, matched by UUID (``CUDA_VISIBLE_DEVICES``
    renumbers devices; NVML does not). ``available`` is False without the package or a driver."""

    def __init__(self, cuda_count: int) -> None:
        self.available = False
        self._nvml = None
        self._handles: dict[int, Any] = {}
        if cuda_count == 0:
            return
        try:
            import pynvml  # the nvidia-ml-py package

            pynvml.nvmlInit()
        except Exception:  # noqa: BLE001 - no package, no driver or no permission: no NVML readings
            return
        self._nvml = pynvml
        self.available = True
        for index in range(cuda_count):
            handle = self._handle_for(index)
            if handle is not None:
                self._handles[index] = handle

    def _handle_for(self, index: int):
        """The NVML handle of PyTorch's ``cuda:index``, found without initialising CUDA when possible."""
        pynvml = self._nvml
        uuid = ""
        if cuda_in_use():
            try:
                import torch

                uuid = str(torch.cuda.get_device_properties(index).uuid)
            except Exception:  # noqa: BLE001 - a device torch cannot describe: found as CUDA_VISIBLE_DEVICES names it
                uuid = ""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if not uuid and visible is not None:
            entries = [e.strip() for e in visible.split(",") if e.strip()]
            if index >= len(entries):
                return None
            entry = entries[index]
            if entry.isdigit():
                return _safe(pynvml.nvmlDeviceGetHandleByIndex, int(entry))
            uuid = entry  # a UUID (or MIG id) prefix
        if uuid:
            wanted = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                found = pynvml.nvmlDeviceGetUUID(handle)
                found = found.decode() if isinstance(found, bytes) else str(found)
                if found.startswith(wanted):
                    return handle
            return None
        return _safe(pynvml.nvmlDeviceGetHandleByIndex, index)

    def reading(self, index: int) -> dict[str, int]:
        """Device total and used bytes, this process's bytes and other processes' bytes."""
        handle = self._handles.get(index)
        if handle is None:
            return {}
        pynvml = self._nvml
        out: dict[str, int] = {}
        try:
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            out["total_bytes"] = int(info.total)
            out["nvml_used_bytes"] = int(info.used)
        except Exception:  # noqa: BLE001 - a reading NVML refuses is a reading missing
            return out
        try:
            processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:  # noqa: BLE001 - a reading NVML refuses is a reading missing
            return out
        pid = os.getpid()
        mine = others = 0
        seen_mine = False
        for proc in processes:
            used = proc.usedGpuMemory
            if used is None:  # not reported under some drivers / containers
                continue
            if proc.pid == pid:
                mine += int(used)
                seen_mine = True
            else:
                others += int(used)
        # Inside a container NVML may report host PIDs: then this process is not recognisable and
        # the split between "mine" and "others" is unknown.
        if seen_mine or not processes:
            out["process_bytes"] = mine
            out["other_processes_bytes"] = others
        return out

    def close(self) -> None:
        if self.available:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - closing: nothing is left to read
                pass
            self.available = False


def _safe(fn, *args):
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - a handle NVML refuses is a device without NVML readings
        return None


def device_reading(cuda_count: int, nvml: Nvml | None) -> dict[str, dict[str, int]]:
    """Full per-device reading for a step record: allocator counters (when CUDA is in use) and NVML."""
    devices: dict[str, dict[str, int]] = {}
    use_allocator = cuda_in_use()
    for index in range(cuda_count):
        entry: dict[str, int] = {}
        if use_allocator:
            entry.update(allocator_reading(index))
        if nvml is not None and nvml.available:
            entry.update(nvml.reading(index))
        if entry:
            devices[f"cuda:{index}"] = entry
    return devices


def device_capacities(cuda_count: int, nvml: Nvml | None) -> dict[str, int]:
    """Total memory of each visible CUDA device, in bytes (NVML, else PyTorch's properties)."""
    capacities: dict[str, int] = {}
    for index in range(cuda_count):
        total = 0
        if nvml is not None and nvml.available:
            total = nvml.reading(index).get("total_bytes", 0)
        if not total and cuda_in_use():
            try:
                import torch

                total = int(torch.cuda.get_device_properties(index).total_memory)
            except Exception:  # noqa: BLE001 - a device torch cannot describe has no known capacity
                total = 0
        if total:
            capacities[f"cuda:{index}"] = total
    return capacities


def step_peak_reading(device: Any) -> dict[str, int]:
    """The peaks a training step reports: allocated and reserved on a CUDA device; on the CPU the
    process's resident memory and its peak (``ru_maxrss``)."""
    if getattr(device, "type", str(device)) == "cuda":
        import torch

        return {
            "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
            "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
        }
    reading = {"rss_bytes": rss_bytes()}
    peak = peak_rss_bytes()
    if peak is not None:
        reading["peak_rss_bytes"] = peak
    return reading
