"""LLM.int8 as CUDA runs it: the function, the kernels' allocations, the values bitsandbytes gives."""

from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from memfit.planner.exact.cuda_parity import CudaParityMode  # noqa: E402
from memfit.planner.exact.tracker import MemoryTracker  # noqa: E402


def _layer(bias: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    dense = torch.randn(24, 16, dtype=torch.float16) * 0.1
    layer = bnb.nn.Linear8bitLt(16, 24, bias=bias, has_fp16_weights=False, threshold=6.0)
    layer.weight = bnb.nn.Int8Params(dense, requires_grad=False, has_fp16_weights=False)._quantize(torch.device("cpu"))
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(24, dtype=torch.bfloat16), requires_grad=False)
    return layer.train()


def test_on_a_cpu_the_mode_runs_the_function_cuda_runs_and_leaves_it_as_it_was():
    layer = _layer()
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16, requires_grad=True)
    assert type(layer(x).grad_fn).__name__ == "MatMul8bitFpBackward"  # bitsandbytes' CPU choice
    tracker = MemoryTracker()
    with tracker, CudaParityMode(tracker):
        out = layer(x)
        assert type(out.grad_fn).__name__ == "MatMul8bitLtBackward"
        out.float().sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert type(layer(x).grad_fn).__name__ == "MatMul8bitFpBackward"


def test_the_quantization_holds_what_the_cuda_kernel_holds():
    ops = torch.ops.bitsandbytes
    A = torch.randn(32, 64, dtype=torch.float16)
    tracker = MemoryTracker()
    with tracker, CudaParityMode(tracker):
        rows, scales, outliers = ops.int8_vectorwise_quant.default(A, 6.0)
    want_rows, want_scales, _ = ops.int8_vectorwise_quant.default(A, 0.0)
    assert torch.equal(rows, want_rows) and torch.equal(scales, want_scales)
    assert outliers.dtype == torch.int64 and outliers.numel() == 0  # outlier columns are planned as none
    made = [(a.op, a.nbytes) for a in tracker.result().allocations]
    # int8 rows and fp32 scales (bitsandbytes' kernel), then |A| (fp16) and the >= 6.0 mask (bool) over the whole input
    assert ("new_empty.default", 32 * 64 * 2) in made and ("new_empty.default", 32 * 64) in made


def test_the_int8_product_is_an_int32_tensor_dequantized_to_fp16_then_cast():
    layer = _layer(bias=True)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    tracker = MemoryTracker()
    with torch.no_grad(), tracker, CudaParityMode(tracker):
        out = layer(x)
    made = [a for a in tracker.result().allocations if a.place == "device"]
    by_op = {(a.op, a.nbytes) for a in made}
    assert ("int8_linear_matmul.default", 512) in by_op  # 4 x 24 int32 (one 512-byte block)
    assert out.dtype == torch.bfloat16 and out.shape == (4, 24)
    # the values: what bitsandbytes' kernels give for the CUDA path without outliers
    ops = torch.ops.bitsandbytes
    with torch.no_grad():
        CA, SCA, _ = ops.int8_vectorwise_quant.default(x.to(torch.float16), 0.0)
        product = ops.int8_linear_matmul.default(CA, layer.state.CB)
        want = (
            ops.int8_mm_dequant.default(product, SCA, layer.state.SCB, dtype=torch.float16)
            .add_(layer.bias)
            .to(torch.bfloat16)
        )
    assert torch.equal(out, want)


def test_dequantizing_a_weight_is_bitsandbytes_default_kernel_op_by_op():
    ops = torch.ops.bitsandbytes
    weight = _layer().weight
    tracker = MemoryTracker()
    with tracker, CudaParityMode(tracker):
        got = ops.int8_vectorwise_dequant.default(weight.CB, weight.SCB)
    assert torch.equal(got, ops.int8_vectorwise_dequant.default(weight.CB, weight.SCB))
    assert sum(1 for a in tracker.result().allocations if a.nbytes >= 24 * 16 * 4) == 2  # two fp32 weight-sized tensors
