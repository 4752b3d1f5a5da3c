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
- attention (``aten._scaled_dot_product_flash_attention_for_cpu``): the CPU runs flash attention
  for every input, CUDA picks its kernel by architecture, dtype, mask and grouped-query heads
  (:mod:`memfit.planner.exact.attention_kernels`); where CUDA would run the math kernel, the plan keeps
  what it keeps (the ``[batch, heads, seq, seq]`` softmax, the scaled query and key) until the
  attention's backward, with the scores' transients at both ends; where it would run flash or the
  memory-efficient kernel, the backward holds the workspace flash allocates for itself
  (:func:`memfit.step.attention.flash_backward_workspace_bytes`).
- bitsandbytes' LLM.int8 layers (``method: lora-8bit``): training on a CPU, bitsandbytes runs a
  dequantize-and-matmul function (``MatMul8bitFp``); on CUDA it runs ``MatMul8bitLt``, which
  quantizes each input to int8 (a 16-bit copy of it first, then ``|x| >= 6.0`` searched over the
  whole input for outlier columns), multiplies in int8 into an int32 result, dequantizes that to
  fp16 and casts it to the input's dtype; backward dequantizes the whole weight. While the mode is
  active the CUDA function runs, and its ops allocate what their CUDA kernels allocate (their
  fake implementations allocate only outputs, with an unknown number of outlier columns). Outlier
  columns themselves are planned as none: there are a handful per layer (16-bit, ``tokens x
  outliers`` each), and how many depends on the values.
- grouped matmuls (``aten._grouped_mm``, the experts of mixture-of-experts models on transformers'
  ``grouped_mm`` path): the fake implementation takes bf16 only (it copies the checks of CUDA's fast
  Hopper kernel), while CUDA runs fp32 and fp16 too, through its fallback (one matmul per expert
  into the output). The rewrite allocates what CUDA allocates for any of the three: the output, its
  rows padded to 16 bytes as CUDA lays them out.
- PyTorch's optimizers left to choose their implementation (``torch.optim.AdamW`` without ``fused``
  or ``foreach``: the Hugging Face Trainer's ``adamw_torch``): PyTorch picks foreach when every
  parameter is a plain tensor on CUDA, and the for-loop implementation on a CPU, or for fake
  tensors anywhere. Their memory differs: foreach makes ``sqrt(exp_avg_sq)`` of every parameter at
  once, a temporary as large as the parameters, where the for-loop makes one parameter's at a time.
  While the mode is active PyTorch's choice is made as on CUDA (:func:`optimizer_defaults_as_cuda`);
  foreach's ops run on the fake CPU device as lists of the same tensors.
- bitsandbytes 8-bit optimizers: their state initialisation (uint8 states, fp32 block absmax, 32-bit
  states for small tensors) runs as is; the update is one in-place CUDA kernel that allocates
  nothing, while the CPU implementation reads values (impossible on fake tensors), so the planner
  skips the update (:func:`plan_bitsandbytes_optimizer`). Paged states (CUDA unified memory, for
  tensors of 100k elements or more) live outside the caching allocator: the tracker counts them
  as ``paged``.
