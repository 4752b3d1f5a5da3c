"""Put a model on the training device: built on ``meta``, then given weights tensor by tensor.

No full copy of the model ever exists in host memory: safetensors shards are opened one at a time
and each tensor goes straight to the target device in the target dtype, where it replaces the
``meta`` placeholder. Quantized layers (QLoRA's 4-bit, lora-8bit's 8-bit) receive their dense
weight on the device and quantize it there, one layer at a time. ``init: random`` follows the same path with random tensors made on
the device. The order of quantize -> load -> adapters -> checkpointing is
:func:`memfit.step.prepare.prepare_for_method`'s; this module only supplies the ``load_weights``
step and the checks after it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.errors import UserError
from memfit.models.build import DTYPES, build_meta_model, compute_buffers, count_parameters, make_config
from memfit.models.expert_checkpoint import ExpertAssembler, ExpertCheckpointError
from memfit.models.experts_nf4 import fill_random, is_nf4_experts
from memfit.models.quantize import is_quantized_linear, quantize_on_device
from memfit.spec import RunSpec
from memfit.step.prepare import (
    SetupError,
    checkpointed_layers,
    expected_adapter_parameters,
    place_for_training,
    prepare_for_method,
)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class LoadError(UserError, ValueError):
    """The weights cannot be loaded into the model as configured (missing files or tensors, shapes)."""


# --------------------------------------------------------------------------------------------
# Devices


def resolve_device(name: str) -> torch.device:
    """``auto`` (first CUDA device if any, else CPU), ``cpu``, ``cuda`` (= ``cuda:0``) or ``cuda:N``.

    A CUDA device becomes the current device (``torch.cuda.set_device``), so that library code that
    allocates on "the current device" uses the one asked for and never ``cuda:0`` by accident.
    """
    text = str(name).strip().lower()
    if text == "auto":
        text = "cuda:0" if torch.cuda.is_available() else "cpu"
    if text == "cuda":
        text = "cuda:0"
    try:
        device = torch.device(text)
    except RuntimeError:
        raise LoadError(f"device: {name!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise LoadError(f"device: {name!r} is not supported; use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise LoadError(f"device: {name!r} asked for, but this PyTorch sees no CUDA device; use device: cpu")
    count = torch.cuda.device_count()
    if device.index >= count:
        raise LoadError(f"device: {name!r} does not exist ({count} CUDA device(s): cuda:0..cuda:{count - 1})")
    torch.cuda.set_device(device)
    return device


# --------------------------------------------------------------------------------------------
# Reading safetensors checkpoints


def checkpoint_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a Hugging Face model folder, in the order the index lists them."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise LoadError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return [folder / f for f in files]
    single = folder / SINGLE_FILE
    if single.is_file():
        return [single]
    others = sorted(folder.glob("*.safetensors"))
    if len(others) == 1:
        return others
    raise LoadError(
        f"model folder {str(folder)!r} has no {SINGLE_FILE} or {INDEX_FILE}. memfit loads safetensors "
        "checkpoints only; convert .bin weights with transformers' save_pretrained(safe_serialization=True), "
        "or use init: random for a randomly initialised model."
    )


def iter_checkpoint_tensors(folder: str | Path, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint, each read straight onto ``device``.

    One shard is open at a time and one tensor is alive at a time (the caller keeps what it needs).
    """
    from safetensors import safe_open

    target = str(device) if device.type == "cuda" else "cpu"
    for path in checkpoint_files(folder):
        with safe_open(str(path), framework="pt", device=target) as shard:
            for name in shard.keys():
                yield name, shard.get_tensor(name)


# --------------------------------------------------------------------------------------------
# Placing tensors into a meta model


