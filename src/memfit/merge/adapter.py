"""Read a PEFT LoRA adapter folder and say what it asks of the base model.

A PEFT adapter folder holds `adapter_config.json` and `adapter_model.safetensors`, whose keys
look like `base_model.model.<module>.lora_A.weight`. This module turns them into LoRA pairs
(with their scale, and DoRA's magnitude vector where the adapter has one), whole-tensor
replacements (`modules_to_save`) and base-weight copies (`<module>.base_layer.weight`, which PEFT
saves for targeted embedding layers and loads over the base weight), and refuses every adapter
option the merge does not implement.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
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
    "lora_bias": False,
    "use_qalora": False,
    "trainable_token_indices": None,
    "layer_replication": None,
    "alora_invocation_tokens": None,
    "velora_config": None,
    "monteclora_config": None,
    "kasa_config": None,
    "arrow_config": None,
    "use_bdlora": None,
    "megatron_config": None,
}


class AdapterTensors(Mapping):
    """The tensors of ``adapter_model.safetensors`` by key. LoRA's own (A, B, DoRA magnitudes: small)
    are read into memory at once; the others, copies of whole modules (``modules_to_save``: an
    embedding or a head is as large as the base's), are read from the file each time they are
    asked for, so that the merge holds one of them at a time. ``shape`` reads no data."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = Path(path)
        with safe_open(str(self.path), "pt") as handle:
            self.shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
            self._held = {key: handle.get_tensor(key) for key in self.shapes if _split_key(key) is not None}

    def shape(self, key: str) -> tuple[int, ...]:
        return self.shapes[key]

    def __getitem__(self, key: str):
        if key in self._held:
            return self._held[key]
        if key not in self.shapes:
            raise KeyError(key)
        from safetensors import safe_open

        with safe_open(str(self.path), "pt") as handle:
            return handle.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


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
    magnitude_key: str | None = None  # DoRA: the magnitude of each output row (None: plain LoRA)
    parameter: str | None = None  # PEFT's adapter on a weight (target_parameters): the weight's name in `module`
    experts: int = (
        1  # a fused expert weight's experts, each with its own pair (A [r x experts, in], B [out, r x experts])
    )
    swapped: bool = False  # PEFT took the stored [experts, out, in] weight's sizes as (in, out) and swapped them


@dataclass
class Adapter:
    """What the merge needs from an adapter folder."""

    folder: Path
    config: dict
    tensors: Mapping  # adapter key -> torch.Tensor (AdapterTensors: large ones read when asked for)
    pairs: dict[str, LoraPair] = field(default_factory=dict)  # module -> pair
    # pairs of PEFT's weight adapters (target_parameters), by their wrapper's module path: which weight
    # each one adapts, and its rank, depend on the model (memfit.merge.weights resolves them)
    wrapped: dict[str, tuple[str, str, str | None]] = field(default_factory=dict)
    replacements: dict[str, str] = field(default_factory=dict)  # base weight key -> adapter key (modules_to_save)
    base_copies: dict[str, str] = field(default_factory=dict)  # base weight key -> adapter key (base_layer)

    @property
    def fan_in_fan_out(self) -> bool:
        return bool(self.config.get("fan_in_fan_out", False))

    @property
    def ensure_weight_tying(self) -> bool:
        return bool(self.config.get("ensure_weight_tying", False))

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape of adapter tensor ``key``, without reading it."""
        shape = getattr(self.tensors, "shape", None)
        return shape(key) if shape is not None else tuple(self.tensors[key].shape)


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
        problems.append(
            f"adapter_config.json peft_type is {peft_type!r}: only LoRA adapters (peft_type 'LORA') can be merged."
        )
    bias = config.get("bias", "none")
    if bias != "none":
        problems.append(
            f"adapter_config.json bias={bias!r} is not supported (the adapter trained base biases): only bias='none' can be merged."
        )
    for name, off in _UNSUPPORTED_WHEN_SET.items():
        value = config.get(name, off)
        if value not in (off, None, False, [], {}):
            problems.append(
                f"adapter_config.json {name}={value!r} is not supported: retrain without it or merge with PEFT."
            )
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
    if targets in (None, "all-linear", ["all-linear"], []) or not isinstance(targets, (str, list)):
        return []  # [] beside target_parameters: every adapter is on a weight
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
    """(module, role) for a LoRA key, role one of A, B, EA, EB, M (DoRA's magnitude); None for any other key."""
    for suffix, role in (
        (".lora_A.weight", "A"),
        (".lora_B.weight", "B"),
        (".lora_embedding_A", "EA"),
        (".lora_embedding_B", "EB"),
        (".lora_magnitude_vector", "M"),
        (".lora_magnitude_vector.weight", "M"),
    ):
        if key.endswith(suffix):
            return key[: -len(suffix)], role
    return None


def _is_weight_adapter(module: str, config: dict) -> bool:
    """Whether the LoRA pair at ``module`` may be one of PEFT's weight adapters (``target_parameters``):
    a weight of ``module`` (nested wrappers of one module's weights end in ``.base_layer``) named by them."""
    targets = config.get("target_parameters") or []
    owner = module.replace(".base_layer", "")
    return any(f"{owner}.{t}".startswith(owner + ".") and _names_weight_of(owner, t) for t in targets)


def _names_weight_of(owner: str, target: str) -> bool:
    """Whether target ``experts.gate_up_proj`` (PEFT matches ``<module>.<weight>`` by suffix) can name a
    weight of module ``owner``: its module part is ``owner`` or a dotted tail of it."""
    module_part = target.rpartition(".")[0]
    return not module_part or owner == module_part or owner.endswith("." + module_part)


def _matches_module_list(module: str, names) -> bool:
    return any(module == n or module.endswith("." + n) for n in names or [])


def _dora_problem(module: str, kind: str, use_dora: bool, magnitude_key: str | None, adapter: Adapter) -> str | None:
    """What is wrong with a LoRA pair's DoRA part (a magnitude where use_dora is off or missing where
    it is on, an embedding, a magnitude of the wrong length), or None."""
    if magnitude_key is None:
        return (
            (
                f"adapter module {module!r} has no DoRA magnitude (lora_magnitude_vector) but adapter_config.json "
                "says use_dora=true: the adapter file is incomplete."
            )
            if use_dora
            else None
        )
    if not use_dora:
        return f"adapter module {module!r} has a DoRA magnitude but adapter_config.json says use_dora=false."
    if kind != "linear":
        return f"adapter module {module!r}: DoRA on an embedding layer is not supported: merge this adapter with PEFT."
    magnitude = adapter.tensors[magnitude_key]
    return (
        None
        if magnitude.dim() == 1
        else (
            f"adapter module {module!r}: DoRA magnitude of shape {tuple(magnitude.shape)}: only linear (1-D magnitude) DoRA can be merged."
        )
    )


def read_adapter(folder: Path) -> Adapter:
    """Read and check an adapter folder; raises MergeError naming every problem found."""
    folder = Path(folder)
    config_path = folder / ADAPTER_CONFIG
    weights_path = folder / ADAPTER_WEIGHTS
    if not folder.is_dir():
        raise MergeError(
            f"--adapter {folder} is not a folder: pass the folder holding {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}."
        )
    if not config_path.is_file():
        raise MergeError(
            f"--adapter {folder} has no {ADAPTER_CONFIG}: pass a PEFT adapter folder (model.save_pretrained output)."
        )
    if not weights_path.is_file():
        hint = (
            " (found adapter_model.bin: re-save the adapter with safe_serialization=True)"
            if (folder / "adapter_model.bin").exists()
            else ""
        )
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

    try:
        tensors = AdapterTensors(weights_path)
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise MergeError(f"cannot read {weights_path}: {exc}") from exc
    adapter = Adapter(folder=folder, config=config, tensors=tensors)
    _parse_keys(adapter, problems)
    if problems:
        raise MergeError("\n".join(problems))
    if not adapter.pairs and not adapter.replacements and not adapter.wrapped:
        raise MergeError(f"{weights_path} holds no LoRA weights and no modules_to_save tensors: nothing to merge.")
    return adapter


def make_pair(
    adapter: Adapter,
    module: str,
    kind: str,
    a_key: str,
    b_key: str,
    magnitude_key: str | None,
    problems: list[str],
    *,
    experts: int = 1,
    parameter: str | None = None,
    swapped: bool = False,
) -> LoraPair | None:
    """The LoRA pair of ``module`` with its rank, alpha and scale as PEFT gives them (``rank_pattern``
    and ``alpha_pattern`` matched against the module, or for a weight adapter against
    ``<module>.<weight>``), or None with the problem added. A fused expert weight's pair holds a rank-r
    pair for each of its ``experts``."""
    config = adapter.config
    a, b = adapter.tensors[a_key], adapter.tensors[b_key]
    if a.dim() != 2 or b.dim() != 2:
        problems.append(
            f"adapter module {module!r} has LoRA weights of shapes {tuple(a.shape)} and {tuple(b.shape)}: "
            "only 2-D (linear, Conv1D, embedding) LoRA can be merged, not convolution LoRA."
        )
        return None
    rank = a.shape[0]
    if b.shape[1] != rank:
        problems.append(f"adapter module {module!r}: lora A has rank {rank} but lora B has {b.shape[1]} columns.")
        return None
    where = f"{module}.{parameter}" if parameter else module
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    r_key, a_key_pat = pattern_key(rank_pattern, where), pattern_key(alpha_pattern, where)
    r = rank_pattern[r_key] if r_key is not None else config["r"]
    alpha = alpha_pattern[a_key_pat] if a_key_pat is not None else config["lora_alpha"]
    if r * experts != rank:
        each = f" ({experts} experts of rank {rank / experts:g})" if experts > 1 else ""
        problems.append(
            f"adapter module {where!r}: adapter_config.json gives r={r} (rank_pattern key {r_key!r}) but the saved weights have rank {rank}{each}."
        )
        return None
    scale = lora_scale(alpha, r, bool(config.get("use_rslora", False)))
    return LoraPair(module, kind, a_key, b_key, r, alpha, scale, magnitude_key, parameter, experts, swapped)


def _parse_keys(adapter: Adapter, problems: list[str]) -> None:
    config = adapter.config
    halves: dict[str, dict[str, str]] = {}
    for key in adapter.tensors:
        if not key.startswith(KEY_PREFIX):
            problems.append(f"adapter tensor {key!r} does not start with {KEY_PREFIX!r}: not a PEFT model adapter.")
            continue
        name = key[len(KEY_PREFIX) :]
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
        elif _matches_module_list(name.rpartition(".")[0], config.get("modules_to_save")) or config.get(
            "ensure_weight_tying"
        ):
            # under ensure_weight_tying PEFT also saves the tied partner (lm_head) of a listed module;
            # the plan checks that such a key names a tied base weight
            adapter.replacements[name] = key
        else:
            problems.append(f"adapter tensor {key!r} is neither a LoRA weight nor listed in modules_to_save.")

    use_dora = bool(config.get("use_dora", False))
    for module, roles in sorted(halves.items()):
        magnitude_key = roles.pop("M", None)
        if set(roles) == {"A", "B"}:
            kind = "linear"
        elif set(roles) == {"EA", "EB"}:
            kind = "embedding"
        else:
            problems.append(
                f"adapter module {module!r} has an incomplete LoRA pair: {sorted(roles) or ['a DoRA magnitude alone']}."
            )
            continue
        dora_problem = _dora_problem(module, kind, use_dora, magnitude_key, adapter)
        if dora_problem:
            problems.append(dora_problem)
            continue
        a_key, b_key = (roles["A"], roles["B"]) if kind == "linear" else (roles["EA"], roles["EB"])
        if kind == "linear" and _is_weight_adapter(module, config):
            adapter.wrapped[module] = (a_key, b_key, magnitude_key)
            continue
        pair = make_pair(adapter, module, kind, a_key, b_key, magnitude_key, problems)
        if pair is not None:
            adapter.pairs[module] = pair
    for key in adapter.replacements:
        module = key.rpartition(".")[0]
        if module in adapter.pairs:
            problems.append(
                f"adapter module {module!r} is both LoRA-targeted and in modules_to_save: PEFT cannot produce that."
            )
