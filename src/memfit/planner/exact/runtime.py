"""Device memory that a training step uses besides its tensors.

Two kinds of runtime memory matter to the planner:

* The **CUDA context**: driver state, the CUDA runtime and the kernels torch
  and its libraries load onto the device. It lives outside the caching
  allocator: ``torch.cuda.memory_reserved()`` never shows it, ``nvidia-smi``
  does. It counts only toward the device total.
* The **cuBLAS workspaces**: torch hands cuBLAS a workspace it allocates
  through the caching allocator, so it appears in ``memory_allocated`` and
  ``memory_reserved`` and must be replayed through the allocator model like
  any tensor (an 8.125 MiB workspace is a large-pool request below 10 MiB, so
  it opens a 20 MiB segment when nothing cached fits).

Every figure here is a named constant with its source; those marked as
estimates should be calibrated on a GPU (measure ``nvidia-smi`` used memory
minus ``torch.cuda.memory_reserved()`` after one training step) and can be
overridden per call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from memfit.models.gpus import ARCHS
from memfit.units import KiB, MiB, format_bytes

# --- CUDA context ------------------------------------------------------------

DEFAULT_CUDA_CONTEXT_BYTES = 512 * MiB
"""Estimate of the CUDA context of a torch training process, any GPU.

Sources: PyTorch maintainers put the context created by the first CUDA call
at "~300 MB" and "around 400 MB" with CUDA >= 11.7 lazy module loading (the
default in torch builds; pytorch/pytorch issues #107667 and #109888, 2023);
before lazy loading it was 700 MB to 1 GB. A training step loads more kernels
than a first tensor (GEMMs, attention, fused optimizers), so the estimate is
rounded up to 512 MiB. It varies with the driver, CUDA version and the
kernels used: an estimate, to be calibrated on each GPU family.
"""

MAX_CONTEXT_BYTES = 2**40
"""The largest CUDA context a plan takes (``--context-bytes``): 1 TiB, more than any card holds."""


def context_bytes_problem(value: int | str | None) -> str | None:
    """Why ``value`` cannot be ``--context-bytes`` (None when it can: a whole number of bytes from 0
    to :data:`MAX_CONTEXT_BYTES`, or None for the estimate): the command line's check and the page's."""
    from memfit.errors import shown
    from memfit.spec import whole_number_value

    if value is None:
        return None
    number = whole_number_value(value)
    example = "(e.g. --context-bytes 600000000, a measured context of 572 MiB)"
    if number is None:
        return f"--context-bytes: {shown(value)} is not a whole number of bytes {example}."
    if not 0 <= number <= MAX_CONTEXT_BYTES:
        said = number if isinstance(number, int) else shown(value)
        return (
            f"--context-bytes: {said} must be 0 to {MAX_CONTEXT_BYTES} ({format_bytes(MAX_CONTEXT_BYTES)}) {example}."
        )
    return None


CUDA_CONTEXT_BYTES_BY_ARCH: dict[str, int] = {}
"""Per-architecture context sizes that replace the default once measured.

Empty on purpose: no published per-architecture figure was found that beats
the default above. Fill it from calibration runs (key: an architecture name
from ``KNOWN_ARCHS``).
"""

# --- cuBLAS workspaces ---------------------------------------------------------

CUBLAS_WORKSPACE_DEFAULT_BYTES = 4096 * KiB * 2 + 16 * KiB * 8
"""8,519,680 B (8.125 MiB): torch's default cuBLAS workspace before Hopper.

``parseChosenWorkspaceSize`` in aten/src/ATen/cuda/CublasHandlePool.cpp uses
the ``CUBLAS_WORKSPACE_CONFIG`` default ``:4096:2:16:8`` (two 4096 KiB chunks
and eight 16 KiB chunks). The same 8,519,680 B shows up as memory_allocated
after a single ``nn.Linear`` call (pytorch/pytorch issue #95668).
"""

CUBLAS_WORKSPACE_LARGE_BYTES = 32 * MiB
"""33,554,432 B: torch's default cuBLAS workspace on compute capability 9.x,
10.x and 12.x (Hopper, Blackwell), following NVIDIA's cublasSetWorkspace
recommendation of 32 MiB for Hopper (same source file)."""

CUBLASLT_WORKSPACE_DEFAULT_BYTES = 1024 * KiB
"""1 MiB: cuBLASLt workspace when it is *not* unified with the cuBLAS one
(``CUBLASLT_WORKSPACE_SIZE`` default, in KiB, in the same source file)."""

DEFAULT_NUM_CUBLAS_WORKSPACES = 2
"""Workspaces are kept per (cuBLAS handle, stream) and handles per thread.
A training step runs the forward matmuls on the Python thread and the
backward ones on the autograd engine's device thread, hence two. Each is
allocated at that thread's first matmul and kept until the process ends (or
``torch._C._cuda_clearCublasWorkspaces()``)."""

_LARGE_WORKSPACE_ARCHS = frozenset({"hopper", "blackwell"})

#: The architectures the runtime figures know (those of the GPU catalog).
KNOWN_ARCHS = ARCHS


@dataclass(frozen=True)
class RuntimeOverhead:
    """Runtime memory of one training process on one GPU.

    ``context_bytes`` lies outside the caching allocator and counts only
    toward the device total. ``cublas_workspace_allocs`` are the request
    sizes torch sends through the caching allocator (replay them as
    allocations, in order, at the first matmul of the step);
    ``cublas_workspace_bytes`` is their sum.
    """

    context_bytes: int
    cublas_workspace_bytes: int
    cublas_workspace_allocs: tuple[int, ...]
    notes: tuple[str, ...]


def _check_arch(gpu_arch: str | None) -> str | None:
    if gpu_arch is None:
        return None
    arch = gpu_arch.strip().lower()
    if arch not in KNOWN_ARCHS:
        raise ValueError(
            f"gpu_arch {gpu_arch!r} is not a known architecture; "
            f"use one of {', '.join(KNOWN_ARCHS)} (or None for the defaults)"
        )
    return arch


def _check_count(name: str, value: int | None, minimum: int) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def default_cublas_workspace_bytes(gpu_arch: str | None) -> int:
    """torch's default cuBLAS workspace size for an architecture."""
    arch = _check_arch(gpu_arch)
    return CUBLAS_WORKSPACE_LARGE_BYTES if arch in _LARGE_WORKSPACE_ARCHS else CUBLAS_WORKSPACE_DEFAULT_BYTES


def parse_cublas_workspace_config(config: str) -> int:
    """Workspace bytes for a ``CUBLAS_WORKSPACE_CONFIG`` value such as ``:4096:8``.

    Each ``:SIZE:COUNT`` pair adds SIZE KiB x COUNT, as torch 2.6+ computes it.
    """
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    if not pairs:
        raise ValueError(
            f"CUBLAS_WORKSPACE_CONFIG {config!r} has no ':SIZE:COUNT' pair; expected e.g. ':4096:8' or ':4096:2:16:8'"
        )
    return sum(int(size) * KiB * int(count) for size, count in pairs)


def runtime_overhead(
    gpu_arch: str | None,
    *,
    context_bytes: int | None = None,
    cublas_workspace_bytes: int | None = None,
    cublas_workspace_config: str | None = None,
    num_cublas_workspaces: int = DEFAULT_NUM_CUBLAS_WORKSPACES,
    unified_cublaslt_workspace: bool = True,
    cublaslt_workspace_bytes: int | None = None,
) -> RuntimeOverhead:
    """Runtime memory for a training process on a GPU of ``gpu_arch``.

    Args:
        gpu_arch: ``volta``, ``turing``, ``ampere``, ``ada``, ``hopper``,
            ``blackwell`` or None (pre-Hopper defaults).
        context_bytes: measured CUDA context; default: per-architecture
            calibration if any, else ``DEFAULT_CUDA_CONTEXT_BYTES``.
        cublas_workspace_bytes: size of one cuBLAS workspace; overrides both
            the architecture default and ``cublas_workspace_config``.
        cublas_workspace_config: the ``CUBLAS_WORKSPACE_CONFIG`` value the run
            will use (pass ``os.environ.get("CUBLAS_WORKSPACE_CONFIG")``).
        num_cublas_workspaces: (handle, stream) pairs that run matmuls; 2 for
            forward + backward on one stream.
        unified_cublaslt_workspace: cuBLASLt shares the cuBLAS workspace
            (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``, the default of recent torch
            builds). When False, each pair also gets a cuBLASLt workspace.
        cublaslt_workspace_bytes: cuBLASLt workspace size when not unified
            (``CUBLASLT_WORKSPACE_SIZE`` x 1024); default 1 MiB.
    """
    arch = _check_arch(gpu_arch)
    _check_count("context_bytes", context_bytes, 0)
    _check_count("cublas_workspace_bytes", cublas_workspace_bytes, 0)
    _check_count("num_cublas_workspaces", num_cublas_workspaces, 0)
    _check_count("cublaslt_workspace_bytes", cublaslt_workspace_bytes, 0)
    notes: list[str] = []

    if context_bytes is None:
        context_bytes = CUDA_CONTEXT_BYTES_BY_ARCH.get(arch or "", DEFAULT_CUDA_CONTEXT_BYTES)
        notes.append(
            f"CUDA context {format_bytes(context_bytes)} is an estimate; "
            "calibrate it on this GPU (nvidia-smi used minus torch.cuda.memory_reserved())"
        )
    if cublas_workspace_bytes is not None:
        workspace = cublas_workspace_bytes
    elif cublas_workspace_config:
        workspace = parse_cublas_workspace_config(cublas_workspace_config)
        notes.append(f"cuBLAS workspace {format_bytes(workspace)} from CUBLAS_WORKSPACE_CONFIG")
    else:
        workspace = default_cublas_workspace_bytes(arch)
        if arch is None:
            notes.append("GPU architecture unknown: pre-Hopper cuBLAS workspace size assumed")
    allocs = [workspace] * num_cublas_workspaces
    if not unified_cublaslt_workspace:
        lt = CUBLASLT_WORKSPACE_DEFAULT_BYTES if cublaslt_workspace_bytes is None else cublaslt_workspace_bytes
        allocs += [lt] * num_cublas_workspaces
    allocs = [n for n in allocs if n > 0]
    return RuntimeOverhead(
        context_bytes=context_bytes,
        cublas_workspace_bytes=sum(allocs),
        cublas_workspace_allocs=tuple(allocs),
        notes=tuple(notes),
    )
