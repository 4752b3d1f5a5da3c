"""Read what a Hugging Face base checkpoint folder holds without loading its weights.

Only safetensors headers are read here (names, dtypes, shapes). The model's module tree
(which module is a Linear, a GPT-2 Conv1D or an Embedding; which weights are tied; the order
PEFT visits modules in) comes from building the model on torch's meta device, which allocates
no memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import MergeError
from .safetensors_stream import TensorSpec

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class BaseCheckpoint:
    """The tensors of a base checkpoint, by shard."""

    folder: Path
    config: dict
    shards: list[str]  # file names in index order
    specs: dict[str, TensorSpec]  # tensor name -> spec
    shard_of: dict[str, str]  # tensor name -> shard file name
    sharded: bool  # True when the folder uses model.safetensors.index.json

    def shard_bytes(self, shard: str) -> int:
        return (self.folder / shard).stat().st_size


@dataclass
class ModelStructure:
    """Facts about the module tree that the checkpoint alone does not tell."""

    kinds: dict[str, str] = field(default_factory=dict)  # module -> "linear" | "conv1d" | "embedding" | class name
    order: dict[str, int] = field(default_factory=dict)  # module -> position in named_modules()
    tied_groups: list[list[str]] = field(default_factory=list)  # parameter names sharing one tensor
    known: bool = False  # False when the model could not be built; callers fall back to the adapter config
    # each module's own weights in the order it holds them: (name, shape), and whether the module says
    # it stores [experts, in, out] (PEFT's weight adapters read both: memfit.merge.weights)
    weights: dict[str, list[tuple[str, tuple[int, ...]]]] = field(default_factory=dict)
    transposed: dict[str, bool] = field(default_factory=dict)
    # transformers' renamings and converters of this model's checkpoint keys (experts stored apart)
    renamings: list = field(default_factory=list)
    converters: list = field(default_factory=list)


def read_base(folder: Path) -> BaseCheckpoint:
    """Check the base folder and read every shard header; raises MergeError naming the problem."""
    folder = Path(folder)
    if not folder.is_dir():
        raise MergeError(
            f"--base {folder} is not a folder: pass a Hugging Face checkpoint folder (config.json + safetensors)."
        )
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise MergeError(f"--base {folder} has no config.json: pass a Hugging Face checkpoint folder.")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MergeError(f"cannot read {config_path}: {exc}") from exc
    if config.get("quantization_config"):
        method = (
            config["quantization_config"].get("quant_method", "?")
            if isinstance(config["quantization_config"], dict)
            else "?"
        )
        raise MergeError(
            f"--base {folder} is quantized (quantization_config.quant_method={method!r}): merge into the unquantized base model."
        )

    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise MergeError(f"cannot read {index_path} (needs a 'weight_map' object): {exc}") from exc
        shards = list(dict.fromkeys(weight_map.values()))
        sharded = True
    elif (folder / SINGLE_FILE).is_file():
        weight_map, shards, sharded = None, [SINGLE_FILE], False
    else:
        bins = sorted(p.name for p in folder.glob("pytorch_model*.bin"))
        hint = f" (found {bins[0]}: convert the base to safetensors first)" if bins else ""
        raise MergeError(f"--base {folder} has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}.")

    from safetensors import safe_open

    specs: dict[str, TensorSpec] = {}
    shard_of: dict[str, str] = {}
    for shard in shards:
        path = folder / shard
        if "/" in shard or "\\" in shard or not path.is_file():
            raise MergeError(f"{INDEX_FILE} names shard {shard!r}, which is not a file in {folder}.")
        try:
            with safe_open(str(path), "pt") as handle:
                for name in handle.keys():
                    tensor_slice = handle.get_slice(name)
                    specs[name] = TensorSpec(name, tensor_slice.get_dtype(), tuple(tensor_slice.get_shape()))
                    shard_of[name] = shard
        except MergeError:
            raise
        except Exception as exc:  # unreadable or corrupt file
            raise MergeError(f"cannot read safetensors shard {path}: {exc}") from exc
    if weight_map is not None:
        missing = [name for name, shard in weight_map.items() if shard_of.get(name) != shard]
        if missing:
            raise MergeError(
                f"{INDEX_FILE} lists {len(missing)} tensors not found in the shard it names, first {missing[0]!r} "
                f"in {weight_map[missing[0]]!r}: the checkpoint is incomplete."
            )
    return BaseCheckpoint(folder, config, shards, specs, shard_of, sharded)


def model_structure(folder: Path) -> ModelStructure:
    """Build the base model on the meta device to learn module kinds, order and tied weights.

    Architectures transformers cannot build from the config alone (custom code) give an empty
    structure; the merge then trusts adapter_config.json's fan_in_fan_out and assumes no ties.
    """
    try:
        import torch
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(folder))
        architectures = getattr(config, "architectures", None) or []
        model_class = getattr(transformers, architectures[0], None) if architectures else None
        with torch.device("meta"):
            if model_class is not None:
                model = model_class._from_config(config)
            else:
                model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - any failure only costs the extra checks, never correctness of plain LoRA
        return ModelStructure()

    from transformers.pytorch_utils import Conv1D

    structure = ModelStructure(known=True)
    for position, (name, module) in enumerate(model.named_modules()):
        structure.order[name] = position
        if isinstance(module, Conv1D):
            structure.kinds[name] = "conv1d"
        elif isinstance(module, torch.nn.Embedding):
            structure.kinds[name] = "embedding"
        elif isinstance(module, torch.nn.Linear):
            structure.kinds[name] = "linear"
        else:
            structure.kinds[name] = type(module).__name__
        structure.weights[name] = [(key, tuple(p.shape)) for key, p in module.named_parameters(recurse=False)]
        structure.transposed[name] = bool(getattr(module, "is_transposed", False))
    by_tensor: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    structure.tied_groups = [names for names in by_tensor.values() if len(names) > 1]
    structure.renamings, structure.converters = _conversions(model)
    return structure


def _conversions(model) -> tuple[list, list]:
    """transformers' renamings and converters of the model's checkpoint keys (none where it has none)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # a transformers without conversion mappings stores tensors as the model names them
        return [], []
    mapping = list(get_model_conversion_mapping(model) or [])
    return [t for t in mapping if isinstance(t, WeightRenaming)], [t for t in mapping if isinstance(t, WeightConverter)]
