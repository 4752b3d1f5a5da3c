"""A relative throughput estimate for a training configuration (an estimate, used to rank fits).

Pure arithmetic, no device: the cost of one token is counted in units of one forward pass over the
model's weights (``2 x params`` FLOPs), and the factors below are stated assumptions, not
measurements:

- backward costs two forwards when the weights get gradients (full fine-tuning) and one forward
  when only activations need gradients (LoRA and QLoRA: frozen weights get none; the adapters'
  own matmuls are rank-r and negligible);
- activation checkpointing recomputes the forward once more;
- offloaded checkpointing also moves each layer's input to the host and back; on a PCIe link this
  is partly hidden behind compute: a 10% surcharge is assumed;
- QLoRA dequantizes every 4-bit weight in forward and backward: a 25% surcharge is assumed (the
  published QLoRA speed cost is of that order); an 8-bit base (LLM.int8: each input quantized, the
  weight dequantized in backward) is assumed to cost the same;
- tiling (MLP and norms over chunks of the sequence) recomputes the MLP once more: about two
  thirds of a Llama-shaped decoder layer's FLOPs, i.e. 2/3 of a forward;
- small micro-batches leave the GPU underused: efficiency ``tokens / (tokens + 1024)`` per
  micro-batch, i.e. half speed at 1,024 tokens and close to full from ~16k tokens.

Precision is not counted: a search plans all of one method in one precision, and pure and mixed
16-bit precision run their matmuls in the same format (mixed precision's casts of the weights to
16 bits are left out).
"""

from __future__ import annotations

from typing import Any

from memfit.spec import tiles_sequence

QLORA_DEQUANT_SURCHARGE = 0.25
OFFLOAD_SURCHARGE = 0.10
HALF_EFFICIENCY_TOKENS = 1024
TILING_FORWARD_UNITS = 2.0 / 3.0


def forward_units(spec: dict[str, Any]) -> float:
    """Forward-pass equivalents of compute per token for ``spec`` (a RunSpec's ``knobs()``)."""
    units = 1.0  # forward
    units += 2.0 if spec["method"] == "full" else 1.0  # backward
    if spec["checkpointing"] in ("on", "offload"):
        units += 1.0  # recomputation
    if tiles_sequence(spec.get("tiling", "auto"), spec.get("recipe", "memfit"), spec["batch_size"] * spec["seq_len"]):
        units += TILING_FORWARD_UNITS
    return units


def relative_cost(spec: dict[str, Any]) -> float:
    """Estimated time per token, in forward-pass units, including surcharges and utilisation."""
    cost = forward_units(spec)
    if spec["method"] in ("qlora", "lora-8bit"):
        cost *= 1.0 + QLORA_DEQUANT_SURCHARGE
    if spec["checkpointing"] == "offload":
        cost *= 1.0 + OFFLOAD_SURCHARGE
    tokens = spec["batch_size"] * spec["seq_len"]
    efficiency = tokens / (tokens + HALF_EFFICIENCY_TOKENS)
    return cost / efficiency


def relative_speeds(specs: list[dict[str, Any]]) -> list[float]:
    """Speed of each spec relative to the fastest of them (the fastest gets 1.0)."""
    if not specs:
        return []
    costs = [relative_cost(s) for s in specs]
    best = min(costs)
    return [best / c for c in costs]
