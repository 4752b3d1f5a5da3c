"""What the Hugging Face Trainer's stack does to a model's dtypes, shared by every tool's key map.

A tool hands the Trainer a model whose parameters are in some dtype (the one it loaded them in,
or cast them to) and sets the Trainer's ``bf16`` / ``fp16``: forward under ``torch.autocast``
(accelerate's ``mixed_precision``). What is stored in the end, which is what memory depends on:

- DeepSpeed with a ``bf16`` or ``fp16`` section casts every parameter to that format
  (``engine.py``, ``_cast_module_mixed_precision``) and keeps fp32 master weights and optimizer
  states of what trains (ZeRO's fp32 partitions, ``BF16_Optimizer`` at stage 0). ZeRO stages 1 to
  3 keep those fp32 partitions without a 16-bit section too.
- FSDP under mixed precision upcasts the trained parameters to fp32 (accelerate's
  ``fsdp2_prepare_model`` and ``Accelerator.prepare_model``, "following DeepSpeed's strategy");
  a frozen base stays as it is.
- Otherwise the parameters stay as the tool left them: a full fine-tuning of fp32 parameters
  under ``bf16`` is mixed precision (memfit's ``bf16-mixed``), of bf16 parameters pure bf16 with
  autocast (the ``hf`` recipe's ``bf16``).

:func:`trainer_precision` turns that into memfit's ``precision`` knob (see
:func:`memfit.spec.precision_regime`), or a :class:`Planned` value where memfit has no precision
for what is stored (a LoRA base in fp32 under autocast).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from memfit.interop.keys import Found, Planned

#: The 16-bit formats, as memfit names them.
HALVES = ("bf16", "fp16")


def settle_zero_precision(ctx: Any, half: str | None) -> None:
    """The DeepSpeed config's ``bf16.enabled`` / ``fp16.enabled: "auto"`` as the Trainer fills them:
    from its ``bf16`` and ``fp16`` (``half``; ``trainer_config_process``)."""
    zero = ctx.zero
    if zero is None:
        return
    ctx.zero = replace(
        zero,
        bf16=(half == "bf16") if zero.bf16 == "auto" else zero.bf16,
        fp16=(half == "fp16") if zero.fp16 == "auto" else zero.fp16,
    )


def zero_half(ctx: Any) -> str | None:
    """The 16-bit format the config's DeepSpeed casts the model to (its ``bf16`` or ``fp16``
    section, once :func:`settle_zero_precision` has filled ``"auto"``), or None."""
    zero = ctx.zero
    if zero is None:
        return None
    return "bf16" if zero.bf16 is True else "fp16" if zero.fp16 is True else None


def uses_fsdp(ctx: Any) -> bool:
    """Whether the config shards with FSDP (a shard mode read from its FSDP keys, not DeepSpeed)."""
    return ctx.zero is None and ctx.knobs.get("shard") not in (None, "none")


def trainer_precision(method: str, weights: str, half: str | None, ctx: Any, *, where: str) -> Any:
    """memfit's ``precision`` for a model the Trainer gets with its parameters in ``weights`` (bf16,
    fp16 or fp32: the trained parameters for full fine-tuning, the frozen base for LoRA; QLoRA's
    compute dtype) and its ``half`` (``bf16`` / ``fp16``: autocast; None: off). ``ctx`` holds the
    config's DeepSpeed settings and shard mode; ``where`` says where ``weights`` comes from, for
    the reasons given (``dtype: float32``)."""
    cast = zero_half(ctx)
    if cast is not None:
        # Every parameter is cast to DeepSpeed's format; what trains has fp32 master copies.
        if method != "full":
            return cast
        _zero_masters(ctx, cast)
        return f"{cast}-mixed"
    if method == "qlora":
        if weights in HALVES:
            return weights  # the 4-bit layers' compute dtype
        if half is not None:
            return half  # fp32 compute dtype, but autocast runs the matmuls in 16 bits
        return Planned("bf16", "4-bit layers computing in fp32 (no bf16 or fp16): planned computing in bf16")
    if method == "full":
        return _full(weights, half, ctx)
    if weights == "fp32" and half is not None:
        return Planned(
            "fp32",
            f"{half} autocast on a LoRA base kept in fp32 ({where}): memfit's precisions keep a "
            "frozen base in 16 bits under autocast; planned as fp32 without autocast (the same fp32 "
            "base and adapters; activations at twice their 16-bit size; a base loaded in bf16 is planned as it runs)",
        )
    return weights


def _full(weights: str, half: str | None, ctx: Any) -> str:
    """Full fine-tuning without DeepSpeed's 16-bit cast: what the trained parameters are stored in."""
    if weights == "fp32":
        return f"{half}-mixed" if half is not None else "fp32"
    if half is not None and uses_fsdp(ctx):
        return f"{half}-mixed"  # accelerate upcasts the trained parameters to fp32 under FSDP
    if ctx.zero is not None and ctx.zero.stage >= 1:
        _zero_masters(ctx, weights)  # ZeRO's fp32 partitions of 16-bit parameters
        return f"{weights}-mixed"
    return weights


def _zero_masters(ctx: Any, half: str) -> None:
    """Say how DeepSpeed's layout differs from memfit's mixed precision, which it is planned as."""
    ctx.approximated.append(
        Found(
            "deepspeed",
            ctx.zero.path,
            f"DeepSpeed keeps the model and its gradients in {half} and fp32 master weights partitioned with the AdamW "
            f"states: planned as {half}-mixed (fp32 weights and gradients), the same 16 bytes a parameter, spread otherwise "
            f"across the GPUs",
            "precision",
        )
    )
