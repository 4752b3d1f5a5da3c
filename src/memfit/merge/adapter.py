"""Read a PEFT LoRA adapter folder and say what it asks of the base model.

A PEFT adapter folder holds `adapter_config.json` and `adapter_model.safetensors`, whose keys
look like `base_model.model.<module>.lora_A.weight`. This module turns them into LoRA pairs
(with their scale), whole-tensor replacements (`modules_to_save`) and base-weight copies
(`<module>.base_layer.weight`, which PEFT saves for targeted embedding layers and loads over the
base weight), and refuses every adapter option the merge does not implement.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import MergeError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."

# init_lora_weights values whose adapters only make sense on a base that PEFT rewrote at init
# time (the saved adapter is relative to that residual base, not to the original one).
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq")

# Options that select a LoRA variant or layer type this merge does not implement. Each maps to
# the value meaning "off"; anything else is refused by name.
_UNSUPPORTED_WHEN_SET = {
    "use_dora": False,
    "lora_bias": False,
    "use_qalora": False,
    "trainable_token_indices": None,
    "target_parameters": None,
    "layer_replication": None,
    "alora_invocation_tokens": None,
    "velora_config": None,
    "monteclora_config": None,
    "kasa_config": None,
    "arrow_config": None,
    "use_bdlora": None,
    "megatron_config": None,
}


@dataclass(frozen=True)
class LoraPair:
    """One LoRA update `scale * B @ A` for the weight of `module`."""

    module: str  # e.g. "model.layers.0.self_attn.q_proj"
    kind: str  # "linear" (lora_A/lora_B) or "embedding" (lora_embedding_A/B)
    a_key: str
    b_key: str
    rank: int
    alpha: float
    scale: float


@dataclass
class Adapter:
    """What the merge needs from an adapter folder."""

    folder: Path
    config: dict
    tensors: dict  # adapter key -> torch.Tensor
    pairs: dict[str, LoraPair] = field(default_factory=dict)  # module -> pair
    replacements: dict[str, str] = field(default_factory=dict)  # base weight key -> adapter key (modules_to_save)
    base_copies: dict[str, str] = field(default_factory=dict)  # base weight key -> adapter key (base_layer)

    @property
    def fan_in_fan_out(self) -> bool:
        return bool(self.config.get("fan_in_fan_out", False))

    @property
    def ensure_weight_tying(self) -> bool:
        return bool(self.config.get("ensure_weight_tying", False))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def lora_scale(alpha: float, rank: int, use_rslora: bool) -> float:
    """PEFT's scaling: alpha / r, or alpha / sqrt(r) for rank-stabilized LoRA.

    Computed with the same Python arithmetic as PEFT so the float is the same bit for bit.
    """
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def pattern_key(patterns, module: str) -> str | None:
    """The first `rank_pattern` / `alpha_pattern` key that matches `module`, as PEFT matches them.

    PEFT treats each key as a regular expression that must match the end of the module name
    at a dot boundary (`(.*\\.)?(key)$`), so "q_proj" matches every q_proj and
    "model.layers.0.self_attn.q_proj" only that one; the first matching key in the dict wins.
    """
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


def config_problems(config: dict) -> list[str]:
    """Everything in an adapter_config.json this merge cannot honour (empty when fine)."""
    problems = []
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        problems.append(f"adapter_config.json peft_type is {peft_type!r}: only LoRA adapters (peft_type 'LORA') can be merged.")
    bias = config.get("bias", "none")
    if bias != "none":
        problems.append(
            f"adapter_config.json bias={bias!r} is not supported (the adapter trained base biases): only bias='none' can be merged."
        )
    for name, off in _UNSUPPORTED_WHEN_SET.items():
        value = config.get(name, off)
        if value not in (off, None, False, [], {}):
            label = "DoRA" if name == "use_dora" else name
            problems.append(f"adapter_config.json {name}={value!r} ({label}) is not supported: retrain without it or merge with PEFT.")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        problems.append(
            f"adapter_config.json init_lora_weights={init!r}: this adapter belongs to a base that PEFT modified at init; "
            "save it with PEFT's path_initial_model_for_weight_conversion to get a plain LoRA adapter first."
        )
    for name in ("r", "lora_alpha"):
        value = config.get(name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            problems.append(f"adapter_config.json {name}={value!r} must be a positive number.")
    return problems


def _targets_module(targets, module: str) -> bool:
    """Whether PEFT's ``target_modules`` names ``module``: a string is a regular expression the
    whole name must match; a list holds names matched exactly or as the last dotted parts."""
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in targets)


def target_module_problems(adapter: Adapter, modules: set[str]) -> list[str]:
    """What PEFT refuses when loading ``adapter`` onto a base with these ``modules``:
    ``target_modules`` that match none of them (an adapter trained on another architecture)."""
    targets = adapter.config.get("target_modules")
    if targets in (None, "all-linear", ["all-linear"]) or not isinstance(targets, (str, list)):
        return []
    try:
        if not any(_targets_module(targets, m) for m in modules):
            return [
                f"adapter_config.json target_modules={targets!r} match no module of the base model, so PEFT refuses this "
                "adapter: it was trained on another architecture. Pass the base model it was trained on."
            ]
    except re.error as exc:
        return [f"adapter_config.json target_modules={targets!r} is not a valid regular expression ({exc})."]
    return []


def _split_key(key: str) -> tuple[str, str] | None:
    """(module, role) for a LoRA key, role one of A, B, EA, EB; None for any other key."""
    for suffix, role in ((".lora_A.weight", "A"), (".lora_B.weight", "B"), (".lora_embedding_A", "EA"), (".lora_embedding_B", "EB")):
        if key.endswith(suffix):
            return key[: -len(suffix)], role
    return None


def _matches_module_list(module: str, names) -> bool:
    return any(module == n or module.endswith("." + n) for n in names or [])


def read_adapter(folder: Path) -> Adapter:
    """Read and check an adapter folder; raises MergeError naming every problem found."""
    folder = Path(folder)
    config_path = folder / ADAPTER_CONFIG
    weights_path = folder / ADAPTER_WEIGHTS
    if not folder.is_dir():
        raise MergeError(f"--adapter {folder} is not a folder: pass the folder holding {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}.")
    if not config_path.is_file():
        raise MergeError(f"--adapter {folder} has no {ADAPTER_CONFIG}: pass a PEFT adapter folder (model.save_pretrained output).")
    if not weights_path.is_file():
        hint = " (found adapter_model.bin: re-save the adapter with safe_serialization=True)" if (folder / "adapter_model.bin").exists() else ""
        raise MergeError(f"--adapter {folder} has no {ADAPTER_WEIGHTS}{hint}.")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MergeError(f"cannot read {config_path}: {exc}") from exc
    if not isinstance(config, dict):
        raise MergeError(f"{config_path} does not hold a JSON object.")
    problems = config_problems(config)
    if problems:
        raise MergeError("\n".join(problems))

    from safetensors.torch import load_file

    try:
        tensors = load_file(str(weights_path))
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise MergeError(f"cannot read {weights_path}: {exc}") from exc
    adapter = Adapter(folder=folder, config=config, tensors=tensors)
    _parse_keys(adapter, problems)
    if problems:
        raise MergeError("\n".join(problems))
    if not adapter.pairs and not adapter.replacements:
        raise MergeError(f"{weights_path} holds no LoRA weights and no modules_to_save tensors: nothing to merge.")
    return adapter


def _parse_keys(adapter: Adapter, problems: list[str]) -> None:
    config = adapter.config
    halves: dict[str, dict[str, str]] = {}
    for key in adapter.tensors:
        if not key.startswith(KEY_PREFIX):
            problems.append(f"adapter tensor {key!r} does not start with {KEY_PREFIX!r}: not a PEFT model adapter.")
            continue
        name = key[len(KEY_PREFIX):]
        split = _split_key(name)
        if split is not None:
            halves.setdefault(split[0], {})[split[1]] = key
        elif ".base_layer." in name:
            module, _, param = name.rpartition(".base_layer.")
            adapter.base_copies[f"{module}.{param}"] = key
        elif ".modules_to_save." in name:
            # older PEFT files keep the wrapper path: <module>.modules_to_save.<adapter name>.<param>
            module, _, rest = name.partition(".modules_to_save.")
            adapter.replacements[f"{module}.{rest.partition('.')[2]}"] = key
        elif _matches_module_list(name.rpartition(".")[0], config.get("modules_to_save")) or config.get("ensure_weight_tying"):
            # under ensure_weight_tying PEFT also saves the tied partner (lm_head) of a listed module;
            # the plan checks that such a key names a tied base weight
            adapter.replacements[name] = key
        else:
            problems.append(f"adapter tensor {key!r} is neither a LoRA weight nor listed in modules_to_save.")

    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    use_rslora = bool(config.get("use_rslora", False))
    for module, roles in sorted(halves.items()):
        if set(roles) == {"A", "B"}:
            kind = "linear"
        elif set(roles) == {"EA", "EB"}:
            kind = "embedding"
        else:
            problems.append(f"adapter module {module!r} has an incomplete LoRA pair: {sorted(roles)}.")
            continue
        a_key, b_key = (roles["A"], roles["B"]) if kind == "linear" else (roles["EA"], roles["EB"])
        a, b = adapter.tensors[a_key], adapter.tensors[b_key]
        if a.dim() != 2 or b.dim() != 2:
            problems.append(
                f"adapter module {module!r} has LoRA weights of shapes {tuple(a.shape)} and {tuple(b.shape)}: "
                "only 2-D (linear, Conv1D, embedding) LoRA can be merged, not convolution LoRA."
            )
            continue
        rank = a.shape[0]
        if b.shape[1] != rank:
            problems.append(f"adapter module {module!r}: lora A has rank {rank} but lora B has {b.shape[1]} columns.")
            continue
        r_key = pattern_key(rank_pattern, module)
        a_key_pat = pattern_key(alpha_pattern, module)
        r = rank_pattern[r_key] if r_key is not None else config["r"]
        alpha = alpha_pattern[a_key_pat] if a_key_pat is not None else config["lora_alpha"]
        if r != rank:
            problems.append(
                f"adapter module {module!r}: adapter_config.json gives r={r} (rank_pattern key {r_key!r}) but the saved weights have rank {rank}."
            )
            continue
        adapter.pairs[module] = LoraPair(module, kind, a_key, b_key, rank, alpha, lora_scale(alpha, r, use_rslora))
    for key in adapter.replacements:
        module = key.rpartition(".")[0]
        if module in adapter.pairs:
            problems.append(f"adapter module {module!r} is both LoRA-targeted and in modules_to_save: PEFT cannot produce that.")
