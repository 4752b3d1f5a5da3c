"""PEFT's adapters on weights (``target_parameters``): which weight each pair adapts, and where that
weight lies in the checkpoint.

PEFT wraps a targeted weight in a ``ParamWrapper``; two weights of one module (a fused experts
module's ``gate_up_proj`` and ``down_proj``) nest, the module's first weight innermost, so the pairs
sit at ``<module>`` and ``<module>.base_layer``. A fused expert weight ``[experts, ...]`` has a rank-r
pair for each expert. transformers 5 fuses the experts that checkpoints store apart (one tensor an
expert, gate and up apart, under old names): a merged weight is written back there, expert by
expert, as ``save_pretrained`` writes it (:func:`checkpoint_pieces`, by transformers' own renaming).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .adapter import Adapter, LoraPair, make_pair
from .base import ModelStructure


@dataclass(frozen=True)
class Piece:
    """Where a checkpoint tensor lies in a fused weight: its expert, and its part of that expert's
    rows (gate and up of a ``gate_up_proj``: part 0 and 1 of 2)."""

    base_key: str
    expert: int
    part: int
    parts: int


def resolve_weight_pairs(adapter: Adapter, structure: ModelStructure, problems: list[str]) -> dict[str, LoraPair]:
    """The pairs of ``adapter.wrapped`` by the weight they adapt (``<module>.<weight>``); a pair that
    adapts no weight (a target name that only looked like one) becomes a plain linear pair."""
    targets = adapter.config.get("target_parameters") or []
    resolved: dict[str, LoraPair] = {}
    for path, (a_key, b_key, magnitude_key) in sorted(adapter.wrapped.items()):
        module = path.replace(".base_layer", "")
        depth = path.count(".base_layer")
        targeted = [
            (name, shape) for name, shape in structure.weights.get(module, []) if _targeted(f"{module}.{name}", targets)
        ]
        if depth >= len(targeted):
            pair = make_pair(adapter, path, "linear", a_key, b_key, magnitude_key, problems)
            if pair is not None:
                adapter.pairs[path] = pair
            continue
        name, shape = targeted[len(targeted) - 1 - depth]  # the first weight is wrapped first: innermost
        experts = shape[0] if len(shape) == 3 else 1
        swapped = len(shape) == 3 and not structure.transposed.get(module, False)
        pair = make_pair(
            adapter,
            module,
            "linear",
            a_key,
            b_key,
            magnitude_key,
            problems,
            experts=experts,
            parameter=name,
            swapped=swapped,
        )
        if pair is not None:
            resolved[f"{module}.{name}"] = pair
    return resolved


def _targeted(key: str, targets) -> bool:
    """PEFT's match of a weight ``<module>.<weight>`` against ``target_parameters``: whole, or a dotted tail."""
    return any(key == t or key.endswith("." + t) for t in targets)


def checkpoint_pieces(base_keys, structure: ModelStructure) -> dict[str, list[Piece]]:
    """For each fused weight the checkpoint stores apart, its tensors (by transformers' conversion:
    ``MergeModulelist`` stacks the experts, ``Concatenate`` joins gate and up)."""
    if not structure.converters:
        return {}
    from transformers.core_model_loading import rename_source_key

    pieces: dict[str, list[Piece]] = {}
    for key in base_keys:
        target, pattern = rename_source_key(key, structure.renamings, structure.converters)
        if pattern is None:
            continue
        converter = next(c for c in structure.converters if pattern in c.source_patterns)
        found = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key) or re.search(r"\.experts\.(\d+)\.", key)
        if found is None:
            continue
        parts = len(converter.source_patterns)
        pieces.setdefault(target, []).append(
            Piece(key, int(found.group(1)), converter.source_patterns.index(pattern), parts)
        )
    return pieces


def renamed_keys(base_keys, structure: ModelStructure) -> dict[str, str]:
    """The model's name of each checkpoint tensor that transformers renames as it loads (Phi-3.5-MoE's
    router is ``block_sparse_moe.gate`` in its checkpoint, ``mlp.router`` in the model)."""
    if not structure.renamings:
        return {}
    from transformers.core_model_loading import rename_source_key

    renamed = {}
    for key in base_keys:
        target, pattern = rename_source_key(key, structure.renamings, [])
        if target != key and pattern is None:
            renamed[target] = key
    return renamed
