"""What kind each decoder layer of a model is, and whether a cut of the model keeps the kinds.

Most models stack one kind of layer. Hybrids stack several: Mamba or linear-attention mixers
beside attention (Jamba, Falcon-H1, Bamba, Granite 4.0-H, Nemotron-H, Qwen3-Next, LFM2),
mixture-of-experts beside dense MLPs, sliding beside global attention (Gemma 2 and 3). Two layers
are of one kind when they are built alike (the same modules, parameters and buffers, of the same
shapes) and their config says the same of them (the entries of its per-layer lists). The full
model is built on ``meta`` (no memory) to tell.

:func:`layer_pattern` gives the kinds, :func:`covering_layers` a short cut that holds each;
:func:`cut_keeps_kinds` builds a cut
(:func:`memfit.models.build.make_config` with ``layers``) and checks that each of its layers is of
the kind of the layer it copies: the cut the planner simulates is then the model it extrapolates.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.models.build import build_meta_model, make_config
from memfit.models.cutting import per_layer_names
from memfit.models.layers import decoder_layers
from memfit.models.vision import language_config


@dataclass(frozen=True)
class LayerPattern:
    """The kind of each decoder layer (kinds numbered in order of first appearance), a name for each
    kind, and whether the layers are coupled: decoder layers that share parameters (Zamba's shared
    attention blocks) or attend over earlier layers' outputs (Inkling 2's attention residuals). A
    coupled layer's bytes depend on the layers before it, and the model is not a sum of its kinds."""

    kinds: tuple[int, ...]
    names: tuple[str, ...]
    coupled: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.kinds)

    def counts(self) -> dict[int, int]:
        """Layers of each kind in the model."""
        return dict(sorted(Counter(self.kinds).items()))

    def first(self, kind: int, after: int = -1) -> int:
        """Index of the first layer of ``kind`` after index ``after`` (or the first one at all)."""
        return next((i for i, k in enumerate(self.kinds) if k == kind and i > after), self.kinds.index(kind))

    def period(self) -> int:
        """Smallest number of layers after which the kinds repeat (the depth when they never do)."""
        n = len(self.kinds)
        return next(p for p in range(1, n + 1) if all(self.kinds[i] == self.kinds[i % p] for i in range(n)))


#: Config fields that make each layer read the outputs of the layers before it (an attention over
#: depth, every so many layers): the layers are coupled.
CROSS_LAYER_FIELDS = ("n_layers_per_attn_res_block",)

_PATTERNS: dict[str, tuple[LayerPattern, tuple, bool]] = {}
_PATTERNS_KEPT = 16


def layer_pattern(config_dict: dict[str, Any]) -> LayerPattern:
    """The kinds of the decoder layers of the model in ``config_dict`` (built on ``meta``, once per config)."""
    return _pattern_and_signatures(config_dict)[0]


def cut_keeps_kinds(config_dict: dict[str, Any], sources: Sequence[int]) -> bool:
    """Whether the model cut to copies of the layers at ``sources`` has, layer by layer, the kinds of
    those layers (a config that computes its kinds from the depth keeps only some cuts)."""
    _, signatures, shared_in_full = _pattern_and_signatures(config_dict)
    names = [name for name, _ in signatures[0][1]] if signatures else []
    try:
        cut, shared = _signatures(make_config(config_dict, layers=list(sources)), names)
    except Exception:  # noqa: BLE001 - transformers refusing the cut config: the cut is not possible
        return False
    return shared == shared_in_full and list(cut) == [signatures[i] for i in sources]


def covering_layers(config_dict: dict[str, Any]) -> list[int]:
    """A short cut that holds a layer of every kind: one layer of each where the config can cut so,
    else the layers up to the last kind's first (for checks that ask what the layers are built of)."""
    pattern = layer_pattern(config_dict)
    one_each = sorted(pattern.first(kind) for kind in pattern.counts())
    if len(one_each) == 1 or cut_keeps_kinds(config_dict, one_each):
        return one_each
    return list(range(one_each[-1] + 1))


def _pattern_and_signatures(config_dict: dict[str, Any]) -> tuple[LayerPattern, tuple, bool]:
    key = json.dumps(config_dict, sort_keys=True, default=str)
    found = _PATTERNS.get(key)
    if found is None:
        config = make_config(config_dict)
        signatures, shared = _signatures(config)
        ids: dict[Any, int] = {}
        kinds = tuple(ids.setdefault(sig, len(ids)) for sig in signatures)
        coupled = shared or any(getattr(language_config(config), name, None) for name in CROSS_LAYER_FIELDS)
        found = (LayerPattern(kinds=kinds, names=_names(list(ids)), coupled=coupled), signatures, shared)
        if len(_PATTERNS) >= _PATTERNS_KEPT:
            _PATTERNS.pop(next(iter(_PATTERNS)))
        _PATTERNS[key] = found
    return found


def _signatures(config, names: list[str] | None = None) -> tuple[tuple, bool]:
    """Each decoder layer's signature (modules, parameter and buffer shapes, the entries of the
    per-layer lists ``names``, by default the config's own), and whether two layers hold one parameter."""
    from memfit.models.build import DTYPES

    model = build_meta_model(config, DTYPES["bf16"])
    text = language_config(config)
    values = [(name, getattr(text, name)) for name in (per_layer_names(text) if names is None else names)]
    layers = decoder_layers(model)
    num_layers = int(language_config(config).num_hidden_layers)
    if len(layers) != num_layers:
        # The longest list of modules is not one layer each (a model that nests or repeats them):
        # the config's per-layer lists alone tell the kinds.
        return tuple(
            (((), ()), tuple((name, _hashable(value[i])) for name, value in values)) for i in range(num_layers)
        ), False
    owners: dict[int, int] = {}
    shared = False
    signatures = []
    for index, layer in enumerate(layers):
        for p in layer.parameters():
            shared |= owners.setdefault(id(p), index) != index
        entries = tuple((name, _hashable(value[index])) for name, value in values)
        signatures.append((_structure(layer), entries))
    return tuple(signatures), shared


def _structure(layer: nn.Module) -> tuple:
    modules = tuple((name, type(m).__name__) for name, m in layer.named_modules())
    tensors = tuple(
        (name, tuple(t.shape), str(t.dtype)) for name, t in (*layer.named_parameters(), *layer.named_buffers())
    )
    return modules, tensors


def _names(signatures: list) -> tuple[str, ...]:
    """A short name for each kind: its config entries (``linear_attention``, ``full_attention/moe``),
    else its layer's class; kinds alike by those are told apart by a module class only they hold,
    else by a number."""
    names = [
        "/".join(str(v) for _, v in entries if v is not None) or (modules[0][1] if modules else "layer")
        for (modules, _), entries in signatures
    ]
    classes = [{cls for _, cls in modules} for (modules, _), _ in signatures]
    out = []
    for index, name in enumerate(names):
        alike = [j for j, other in enumerate(names) if other == name and j != index]
        if alike:
            own = sorted(classes[index] - set().union(*(classes[j] for j in alike)))
            name = f"{name} ({own[0]})" if own else f"{name} ({1 + sum(1 for j in alike if j < index)})"
        out.append(name)
    return tuple(out)


def _hashable(value):
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value if isinstance(value, (str, int, float, bool, type(None), torch.dtype)) else str(value)
