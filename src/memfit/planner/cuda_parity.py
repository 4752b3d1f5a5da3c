"""Make the fake CPU step allocate what the CUDA step allocates.

The planner runs the step on a fake CPU device. Most ops allocate the same on CPU and CUDA (their
outputs have the same shapes and dtypes); the exceptions are rewritten here, each one named,
explained and tested:

- ``bitsandbytes::gemm_4bit`` (QLoRA forward): its fake implementation allocates only the output.
  On CUDA, for more than 1,536 rows (any training batch of 2k+ tokens) bitsandbytes dequantizes the
  whole weight to the compute dtype and calls ``linear`` (``_dequant_linear_fallback``); with double
  quantization it first dequantizes the absmax to fp32. Both transients are real device memory at
  the moment of the matmul, so the planner runs that same decomposition.
- transformers' offloaded checkpointing (``torch.autograd.graph.save_on_cpu``; only the
  ``--recipe hf`` step uses it, memfit's own offload runs as on CUDA already, see
  :mod:`memfit.step.offload`): on CUDA, saving copies a layer's
  input into pinned host memory and the recomputation copies it back to the device. On the fake
  CPU device the copy back is a no-op (the tensor is already "on the CPU"), so
  :func:`offload_parity` makes it a device copy, as on CUDA. The pinned copy itself is counted as
  host memory by the tracker.
- bitsandbytes 8-bit optimizers: their state initialisation (uint8 states, fp32 block absmax, 32-bit
  states for small tensors) runs as is; the update is one in-place CUDA kernel that allocates
  nothing, while the CPU implementation reads values (impossible on fake tensors), so the planner
  skips the update (:func:`plan_bitsandbytes_optimizer`). Paged states (CUDA unified memory, for
  tensors of 100k elements or more) live outside the caching allocator: the tracker counts them
  as ``paged``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.planner.tracker import MemoryTracker

#: bitsandbytes' 4-bit matmul op, by name (importing bitsandbytes to look it up costs seconds).
_BNB_GEMM_4BIT = "bitsandbytes::gemm_4bit"


class CudaParityMode(TorchDispatchMode):
    """Rewrite ops whose CPU memory behaviour differs from CUDA's (enter it above the tracker)."""

    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "bitsandbytes" and func.name() == _BNB_GEMM_4BIT:
            return self._gemm_4bit_as_cuda(*args, **kwargs)
        return func(*args, **kwargs)

    def _gemm_4bit_as_cuda(
        self,
        A,
        B,
        shapeB,
        absmax,
        blocksize,
        quant_type,
        bias=None,
        absmax_8bit=None,
        absmax_code=None,
        absmax_offset=None,
    ):
        # Ops called here go to the next mode down (the tracker), so each transient is counted
        # while it is alive and freed when this frame drops it.
        ops = torch.ops.bitsandbytes
        if absmax_8bit is not None:
            absmax = ops.dequantize_blockwise.default(absmax_8bit, absmax, absmax_code, 256, torch.float32)
            absmax = absmax + absmax_offset
        dense = ops.dequantize_4bit.default(B, absmax, blocksize, quant_type, shapeB, A.dtype)
        del absmax
        return torch.nn.functional.linear(A, dense, bias)


class _SaveOnCpuAsOnCuda(torch.autograd.graph.save_on_cpu):
    """``save_on_cpu`` whose unpack makes a device copy, as the copy back to CUDA does."""

    def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
        def pack(tensor: torch.Tensor):
            packed = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
            packed.copy_(tensor)
            return packed

        def unpack(packed: torch.Tensor) -> torch.Tensor:
            return packed.clone()

        torch.autograd.graph.saved_tensors_hooks.__init__(self, pack, unpack)


@contextlib.contextmanager
def offload_parity() -> Iterator[None]:
    """While active, transformers' offloaded checkpointing allocates what it allocates on CUDA."""
    from unittest import mock

    try:
        import transformers.modeling_utils as modeling_utils
    except ImportError:  # pragma: no cover
        yield
        return
    if not hasattr(modeling_utils, "save_on_cpu"):
        yield
        return
    with mock.patch.object(modeling_utils, "save_on_cpu", _SaveOnCpuAsOnCuda):
        yield


#: bitsandbytes pages only optimizer states of tensors this large (``get_state_buffer``).
BNB_PAGED_MIN_NUMEL = 100_000


def plan_bitsandbytes_optimizer(optimizer: torch.optim.Optimizer, tracker: MemoryTracker) -> None:
    """Make a bitsandbytes 8-bit optimizer plannable on the fake CPU device (see the module doc)."""
    if not any(c.__module__.startswith("bitsandbytes") for c in type(optimizer).__mro__):
        return

    def update_in_place(group, p, gindex, pindex) -> None:
        # The CUDA kernel updates the parameter and the quantized states in place: no memory.
        return None

    optimizer.update_step = update_in_place
    if getattr(optimizer, "is_paged", False):
        plain_buffer = optimizer.get_state_buffer

        def paged_buffer(p, dtype=torch.float32):
            if p.numel() < BNB_PAGED_MIN_NUMEL:
                return plain_buffer(p, dtype=dtype)
            with tracker.outside_device("paged"):
                return torch.zeros_like(p, dtype=dtype)

        optimizer.get_state_buffer = paged_buffer
