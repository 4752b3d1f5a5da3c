"""Mixture-of-experts steps under fake tensors count what real ones count, in every precision: the
experts' grouped matmuls (whose fake implementation takes bf16 only) allocate what CUDA allocates,
4-bit experts dequantize one expert at a time into the workspace their op counts."""

from __future__ import annotations

import pytest
import torch

from memfit.planner.exact.cuda_parity import CudaParityMode
from memfit.planner.exact.simulate import simulate
from memfit.planner.exact.tracker import MemoryTracker
from memfit.spec import make_spec
from memfit.train.conformance import TINY_MODELS


@pytest.mark.parametrize(
    "name, knobs",
    [
        ("qwen3_moe", {"method": "lora", "precision": "fp32"}),
        ("mixtral", {"method": "lora", "precision": "fp16"}),
        ("gpt_oss", {"method": "full", "precision": "fp32", "padding_free": "off", "batch_size": 2}),
        ("llama4_text", {"method": "lora", "precision": "bf16", "targets": ("experts", "router")}),
        ("qwen3_moe", {"method": "qlora", "precision": "bf16"}),
        # rank 4 in fp16: the LoRA pairs are padded to the 16 bytes a grouped matmul's rows take
        ("llama4_text", {"method": "qlora", "precision": "fp16", "rank": 4, "padding_free": "off", "batch_size": 2}),
    ],
)
def test_fake_and_real_expert_steps_count_the_same_bytes(name, knobs):
    spec = make_spec(seq_len=32, **knobs)
    fake = simulate(TINY_MODELS[name], spec, fake=True).tracker
    real = simulate(TINY_MODELS[name], spec, fake=False).tracker
    assert fake.peak.allocated_bytes == real.peak.allocated_bytes > 0
    assert fake.peak.categories == real.peak.categories


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_grouped_matmul_is_its_output_with_rows_padded_to_16_bytes(dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    tracker = MemoryTracker()
    with FakeTensorMode(), tracker, CudaParityMode(tracker):
        tokens = torch.empty(10, 8, dtype=dtype)
        weights = torch.empty(3, 8, 6, dtype=dtype)  # 6 outputs: 12 or 24 bytes a row, padded to 16 or 32
        offsets = torch.tensor([3, 7, 10], dtype=torch.int32)
        out = torch.nn.functional.grouped_mm(tokens, weights, offs=offsets)
        assert out.shape == (10, 6) and out.dtype == dtype
        padded = 16 // dtype.itemsize * -(-6 * dtype.itemsize // 16)
        assert out.stride() == (padded, 1)
