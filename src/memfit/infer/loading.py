"""The model to talk to: a memfit run folder, or a model (with a LoRA adapter, or not).

A run folder (``run.json`` inside) is loaded as the run loaded it: :func:`memfit.train.loading.load_model`
with the run's model config, method, precision and seed, then the trained adapter's weights. So an
``init: random`` run, whose base weights were never saved, gets them again: the same seed draws the
same numbers on the same kind of device (a CPU run anywhere; a GPU run only on a GPU, where
PyTorch's generator is another). A full fine-tuning run's ``model/`` folder is a model like any
other. A model is a Hugging Face model folder or Hub id, read with transformers'
``from_pretrained``; ``--adapter`` puts a PEFT LoRA adapter folder on it.

Every refusal is a :class:`ChatError` (one line, exit code 2), raised before any weight is read
where the files can tell: no adapter in the run folder, a base model that is not on this machine,
an adapter made for another model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.errors import UserError
from memfit.models.vision import is_vision_config
from memfit.run_files import RUN_FILE

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: dtypes ``--dtype`` names (as ``memfit merge --dtype`` does).
DTYPE_NAMES = ("bf16", "fp16", "fp32")


class ChatError(UserError, ValueError):
    """The model or adapter to talk to cannot be loaded as given; the message says why and what to do."""


@dataclass
class ChatModel:
    """A model ready to generate, its tokenizer, where it is, and what it is (one line, for people)."""

    model: Any
    tokenizer: Any
    device: Any
    description: str
    processor: Any = None  # a vision-language model's: renders images into its prompts


def is_run_folder(path: str | Path) -> bool:
    """Whether ``path`` is a memfit run folder (it holds ``run.json``)."""
    return (Path(path) / RUN_FILE).is_file()


def load_chat_model(
    source: str,
    *,
    adapter: str | None = None,
    device: str = "auto",
    dtype: str | None = None,
    revision: str | None = None,
) -> ChatModel:
    """Load ``source`` (a run folder, a model folder or a Hub id) on ``device`` for generation."""
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise ChatError(f"--dtype {dtype!r}: use one of {', '.join(DTYPE_NAMES)}")
    if is_run_folder(source):
        if adapter is not None:
            raise ChatError(
                f"--adapter: {source} is a run folder, which names its own adapter; pass the base model "
                "with --adapter, or the run folder alone"
            )
        if dtype is not None:
            raise ChatError(f"--dtype: {source} is a run folder, loaded in the precision it trained in; drop --dtype")
        return _load_run(Path(source), device)
    return _load_model(source, adapter, device, dtype, revision)


# ------------------------------------------------------------------------------------------------
# Run folders


def read_run(run_dir: Path) -> dict[str, Any]:
    """``run.json`` of ``run_dir``, checked to hold what loading needs."""
    try:
        record = json.loads((run_dir / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ChatError(f"{run_dir / RUN_FILE}: cannot be read ({err}); is this a memfit run folder?") from None
    missing = [key for key in ("config", "spec", "model_config") if not isinstance(record.get(key), dict)]
    if missing:
        raise ChatError(f"{run_dir / RUN_FILE} lacks {', '.join(missing)}: not a run.json memfit train wrote")
    return record


def run_output(run_dir: Path, record: dict[str, Any]) -> Path:
    """The run's deliverable (``adapter/`` or ``model/``), or a ChatError saying why there is none."""
    from memfit.spec import ADAPTER_METHODS
    from memfit.train.run_folder import output_dir

    adapters = record["spec"].get("method") in ADAPTER_METHODS
    out = output_dir(run_dir, adapters)
    wanted = ADAPTER_WEIGHTS if adapters else "config.json"
    if (out / wanted).is_file():
        return out
    raise ChatError(missing_output(run_dir, record, out, adapters))


