"""Which kernel CUDA's ``scaled_dot_product_attention`` picks, and what each keeps (pure functions).

The planner runs attention on the CPU, where one kernel (flash attention for CPU) takes every
input. CUDA picks among three, by GPU architecture, dtype, head size, mask and grouped-query heads
(PyTorch's ``sdp_utils``, in this order of preference):

- **flash**: compute capability 8.0+ (Ampere and newer), fp16 / bf16, head size up to 256, no
  attention mask; grouped-query heads taken as they are. Keeps the output and the log-sum-exp.
- **memory-efficient**: any supported GPU, fp32 / fp16 (bf16 from Ampere on), takes a mask (as an
  additive bias), but not grouped-query heads passed as such (``enable_gqa``). Keeps the output and
  the log-sum-exp, like flash.
- **math**: everything else. Plain PyTorch ops: the ``[batch, heads, seq, seq]`` scores are
  materialised, and their softmax is kept for backward.

transformers passes grouped-query heads as such (``enable_gqa=True``) when there is no mask, and
repeats the key / value heads itself when there is one. So fp32 with grouped-query heads (Llama-3,
Qwen2.5), or fp16 on a card without flash attention (T4, V100), falls to the math kernel;
:mod:`memfit.planner.exact.cuda_parity` then makes the plan keep what the math kernel keeps.
"""

from __future__ import annotations

FLASH, EFFICIENT, MATH = "flash", "memory-efficient", "math"

#: Architectures with flash attention in PyTorch (compute capability 8.0 and newer).
FLASH_ARCHS = ("ampere", "ada", "hopper", "blackwell")
#: Architectures whose memory-efficient kernel takes bf16.
BF16_ARCHS = FLASH_ARCHS


def sdpa_kernel(*, arch: str | None, dtype: str, head_dim: int, has_mask: bool, gqa: bool) -> str:
    """The kernel CUDA's SDPA runs for these inputs (``dtype``: ``float32``, ``float16``,
    ``bfloat16``; ``arch`` None: Ampere or newer is assumed; ``gqa``: fewer key / value heads than
    query heads, passed as such)."""
    flash_arch = arch is None or arch in FLASH_ARCHS
    half = dtype in ("float16", "bfloat16")
    if flash_arch and half and head_dim <= 256 and not has_mask:
        return FLASH
    if gqa:
        return MATH  # the memory-efficient kernel does not take grouped-query heads
    if dtype == "bfloat16" and not (arch is None or arch in BF16_ARCHS):
        return MATH
    return EFFICIENT


def math_saved_bytes(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, itemsize: int, gqa: bool) -> int:
    """What the math kernel keeps for backward beyond what flash keeps: the softmax of the scores,
    the scaled query and key, and with grouped-query heads the value repeated for every head."""
    scores = batch * heads * q_len * kv_len * itemsize
    scaled = batch * heads * (q_len + kv_len) * head_dim * itemsize
    repeated_value = batch * heads * kv_len * head_dim * itemsize if gqa else 0
    return scores + scaled + repeated_value


def math_transient_bytes(batch: int, heads: int, q_len: int, kv_len: int, itemsize: int) -> int:
    """The scores before the softmax, alive with their softmax for a moment (forward), and in
    backward the gradient of the softmax and of the scores: one more ``[batch, heads, seq, seq]``."""
    return batch * heads * q_len * kv_len * itemsize