def _tied_groups(model: nn.Module) -> dict[str, list[str]]:
    """Each parameter name -> every name that shares the same Parameter object (tied embeddings)."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return {name: names for names in by_id.values() for name in names}


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_name, _, attr = name.rpartition(".")
    return (model.get_submodule(module_name) if module_name else model), attr


def place_parameter(
    model: nn.Module, name: str, value: torch.Tensor, device: torch.device, tied: dict[str, list[str]]
) -> None:
    """Replace meta parameter ``name`` (and those tied to it) with ``value`` on ``device``.

    Floating tensors take the dtype the meta parameter has (the run's precision); the weight of a
    4-bit or 8-bit layer is quantized on the device instead.
    """
    module, attr = _owner(model, name)
    current = module._parameters[attr]
    if is_quantized_linear(module) and attr == "weight":
        expected = (module.out_features, module.in_features)
        if tuple(value.shape) != expected:
            raise LoadError(f"{name}: checkpoint shape {tuple(value.shape)} but the model expects {expected}")
        param = quantize_on_device(module, value.to(device), device)
    else:
        if tuple(value.shape) != tuple(current.shape):
            raise LoadError(
                f"{name}: checkpoint shape {tuple(value.shape)} but the model expects {tuple(current.shape)}"
            )
        dtype = current.dtype if value.is_floating_point() else value.dtype
        param = nn.Parameter(value.to(device=device, dtype=dtype), requires_grad=False)
    for alias in tied.get(name, [name]):
        owner, alias_attr = _owner(model, alias)
        owner._parameters[alias_attr] = param


def place_buffer(model: nn.Module, name: str, value: torch.Tensor, device: torch.device) -> None:
    module, attr = _owner(model, name)
    current = module._buffers[attr]
    dtype = current.dtype if (current is not None and value.is_floating_point()) else value.dtype
    module._buffers[attr] = value.to(device=device, dtype=dtype)


def persistent_buffer_names(model: nn.Module) -> set[str]:
    """Names of the buffers a checkpoint stores (those not marked non-persistent)."""
    names = set()
    for module_name, module in model.named_modules():
        for key, buf in module._buffers.items():
            if buf is not None and key not in module._non_persistent_buffers_set:
                names.add(f"{module_name}.{key}" if module_name else key)
    return names


def load_checkpoint_into(model: nn.Module, folder: str | Path, device: torch.device) -> dict[str, int]:
    """Fill the meta ``model`` from the safetensors checkpoint in ``folder``; return counts.

    Raises LoadError listing unexpected and missing tensors (after reading every shard, so all
    mismatches appear at once).
    """
    tied = _tied_groups(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    persistent = persistent_buffer_names(model)
    loaded: set[str] = set()
    unexpected: list[str] = []
    experts = ExpertAssembler(model)  # expert pieces into the fused experts, names renamed as transformers does
    for name, tensor in iter_checkpoint_tensors(folder, device):
        name = _expert_take(experts, name, tensor, folder)
        if name is None:
            continue
        if name in params:
            if name in loaded:  # a tied weight stored twice (embed_tokens and lm_head)
                continue
            place_parameter(model, name, tensor, device, tied)
            loaded.update(tied.get(name, [name]))
        elif name in persistent:
            place_buffer(model, name, tensor, device)
            loaded.add(name)
        else:
            unexpected.append(name)
        del tensor
    loaded |= experts.loaded()
    missing = sorted((set(params) | persistent) - loaded)
    problems = (
        [f"expert weights with some experts missing: {', '.join(experts.incomplete()[:5])}"]
        if experts.incomplete()
        else []
    )
    if unexpected:
        problems.append(
            f"{len(unexpected)} tensors in the checkpoint that the model does not have (first: {', '.join(unexpected[:5])})"
        )
    if missing:
        problems.append(f"{len(missing)} model tensors not in the checkpoint (first: {', '.join(missing[:5])})")
    if problems:
        raise LoadError(
            f"the checkpoint in {folder} does not match the model built from its config.json: "
            + "; ".join(problems)
            + ". Check that model_overrides do not change the architecture."
        )
    return {"tensors": len(loaded)}


def _expert_take(experts: ExpertAssembler, name: str, tensor: torch.Tensor, folder) -> str | None:
    """:meth:`ExpertAssembler.take`, an expert tensor that does not fit the model a LoadError."""
    try:
        return experts.take(name, tensor)
    except ExpertCheckpointError as err:
        raise LoadError(f"the checkpoint in {folder}: {err}") from None


def init_random_into(model: nn.Module, device: torch.device, initializer_range: float, seed: int) -> dict[str, int]:
    """Give every meta parameter random values made directly on ``device``.

    Matrices (linear and embedding weights) ~ normal(0, initializer_range), 1-D weights (norms) are
    ones, biases zeros; 4-bit and 8-bit layers get a random dense weight that is quantized at once. A
    generator seeded with ``seed`` makes the weights the same on every run.
    """
    tied = _tied_groups(model)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    done: set[str] = set()
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if name in done:
            continue
        module, attr = _owner(model, name)
        if is_nf4_experts(module) and attr in {w.name for w in module.expert_weights}:
            fill_random(
                module, device, generator, std=initializer_range
            )  # every weight of the module, expert by expert
            done.update(f"{name.rpartition('.')[0]}.{w.name}" for w in module.expert_weights)
            continue
        if is_quantized_linear(module) and attr == "weight":
            shape: tuple[int, ...] = (module.out_features, module.in_features)
            dtype = module.compute_dtype or torch.bfloat16
        else:
            shape, dtype = tuple(param.shape), param.dtype
        if attr == "bias":
            value = torch.zeros(shape, dtype=dtype, device=device)
        elif len(shape) == 1:
            value = torch.ones(shape, dtype=dtype, device=device)
        else:
            value = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, initializer_range, generator=generator)
        place_parameter(model, name, value, device, tied)
        done.update(tied.get(name, [name]))
    return {"tensors": len(done)}


def rebuild_nonpersistent_buffers(model: nn.Module, device: torch.device) -> list[str]:
    """Recompute buffers that checkpoints do not store (rotary ``inv_freq``) on ``device``.

    Such buffers are still on ``meta`` after loading. Their module is rebuilt from its config on the
    device (so it runs its own init logic, rope scaling included) and the fresh buffers are taken; a
    module without a config gets them from the model's initializer (:func:`compute_buffers`).
    Returns the names rebuilt; raises LoadError for a meta buffer whose module cannot be rebuilt.
    """
    rebuilt = []
    for module_name, module in model.named_modules():
        meta = [k for k, b in module._buffers.items() if b is not None and b.is_meta]
        if not meta:
            continue
        config = getattr(module, "config", None)
        if config is None:
            # A module built from arguments (Gemma's scaled embedding): the model's initializer knows it.
            for key in meta:
                module._buffers[key] = torch.empty_like(module._buffers[key], device=device)
            if not compute_buffers(model, module):
                raise LoadError(f"cannot rebuild buffers {meta} of {module_name} ({type(module).__name__}) on {device}")
            rebuilt.extend(f"{module_name}.{key}" if module_name else key for key in meta)
            continue
        with torch.device(device):
            fresh = type(module)(config)
        for key in meta:
            module._buffers[key] = fresh._buffers[key].to(device)
            rebuilt.append(f"{module_name}.{key}" if module_name else key)
        # Rotary modules also keep python attributes computed at init (attention scaling).
        for attr in ("attention_scaling",):
            if hasattr(fresh, attr):
                setattr(module, attr, getattr(fresh, attr))
    return rebuilt


def assert_no_meta(model: nn.Module) -> None:
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise LoadError(f"{len(left)} tensors still have no data after loading (first: {', '.join(left[:5])})")


# --------------------------------------------------------------------------------------------
# The whole load


@dataclass
class LoadedModel:
    """A model ready for training and what was done to it."""

    model: nn.Module
    device: torch.device
    config: Any
    setup: dict[str, Any]


def make_weight_loader(
    init: str, weights_dir: str | Path | None, device: torch.device, initializer_range: float, seed: int
) -> Callable[[nn.Module], None]:
    """The ``load_weights`` callback :func:`prepare_for_method` calls between quantizing and adapters."""

    def load(model: nn.Module) -> None:
        if init == "random":
            init_random_into(model, device, initializer_range, seed)
        else:
            if weights_dir is None:
                raise LoadError(
                    "model: pretrained weights need a local model folder; use init: random for a catalog name"
                )
            load_checkpoint_into(model, weights_dir, device)
        rebuild_nonpersistent_buffers(model, device)
        assert_no_meta(model)

    return load


def load_model(
    config_dict: dict[str, Any],
    spec: RunSpec,
    device: torch.device,
    *,
    init: str = "pretrained",
    weights_dir: str | Path | None = None,
    seed: int = 0,
) -> LoadedModel:
    """Build the model of ``config_dict`` on meta, load (or randomly initialise) its weights on
    ``device`` and prepare it for ``spec.method``; then check the result (:func:`verify_setup`)."""
    config = make_config(config_dict)
    dtype = DTYPES[spec.weight_precision]
    model = build_meta_model(config, dtype)
    initializer_range = float(getattr(config, "initializer_range", 0.02) or 0.02)
    loader = make_weight_loader(init, weights_dir, device, initializer_range, seed)
    # Adapters are created by PEFT on the device of the base layer they wrap; the random draws for
    # LoRA A must not depend on how much random init happened before, so seed them separately.
    torch.manual_seed(seed)
    model = prepare_for_method(model, spec, load_weights=loader)
    # PEFT may build the adapters on the default device; make sure every tensor is where asked.
    stray = sorted({str(t.device) for t in list(model.parameters()) + list(model.buffers()) if t.device != device})
    if stray:
        raise LoadError(f"tensors ended up on {', '.join(stray)} instead of {device}")
    model.train()
    setup = verify_setup(model, spec)
    place_for_training(model, spec)
    return LoadedModel(model=model, device=device, config=config, setup=setup)


# --------------------------------------------------------------------------------------------
# Checks after setup


def verify_setup(model: nn.Module, spec: RunSpec) -> dict[str, Any]:
    """Check the model is prepared the way ``spec`` says, and return what was checked.

    - trainable parameters: exactly what the adapters train (LoRA's r x (in + out) per adapted
      layer, DoRA's magnitudes, the copies of ``modules_to_save``) with adapters, every parameter
      for full fine-tuning;
    - base weights frozen, and carrying no gradient;
    - activation checkpointing on in every decoder layer when asked, off otherwise.
    """
    total, trainable = count_parameters(model)
    problems = []
    with_grad = [n for n, p in model.named_parameters() if p.grad is not None]
    if with_grad:
        problems.append(f"{len(with_grad)} parameters already hold gradients (first: {with_grad[0]})")
    if spec.uses_adapters:
        expected = expected_adapter_parameters(model)
        not_lora = [
            n
            for n, p in model.named_parameters()
            if p.requires_grad and "lora_" not in n and ".modules_to_save." not in n
        ]
        if not_lora:
            problems.append(f"base weights are trainable with {spec.method}: {', '.join(not_lora[:3])}")
        if expected == 0:
            problems.append("no LoRA layer was attached")
        if trainable != expected:
            problems.append(f"{trainable} trainable parameters, but the adapter layers imply {expected}")
    else:
        expected = total
        if trainable != total:
            problems.append(f"full fine-tuning trains {trainable} of {total} parameters")
    on, layers = checkpointed_layers(model)
    want = layers if spec.checkpointing != "off" else 0
    if on != want:
        problems.append(f"activation checkpointing is on in {on} of {layers} decoder layers (expected {want})")
    if problems:
        raise SetupError("the model is not set up as configured: " + "; ".join(problems))
    return {
        "total_params": total,
        "trainable_params": trainable,
        "expected_trainable_params": expected,
        "trainable_percent": round(100.0 * trainable / max(total, 1), 4),
        "checkpointed_layers": on,
        "decoder_layers": layers,
        "base_frozen": spec.uses_adapters,
    }