def missing_output(run_dir: Path, record: dict[str, Any], out: Path, adapters: bool) -> str:
    """One line: what the run folder lacks (its adapter, or a full fine-tune's model folder), why, and
    what to do: put it back, finish the run with ``--resume`` (only when a checkpoint can), or train."""
    from memfit.train.checkpointing import latest_checkpoint

    saved = "its adapter" if adapters else f"its model folder ({out.name}/, a full fine-tune's whole model)"
    status, step, total = record.get("status", "unknown"), record.get("step"), record.get("total_steps")
    if status == "completed":
        other = "pass the base model with --adapter FOLDER" if adapters else "pass the model folder itself"
        return (
            f"{run_dir} has no {out.name}/ although the run completed: {saved} was moved or deleted. Put it back in "
            f"{out}, or {other}."
        )
    where = f", step {step} of {total}" if step is not None and total is not None else ""
    lacks = (
        f"{run_dir} has no adapter saved yet: the run has not reached a save (the adapter is written when it completes; "
        f"its status is {status!r}{where})"
        if adapters
        else f"{run_dir} has no {out.name}/ yet: a full fine-tune saves its whole model there when the run completes, and "
        f"this one has not (its status is {status!r}{where})"
    )
    if status == "diverged":
        todo = "its loss diverged: train it again with a lower lr"
    elif latest_checkpoint(run_dir) is not None:
        todo = (
            "if it is still training, wait for it to end; otherwise " if status == "running" else ""
        ) + f"finish it first: memfit train CONFIG -o {run_dir} --resume"
    else:
        todo = (
            "if it is still training, wait for it to end; otherwise " if status == "running" else ""
        ) + "train it again: it saved no checkpoint to resume from"
    return f"{lacks}. To chat with it, {todo}."


def _load_run(run_dir: Path, device_name: str) -> ChatModel:
    record = read_run(run_dir)
    out = run_output(run_dir, record)
    if out.name != "adapter":  # full fine-tuning: model/ is a whole Hugging Face model folder
        precision = record["spec"].get("precision")
        chat = _load_model(str(out), None, device_name, precision if precision in DTYPE_NAMES else None, None)
        chat.description = f"{run_dir} (full fine-tuning, {out})"
        return chat
    config = record["config"]
    init = config.get("init", "pretrained")
    build_device, device = _run_devices(run_dir, record, device_name)
    weights = None if init == "random" else _run_base_weights(run_dir, record)
    tokenizer = _tokenizer(out, None)
    model = _rebuilt_run_model(record, build_device, weights)
    mismatch = adapter_mismatch(model, out)
    if mismatch:
        raise ChatError(
            f"{out} is an adapter for another model than the run's base ({mismatch}); was the folder "
            "copied from another run?"
        )
    _load_adapter_weights(model, out, build_device)
    if device != build_device:
        model.to(device)
    base = (
        f"{config.get('model')} (random weights from seed {config.get('seed', 0)})"
        if init == "random"
        else str(weights)
    )
    description = f"{run_dir}: {record['spec'].get('method')} adapter on {base}, on {device}"
    processor = _processor(out) if is_vision_config(record["model_config"]) else None
    return ChatModel(model=model, tokenizer=tokenizer, device=device, description=description, processor=processor)


