"""Forward under ``torch.autocast``: mixed precision as the step runs it.

Under ``--precision bf16-mixed`` / ``fp16-mixed`` (and the ``hf`` recipe's bf16 / fp16) the loss,
and so the model's forward, runs inside ``torch.autocast``: matmuls and attention compute in the
16-bit format from parameters stored in fp32 (full fine-tuning) or in 16 bits (a frozen LoRA base),
as the Hugging Face ``Trainer`` runs ``bf16=True``. Backward runs outside it, as PyTorch advises;
what backward recomputes (checkpointed layers: ``torch.utils.checkpoint`` restores the state
itself; tiled MLPs: :func:`same_autocast`) runs under the autocast its forward ran under.

memfit's own autograd functions (the fused loss, document attention, LoRA inputs, tiling) are not
on autocast's op lists; each asks :func:`active_autocast_dtype` and computes as autocast would.
The planner runs the same code under fake tensors on the CPU, whose autocast casts the same ops to
16 bits; which ops CUDA's autocast runs in fp32 differs a little, see docs/plan.md ("Precision").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from memfit.spec import RunSpec


def autocast_dtype(spec: RunSpec) -> torch.dtype | None:
    """The format ``spec``'s forward runs in under autocast, or None where it runs without."""
    from memfit.models.build import DTYPES

    name = spec.autocast_precision
    return DTYPES[name] if name is not None else None


def active_autocast_dtype(device_type: str) -> torch.dtype | None:
    """The format autocast computes in on ``device_type`` right now, or None where it is off."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


@contextlib.contextmanager
def same_autocast(device_type: str, dtype: torch.dtype | None) -> Iterator[None]:
    """Run a recomputation under the autocast its forward ran under (``dtype``; None: without).

    One context around all of a layer's chunks: autocast keeps one 16-bit copy of each fp32 weight
    while it is entered, and drops the copies when it is left.
    """
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device_type, dtype=dtype):
        yield
