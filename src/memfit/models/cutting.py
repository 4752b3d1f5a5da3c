"""The config of a model made of chosen decoder layers of a larger one.

A config says which kind each layer is in several ways: a list with one entry a layer
(``layer_types``, ``layers_block_type``, ``mlp_layer_types``), a list of the layers that are of
one kind (Bamba's ``attn_layer_indices``, LFM2's ``full_attn_idxs``, Qwen-MoE's
``mlp_only_layers``), a count of leading layers (DeepSeek's ``first_k_dense_replace``,
LFM2-MoE's ``num_dense_layers``), a cycle repeated to the depth (RecurrentGemma's
``block_types``), or a rule computed from the depth (Jamba's
``attn_layer_period`` and ``attn_layer_offset``, which a property turns into
``layers_block_type``). :func:`cut_config_data` writes each stored form for the chosen layers, so
that transformers builds the cut model from a config it validates as it would any other; a rule
computed from the depth is left to the model (it holds for a prefix of whole periods only).
Whether a cut came out as asked is checked by building it (:mod:`memfit.models.layer_kinds`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

#: Fields listing the indices of the layers of one kind: remapped to the cut's positions.
INDEX_FIELDS = (
    "attn_layer_indices",
    "full_attn_idxs",
    "mlp_only_layers",
    "hybrid_layer_ids",
    "cross_attention_layers",  # Llama 3.2 Vision's cross-attention layers
    "moe_layers",  # Llama 4's mixture-of-experts layers
)
#: Fields counting leading layers of one kind (dense MLPs before the mixture-of-experts ones).
LEADING_COUNT_FIELDS = ("first_k_dense_replace", "num_dense_layers")
#: Fields holding a cycle of kinds the model repeats to its depth (RecurrentGemma's block_types):
#: the cut's own kinds, written out whole, are a cycle that repeats once.
CYCLE_FIELDS = ("block_types",)
#: Fields some configs keep beside num_hidden_layers for the same depth (xLSTM's num_blocks).
DEPTH_SYNONYMS = ("num_blocks", "num_layers", "n_layer")


def per_layer_names(config) -> list[str]:
    """Names of the config's per-layer lists (stored fields and properties alike): attributes
    named for layers or blocks whose value has one entry a decoder layer."""
    num_layers = int(config.num_hidden_layers)
    names = set(_field_names(config)) | {
        n for n in dir(type(config)) if isinstance(getattr(type(config), n, None), property)
    }
    found = []
    for name in sorted(names):
        if not ("layer" in name or "block" in name) or name.startswith("mtp") or name == "num_hidden_layers":
            continue
        try:
            value = getattr(config, name)
        except Exception:  # noqa: BLE001 - a property that cannot answer for this config is no per-layer list
            continue
        if isinstance(value, (list, tuple)) and num_layers > 1 and len(value) == num_layers:
            found.append(name)
    return found


def cut_config_data(config_dict: dict[str, Any], full_config, sources: Sequence[int]) -> dict[str, Any]:
    """The config dict (``model_type`` kept) of the model whose i-th decoder layer is a copy of
    ``full_config``'s layer ``sources[i]`` (an index may repeat)."""
    sources = [int(i) for i in sources]
    data = copy.deepcopy(config_dict)
    aliases = dict(getattr(type(full_config), "attribute_map", {}) or {})
    written = set()
    for name in per_layer_names(full_config):
        if name in _field_names(full_config):
            value = getattr(full_config, name)
            data[name] = [value[i] for i in sources]
            written.add(name)
    for name in INDEX_FIELDS:
        value = getattr(full_config, name, None) if name in _field_names(full_config) else None
        if isinstance(value, (list, tuple)):
            kept = set(value)
            data[name] = [j for j, i in enumerate(sources) if i in kept]
            written.add(name)
    for name in CYCLE_FIELDS:
        value = getattr(full_config, name, None) if name in _field_names(full_config) and name not in written else None
        if isinstance(value, (list, tuple)) and value:
            data[name] = [value[i % len(value)] for i in sources]
            written.add(name)
    for name in LEADING_COUNT_FIELDS:
        value = getattr(full_config, name, None) if name in _field_names(full_config) else None
        if isinstance(value, int) and not isinstance(value, bool):
            data[name] = next((j for j, i in enumerate(sources) if i >= value), len(sources))
            written.add(name)
    # A key the user wrote under another name for a field written here would contradict it.
    for alias, target in aliases.items():
        if target in written and alias in data:
            del data[alias]
    for key in _layer_count_keys(full_config, aliases):
        data[key] = len(sources)
    return data


def _layer_count_keys(config, aliases: dict[str, str]) -> list[str]:
    """The keys that say the depth: num_hidden_layers and the names it is also stored under."""
    keys = {"num_hidden_layers"} | {
        name for name in DEPTH_SYNONYMS if getattr(config, name, None) == config.num_hidden_layers
    }
    for alias, target in aliases.items():
        if "num_hidden_layers" in (alias, target):
            keys |= {alias, target}
    return sorted(k for k in keys if k == "num_hidden_layers" or k in _field_names(config))


def _field_names(config) -> set[str]:
    if dataclasses.is_dataclass(type(config)):
        return {f.name for f in dataclasses.fields(type(config))}
    return set(vars(config))