def _processor(folder: Path):
    """The processor a vision-language run saved beside its adapter or model."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(str(folder))
    except (OSError, ValueError, TypeError, ImportError) as err:
        raise ChatError(f"{folder}: its processor cannot be loaded: {str(err).splitlines()[0]}") from None


def _run_devices(run_dir: Path, record: dict[str, Any], device_name: str):
    """(where the base is built, where it runs). A random base is drawn on the kind of device the
    run drew it on: the same seed gives other numbers on a CPU than on a GPU."""
    import torch

    from memfit.train.loading import resolve_device

    device = resolve_device(device_name)
    if record["config"].get("init") != "random":
        return device, device
    trained_on = str(record.get("device", "cpu")).split(":")[0]
    if trained_on == device.type:
        return device, device
    if trained_on == "cuda":
        if not torch.cuda.is_available():
            raise ChatError(
                f"{run_dir} trained on random base weights (init: random) drawn on a GPU; the same seed draws other "
                "numbers on a CPU, so its base can be made again only on a GPU: run memfit chat on a machine with one"
            )
        return resolve_device("cuda"), device
    return torch.device("cpu"), device


def _run_base_weights(run_dir: Path, record: dict[str, Any]) -> Path:
    """The folder of a pretrained run's base weights (a Hub model's snapshot, fetched again if gone)."""
    from memfit.train.loading import checkpoint_files

    folder = Path(record["config"].get("model", ""))
    hub = record.get("hub") or {}
    try:
        if folder.is_dir():
            checkpoint_files(folder)
            return folder
    except UserError:
        if not hub:
            raise ChatError(
                f"{run_dir}: the base model folder {str(folder)!r} has no safetensors weights any more; "
                "put the base model back where the run read it"
            ) from None
    if hub.get("repo_id"):
        from memfit.models.catalog import suggestions
        from memfit.models.hub import HubError, fetch_model

        try:
            return fetch_model(
                hub["repo_id"],
                hub.get("commit"),
                weights=True,
                allow_pickle=bool(record["config"].get("allow_pickle_weights")),
                opt_in="allow_pickle_weights: true in the run's config",
                suggest=suggestions,
            ).folder
        except HubError as err:
            raise ChatError(f"{run_dir}: its base model {hub['repo_id']}: {err}") from None
    raise ChatError(
        f"{run_dir}: its base model {str(folder)!r} is not on this machine; put the base model back at that "
        "path (the adapter alone cannot answer)"
    )


def _rebuilt_run_model(record: dict[str, Any], device, weights: Path | None) -> Any:
    """The run's model as it began: its base weights (read from ``weights``, or drawn from the run's
    seed as the run drew them) with fresh adapters, built by the trainer's own loader."""
    from memfit.spec import make_spec
    from memfit.train.loading import load_model

    knobs = dict(record["spec"])
    # Checkpointing and tiling only change how training keeps memory, not a forward's numbers, and
    # would slow generation down.
    knobs.update(checkpointing="off", tiling="off")
    config = record["config"]
    return load_model(
        record["model_config"],
        make_spec(**knobs),
        device,
        init=config.get("init", "pretrained"),
        weights_dir=weights,
        seed=int(config.get("seed", 0)),
    ).model