- bitsandbytes' 4-bit layers in evaluation mode (grpo's generation): on a CPU with AVX-512 BF16,
  bitsandbytes repacks each 4-bit weight into a CPU layout at its first forward without gradients
  (``_convert_weight_packed_for_cpu``: a new storage, the old one freed); CUDA keeps the weight as
  it is, and so does the planner (:func:`four_bit_weights_as_cuda`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.planner.exact.attention_kernels import MATH, math_saved_bytes, math_transient_bytes, sdpa_kernel
from memfit.planner.exact.tracker import MemoryTracker, known_device
from memfit.step.attention import flash_backward_workspace_bytes

#: bitsandbytes' ops rewritten here, by name (importing bitsandbytes to look them up costs seconds).
_BNB_GEMM_4BIT = "bitsandbytes::gemm_4bit"
_BNB_INT8_QUANT = "bitsandbytes::int8_vectorwise_quant"
_BNB_INT8_MIXED_MM = "bitsandbytes::int8_mixed_scaled_mm"
_BNB_INT8_DEQUANT = "bitsandbytes::int8_vectorwise_dequant"


class CudaParityMode(TorchDispatchMode):
    """Rewrite ops whose CPU memory behaviour differs from CUDA's (enter it above the tracker).

    ``arch``: the target GPU's architecture (None: Ampere or newer), which decides the attention
    kernel (:mod:`memfit.planner.exact.attention_kernels`). ``kernels`` collects the attention kernels
    CUDA would have run.
    """

    def __init__(self, tracker: MemoryTracker, arch: str | None = None) -> None:
        super().__init__()
        self.tracker = tracker
        self.arch = arch
        self.kernels: set[str] = set()
        # What the math kernel keeps for backward, by the storage of the attention's output.
        self._math_kept: dict[int, torch.Tensor] = {}
        self._int8_path = contextlib.ExitStack()

    def __enter__(self):
        self._int8_path.enter_context(int8_matmul_as_cuda())
        self._int8_path.enter_context(four_bit_weights_as_cuda())
        self._int8_path.enter_context(optimizer_defaults_as_cuda())
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._int8_path.close()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        device = known_device(func, args)
        if device is not None:
            return device
        kwargs = kwargs or {}
        if func.namespace == "bitsandbytes":
            rewrite = {
                _BNB_GEMM_4BIT: self._gemm_4bit_as_cuda,
                _BNB_INT8_QUANT: _int8_quant_as_cuda,
                _BNB_INT8_MIXED_MM: _int8_mixed_mm_as_cuda,
                _BNB_INT8_DEQUANT: _int8_dequant_as_cuda,
            }.get(func.name())
            if rewrite is not None:
                return rewrite(*args, **kwargs)
        if func is torch.ops.aten._grouped_mm.default and _is_fake(args[0]):
            return _grouped_mm_as_cuda(*args, **kwargs)
        if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
            return self._sdpa_as_cuda(func, args, kwargs)
        if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
            return self._sdpa_backward_as_cuda(func, args, kwargs)
        return func(*args, **kwargs)

    def _sdpa_as_cuda(self, func, args, kwargs):
        """CPU flash attention takes every input; CUDA may run its math kernel instead, which keeps
        the ``[batch, heads, seq, seq]`` softmax (and more) for backward: keep that much too."""
        query, key = args[0], args[1]
        mask = kwargs.get("attn_mask", args[5] if len(args) > 5 else None)
        gqa = query.shape[1] != key.shape[1]
        kernel = sdpa_kernel(
            arch=self.arch,
            dtype=str(query.dtype).removeprefix("torch."),
            head_dim=int(query.shape[-1]),
            has_mask=mask is not None,
            gqa=gqa,
        )
        self.kernels.add(kernel)
        out, lse = func(*args, **kwargs)
        # Only a forward that records for backward keeps anything (not, e.g., the no-grad forward
        # of a checkpointed layer, whose recomputation comes back here with grad on).
        if kernel == MATH and torch.is_grad_enabled():
            batch, heads, q_len, head_dim = (int(n) for n in query.shape)
            kv_len, itemsize = int(key.shape[2]), query.element_size()
            # The scores before the softmax live next to it for a moment; the rest stays for backward.
            transient = query.new_empty(
                (math_transient_bytes(batch, heads, q_len, kv_len, itemsize),), dtype=torch.uint8
            )
            kept = query.new_empty(
                (math_saved_bytes(batch, heads, q_len, kv_len, head_dim, itemsize, gqa),), dtype=torch.uint8
            )
            del transient
            storage = out.untyped_storage()
            self._math_kept[storage._cdata] = kept
            # What the kernel keeps is autograd's, as ``out`` is: it goes when ``out`` goes unsaved (a
            # non-reentrant checkpoint's first forward discards both at once), else at backward.
            weakref.finalize(storage, self._math_kept.pop, storage._cdata, None)
        elif kernel == MATH:  # its scores exist for the moment of the kernel all the same
            batch, heads, q_len, _ = (int(n) for n in query.shape)
            transient = query.new_empty(
                (math_transient_bytes(batch, heads, q_len, int(key.shape[2]), query.element_size()),), dtype=torch.uint8
            )
            del transient
        return out, lse

    def _sdpa_backward_as_cuda(self, func, args, kwargs):
        out = args[4]
        kept = self._math_kept.pop(out.untyped_storage()._cdata, None)
        query, key = args[1], args[2]
        if kept is None:
            # Flash and memory-efficient backward: the kernel's own workspace (modelled on flash's)
            # is on the device while it runs.
            batch, heads, q_len, head_dim = (int(n) for n in query.shape)
            workspace = query.new_empty(
                (
                    flash_backward_workspace_bytes(
                        batch=batch,
                        q_len=q_len,
                        kv_len=int(key.shape[2]),
                        heads=heads,
                        kv_heads=int(key.shape[1]),
                        head_dim=head_dim,
                        itemsize=query.element_size(),
                    ),
                ),
                dtype=torch.uint8,
            )
            grads = func(*args, **kwargs)
            del workspace
            return grads
        batch, heads, q_len, _ = (int(n) for n in query.shape)
        # The gradients of the softmax and of the scores, beside what forward kept.
        transient = query.new_empty(
            (2 * math_transient_bytes(batch, heads, q_len, int(key.shape[2]), query.element_size()),), dtype=torch.uint8
        )
        grads = func(*args, **kwargs)
        del transient, kept
        return grads

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


def _is_fake(tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def _grouped_mm_as_cuda(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """``aten._grouped_mm``'s output as CUDA makes it (``create_grouped_gemm_output_tensor``): the
    shape of the grouped product, each row's last dimension padded to 16 bytes, in ``out_dtype`` or
    the input's; whichever kernel then fills it (the bf16 one, or the per-expert fallback of fp32
    and fp16) allocates nothing more."""
    dtype = out_dtype or mat_a.dtype
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    if a_2d:
        size = (
            [int(offs.shape[0]), int(mat_a.shape[0]), int(mat_b.shape[1])]
            if b_2d
            else [int(mat_a.shape[0]), int(mat_b.shape[-1])]
        )
    else:
        size = (
            [int(mat_a.shape[1]), int(mat_b.shape[1])]
            if b_2d
            else [int(mat_a.shape[0]), int(mat_a.shape[1]), int(mat_b.shape[-1])]
        )
    alignment = 16 // dtype.itemsize
    padded = -(-size[-1] // alignment) * alignment
    stride = [padded, 1] if a_2d != b_2d else [size[1] * padded, padded, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)


@contextlib.contextmanager
def int8_matmul_as_cuda() -> Iterator[None]:
    """While active, bitsandbytes' 8-bit layers run the function they run on CUDA (``MatMul8bitLt``)
    on any device; a no-op where bitsandbytes is not imported (no 8-bit layer can exist then)."""
    import sys

    bnb = sys.modules.get("bitsandbytes")
    if bnb is None or not hasattr(bnb, "matmul"):
        yield
        return
    from unittest import mock

    from bitsandbytes.autograd._functions import MatMul8bitLt, MatmulLtState

    def matmul(A, B, out=None, state=None, threshold=0.0, bias=None):
        state = state or MatmulLtState()
        if threshold > 0.0:
            state.threshold = threshold
        return MatMul8bitLt.apply(A, B, out, bias, state)

    with mock.patch.object(bnb, "matmul", matmul):
        yield


@contextlib.contextmanager
def four_bit_weights_as_cuda() -> Iterator[None]:
    """While active, bitsandbytes' 4-bit layers keep their weights as CUDA does (no CPU repacking in
    evaluation mode); a no-op where bitsandbytes is not imported (no 4-bit layer can exist then)."""
    import sys

    modules = sys.modules.get("bitsandbytes.nn.modules")
    if modules is None or not hasattr(modules, "_convert_weight_packed_for_cpu"):
        yield
        return
    from unittest import mock

    def kept(weight, quant_state, *args, **kwargs):
        return weight, quant_state

    with mock.patch.object(modules, "_convert_weight_packed_for_cpu", kept):
        yield


@contextlib.contextmanager
def optimizer_defaults_as_cuda() -> Iterator[None]:
    """While active, PyTorch's Adam and AdamW left to choose (``foreach=None``, ``fused=None``) choose
    as for parameters on CUDA: foreach (the fused kernel only when asked for, as on CUDA)."""
    from unittest import mock

    import torch.optim.adam as adam

    def as_on_cuda(params, differentiable: bool, use_fused: bool = False) -> tuple[bool, bool]:
        if torch.jit.is_scripting() or differentiable:
            return False, False
        # CUDA supports both for floating-point tensors; PyTorch prefers foreach unless fused is asked.
        return use_fused, not use_fused

    with mock.patch.object(adam, "_default_to_fused_or_foreach", as_on_cuda):
        yield


# Ops called in these rewrites go to the next mode down (the tracker), which counts each tensor
# they make while it is alive; bitsandbytes' own kernels give the values on a real CPU run.


def _int8_quant_as_cuda(A, threshold=0.0):
    """``int8_vectorwise_quant`` as CUDA runs it: the int8 rows and their fp32 scales, then, with a
    threshold, ``A.abs() >= threshold`` over the whole input (a 16-bit and a bool tensor of its
    size) to find outlier columns; none are planned (see the module doc)."""
    ops = torch.ops.bitsandbytes
    out_row, row_stats, _ = ops.int8_vectorwise_quant.default(A, 0.0)
    if threshold == 0.0:
        return out_row, row_stats, None
    magnitude = A.new_empty(A.shape)
    outliers = A.new_empty(A.shape, dtype=torch.bool)
    del magnitude
    found = outliers.new_empty(())  # outliers.any(), read on the host
    del found, outliers
    return out_row, row_stats, A.new_empty((0,), dtype=torch.int64)


def _int8_mixed_mm_as_cuda(A, CA, CB, SCA, SCB, outlier_cols=None, bias=None):
    """``int8_mixed_scaled_mm`` as bitsandbytes runs it on CUDA, without outlier columns: the int8
    product in int32, dequantized to fp16 (a 16-bit bias added to it, another in place), then cast
    to the input's dtype."""
    ops = torch.ops.bitsandbytes
    no_outliers = A.new_empty((0,))
    product = ops.int8_linear_matmul.default(CA, CB)
    fused = bias if bias is not None and bias.dtype == torch.float16 else None
    dequantized = ops.int8_mm_dequant.default(product, SCA, SCB, dtype=torch.float16, bias=fused)
    if bias is not None and fused is None:
        dequantized.add_(bias)
    out = dequantized.to(A.dtype)
    del dequantized, product
    return out, no_outliers


def _int8_dequant_as_cuda(A, stats):
    """``int8_vectorwise_dequant``: bitsandbytes' default kernel (the one CUDA runs too), op by op."""
    return A * stats.view(-1, 1) * 7.874015718698502e-3


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


class _PlannedGradScaler(torch.amp.GradScaler):
    """fp16's GradScaler as the planner runs it: the same tensors (scale, growth tracker, the
    per-device inf flags), but the optimizer always steps. The real scaler reads the inf flag's
    value to decide; fake tensors have none, and a skipped step would plan no optimizer states."""

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        return optimizer.step(*args, **kwargs)


def planned_grad_scaler(step, device: str) -> torch.amp.GradScaler | None:
    """The loss scaler ``step`` (a :class:`~memfit.step.builder.TrainingStep`) needs, for a plan."""
    return _PlannedGradScaler(device) if step.scales_loss else None
