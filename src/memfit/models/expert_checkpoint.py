"""Expert weights as checkpoints store them, put into the fused experts of a transformers 5 model.

Checkpoints keep each expert apart (``mlp.experts.3.gate_proj.weight``; Mixtral's
``block_sparse_moe.experts.3.w1.weight``): transformers 5 fuses them as it loads, by its conversion
mapping (names renamed, experts stacked, gate and up concatenated), and splits them again when it
saves. gpt-oss's checkpoint holds its fused experts in MXFP4 (``gate_up_proj_blocks`` and
``_scales``), which transformers dequantizes for training. :class:`ExpertAssembler` does both as a
checkpoint is read, tensor by tensor, with transformers' own renaming and dequantization: each
expert's piece goes to its place in the 16-bit stack as it comes, or, for 4-bit experts
(:mod:`memfit.models.experts_nf4`), waits until that expert's weight is whole and is quantized
then. Nothing larger than one expert's weight is held beside the model (one layer's experts for
MXFP4, which is stored per layer).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from memfit.models.experts import expert_modules, expert_weights
from memfit.models.experts_nf4 import is_nf4_experts, quantize_expert

#: The suffixes of an MXFP4 weight's two tensors in gpt-oss's checkpoint.
MXFP4_PARTS = ("_blocks", "_scales")


class ExpertCheckpointError(ValueError):
    """A checkpoint's expert tensors do not fit the model's fused experts."""


@dataclass
class _Fused:
    """One fused expert weight being filled: its module, name, pieces per expert, what has come."""

    module: nn.Module
    name: str
    pieces: int
    waiting: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)


class ExpertAssembler:
    """Takes a checkpoint's tensors one at a time (:meth:`take`) and fills the fused experts of
    ``model`` from those that are expert pieces; says which fused weights came whole (:meth:`loaded`)
    and which did not (:meth:`incomplete`)."""

    def __init__(self, model: nn.Module):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        mapping = list(get_model_conversion_mapping(model) or [])
        self.renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
        self.converters = [t for t in mapping if isinstance(t, WeightConverter)]
        self.fused: dict[str, _Fused] = {}
        for prefix, module in expert_modules(model).items():
            for weight in expert_weights(module):
                self.fused[f"{prefix}.{weight.name}"] = _Fused(module, weight.name, 1)
        self.mxfp4: dict[str, dict[str, torch.Tensor]] = {}

    def take(self, name: str, tensor: torch.Tensor) -> str | None:
        """Consume ``tensor`` if it is (part of) a fused expert weight; else return the model's name
        for it (the checkpoint's, renamed as transformers renames it), for the caller to place."""
        from transformers.core_model_loading import rename_source_key

        target, pattern = rename_source_key(name, self.renamings, self.converters)
        if pattern is not None and target in self.fused:
            self._piece(target, name, pattern, tensor)
            return None
        for part in MXFP4_PARTS:
            if target.endswith(part) and target[: -len(part)] in self.fused:
                self._mxfp4(target[: -len(part)], part, tensor)
                return None
        if target in self.fused and is_nf4_experts(self.fused[target].module):
            self._whole(target, tensor)
            return None
        return target

    def loaded(self) -> set[str]:
        """The fused weights filled from expert pieces, every expert of them."""
        return {name for name, fused in self.fused.items() if fused.done and len(fused.done) == _experts(fused)}

    def incomplete(self) -> list[str]:
        """Fused weights some of whose experts came and some did not (or half an MXFP4 pair)."""
        partial = [name for name, fused in self.fused.items() if fused.done and len(fused.done) != _experts(fused)]
        return sorted(partial + [f"{name} ({', '.join(parts)} only)" for name, parts in self.mxfp4.items()])

    # -- the three forms a fused weight comes in -------------------------------------------------

    def _piece(self, target: str, name: str, pattern: str, tensor: torch.Tensor) -> None:
        """One expert's part (gate, up or down) of a fused weight, named by a converter's ``pattern``."""
        converter = next(c for c in self.converters if pattern in c.source_patterns)
        kinds = [type(op).__name__ for op in converter.operations]
        if kinds not in (["MergeModulelist"], ["MergeModulelist", "Concatenate"]):
            raise ExpertCheckpointError(
                f"{name}: transformers converts it with {', '.join(kinds)}, which memfit does not load"
            )
        fused = self.fused[target]
        fused.pieces = len(converter.source_patterns)
        expert = _expert_index(name, pattern)
        position = converter.source_patterns.index(pattern)
        if is_nf4_experts(fused.module):
            waiting = fused.waiting.setdefault(expert, {})
            waiting[position] = tensor
            if len(waiting) == fused.pieces:
                dense = torch.cat([waiting[i] for i in range(fused.pieces)], dim=0)
                del fused.waiting[expert]
                quantize_expert(fused.module, fused.name, expert, dense)
                fused.done.add(expert)
            return
        param = _stack(fused, tensor.device)
        rows = tensor.shape[0]
        with torch.no_grad():
            param[expert, position * rows : (position + 1) * rows].copy_(tensor)
        fused.waiting.setdefault(expert, {})[position] = None
        if len(fused.waiting[expert]) == fused.pieces:
            del fused.waiting[expert]
            fused.done.add(expert)

    def _mxfp4(self, target: str, part: str, tensor: torch.Tensor) -> None:
        """Half of an MXFP4 weight; with both halves, dequantized as transformers does for training."""
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        parts = self.mxfp4.setdefault(target, {})
        parts[part] = tensor
        if len(parts) < len(MXFP4_PARTS):
            return
        del self.mxfp4[target]
        fused = self.fused[target]
        dtype = fused.module.compute_dtype if is_nf4_experts(fused.module) else getattr(fused.module, fused.name).dtype
        dense = convert_moe_packed_tensors(parts["_blocks"], parts["_scales"], dtype=dtype)
        del parts
        if is_nf4_experts(fused.module):
            self._whole(target, dense)
            return
        param = _stack(fused, dense.device)
        if tuple(param.shape) != tuple(dense.shape):
            raise ExpertCheckpointError(
                f"{target}: MXFP4 tensors of shape {tuple(dense.shape)} but the model expects {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(dense)
        fused.done.update(range(param.shape[0]))

    def _whole(self, target: str, tensor: torch.Tensor) -> None:
        """A fused weight stored whole, for 4-bit experts: quantized expert by expert."""
        fused = self.fused[target]
        weight = next(w for w in fused.module.expert_weights if w.name == fused.name)
        want = (
            (weight.num_experts, weight.in_features, weight.out_features)
            if weight.transposed
            else (weight.num_experts, weight.out_features, weight.in_features)
        )
        if tuple(tensor.shape) != want:
            raise ExpertCheckpointError(
                f"{target}: checkpoint shape {tuple(tensor.shape)} but the model expects {want}"
            )
        for expert in range(weight.num_experts):
            quantize_expert(fused.module, fused.name, expert, tensor[expert])
            fused.done.add(expert)


def _experts(fused: _Fused) -> int:
    return next(w.num_experts for w in expert_weights(fused.module) if w.name == fused.name)


def _stack(fused: _Fused, device: torch.device) -> torch.Tensor:
    """The 16-bit fused parameter, given empty storage on ``device`` when its first piece comes."""
    param = fused.module._parameters[fused.name]
    if param.is_meta:
        param = nn.Parameter(
            torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=param.requires_grad
        )
        fused.module._parameters[fused.name] = param
    return param


def _expert_index(name: str, pattern: str) -> int:
    """The expert number that a converter pattern's ``*`` stands for in checkpoint key ``name``."""
    found = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), name)
    if found is None:  # the pattern matched after renaming: the number is still the one after "experts."
        found = re.search(r"\.experts\.(\d+)\.", name)
    return int(found.group(1))