def _load_adapter_weights(model: Any, adapter_dir: Path, device) -> None:
    """Put the trained tensors of ``adapter_dir`` into ``model``'s adapters: LoRA's matrices, DoRA's
    magnitudes and the trained copies of modules trained whole (``modules_to_save``), as PEFT loads them."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(str(adapter_dir / ADAPTER_WEIGHTS), device=str(device))
    result = set_peft_model_state_dict(model, state)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise ChatError(f"{adapter_dir} has tensors the run's model has no place for (first: {unexpected[0]})")
    model.eval()


# ------------------------------------------------------------------------------------------------
# Models and adapters


def _torch_dtype(dtype: str | None, device):
    import torch

    if dtype is None:  # the checkpoint's own dtype on a GPU; fp32 on a CPU, where half precision is slow
        return "auto" if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]


def _model_folder(source: str, revision: str | None) -> Path:
    from memfit.models.catalog import suggestions
    from memfit.models.hub import HubError, fetch_model, is_hub_id

    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ChatError(
                f"{source}: a folder without config.json or run.json; pass a Hugging Face model folder or a memfit "
                "run folder"
            )
        return path
    if is_hub_id(source):
        try:
            return fetch_model(source, revision, weights=True, suggest=suggestions).folder
        except HubError as err:
            raise ChatError(f"{source}: {err}") from None
    raise ChatError(
        f"{source!r} is not a run folder, a model folder or a Hugging Face Hub id (org/name); check the path"
    )


def _tokenizer(folder: Path, fallback: Path | None):
    """The tokenizer saved in ``folder`` (a run's adapter holds the run's), else in ``fallback``."""
    from transformers import AutoTokenizer

    for candidate in (folder, fallback):
        if candidate is not None and any(
            (candidate / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
        ):
            try:
                return AutoTokenizer.from_pretrained(str(candidate))
            except (OSError, ValueError) as err:
                raise ChatError(f"{candidate}: its tokenizer cannot be loaded: {err}") from None
    where = " or ".join(str(c) for c in (folder, fallback) if c is not None)
    raise ChatError(f"no tokenizer in {where}: save one there (tokenizer.save_pretrained) to chat with this model")


def _load_model(
    source: str, adapter: str | None, device_name: str, dtype: str | None, revision: str | None
) -> ChatModel:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from memfit.models.config_file import read_config_file
    from memfit.train.loading import resolve_device

    folder = _model_folder(source, revision)
    vision = (folder / "config.json").is_file() and is_vision_config(read_config_file(folder / "config.json"))
    if vision:
        AutoModelForCausalLM = AutoModelForImageTextToText
    adapter_dir = _adapter_folder(adapter) if adapter is not None else None
    device = resolve_device(device_name)
    tokenizer = _tokenizer(adapter_dir, folder) if adapter_dir is not None else _tokenizer(folder, None)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=_torch_dtype(dtype, device))
    except (OSError, ValueError) as err:
        raise ChatError(f"{source}: the model cannot be loaded: {str(err).splitlines()[0]}") from None
    model.to(device)
    description = f"{source}"
    if adapter_dir is not None:
        mismatch = adapter_mismatch(model, adapter_dir)
        if mismatch:
            raise ChatError(
                f"--adapter {adapter}: made for another model than {source} ({mismatch}); pass the base model "
                "it was trained on"
            )
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=False)
        description += f" with adapter {adapter}"
    model.eval()
    processor = _processor(adapter_dir or folder) if vision else None
    return ChatModel(
        model=model, tokenizer=tokenizer, device=device, description=f"{description}, on {device}", processor=processor
    )


def _adapter_folder(adapter: str) -> Path:
    path = Path(adapter).expanduser()
    if not path.is_dir():
        raise ChatError(
            f"--adapter {adapter!r} is not a folder; pass a PEFT adapter folder (adapter_config.json and "
            f"{ADAPTER_WEIGHTS})"
        )
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (path / name).is_file():
            raise ChatError(
                f"--adapter {adapter!r} has no {name}: not a PEFT LoRA adapter folder (a memfit run keeps its "
                "adapter in RUN_DIR/adapter)"
            )
    return path


def adapter_mismatch(model: Any, adapter_dir: Path) -> str | None:
    """Why the LoRA matrices of ``adapter_dir`` do not fit ``model``'s layers (None when they do):
    a layer the model lacks, or matrices shaped for other layer sizes. Reads tensor shapes only."""
    from safetensors import safe_open

    modules = dict(model.named_modules())
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base_modules = dict(base.named_modules())
    with safe_open(str(adapter_dir / ADAPTER_WEIGHTS), framework="pt") as weights:
        for key in weights.keys():
            layer, _, rest = key.partition(".lora_")
            if not rest.startswith(("A.", "B.")):
                continue  # not a LoRA matrix (a bias, an embedding adapter): left to PEFT
            name = layer.removeprefix("base_model.model.")
            # PEFT's wrappers of a module's weights (experts) nest: the inner one sits at <module>.base_layer
            module = base_modules.get(name) or modules.get(layer) or base_modules.get(name.replace(".base_layer", ""))
            if module is None:
                return f"it adapts {name}, which this model does not have"
            if (
                getattr(module, "parameter_name", None) is None
            ):  # a weight's wrapper (PEFT's ParamWrapper) has its own sizes
                module = getattr(module, "base_layer", module)
            in_features, out_features = _features(module)
            shape = tuple(weights.get_slice(key).get_shape())
            expected_side = in_features if rest.startswith("A") else out_features
            side = shape[1] if rest.startswith("A") else shape[0]
            if expected_side is not None and side != expected_side:
                return f"{key} has shape {shape}, but {name} is {in_features} -> {out_features}"
    return None


def _features(module: Any) -> tuple[int | None, int | None]:
    in_features = getattr(module, "in_features", None)
    out_features = getattr(module, "out_features", None)
    if in_features is None and hasattr(module, "weight") and getattr(module.weight, "dim", lambda: 0)() == 2:
        out_features, in_features = module.weight.shape
    return in_features, out_features
