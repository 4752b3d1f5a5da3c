"""The training configuration: a YAML file of serialized arguments, validated in one pass.

A run is described by the :class:`~memfit.spec.RunSpec` knobs that ``memfit plan`` takes (method,
rank, precision, batch_size, ...) plus what only training needs (model weights, data, schedule,
output). :func:`load_config` reads the YAML, applies command-line overrides and returns a
:class:`TrainConfig`, or raises one :class:`ConfigError` that lists every problem with its field
name (unknown keys get a "did you mean"). Importing this module imports no torch (validating a
model's architecture asks transformers, which does).

Relative paths written in a YAML file are relative to that file's folder, so a config and its data
can move together; paths given as overrides (command-line flags) are relative to the current
directory.
"""

from __future__ import annotations

import difflib
import functools
import math
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    create_model,
    field_validator,
)

from memfit import spec as specs
from memfit.errors import UserError, listed
from memfit.json_form import JsonForm
from memfit.options import BUDGET, GPU, REVISION
from memfit.spec import ObjectiveParams, RunSpec, SpecError, make_spec, objective_problems
from memfit.train.data.sources import DataSource
from memfit.train.generation import DEFAULT_EVAL_MAX_NEW_TOKENS, prompt_problem

#: Fields holding paths, resolved against the YAML file's folder.
PATH_FIELDS = ("model", "tokenizer", "data", "eval_data", "output_dir")

#: Whole-number fields of a training config besides the knobs: counts of steps and the seed.
COUNT_FIELDS = (
    "max_steps",
    "warmup_steps",
    "eval_every",
    "save_every",
    "log_every",
    "keep_checkpoints",
    "seed",
    "max_prompt_length",
)

#: What other tools (Hugging Face TrainingArguments, PEFT's LoraConfig, axolotl) call memfit's
#: fields: an unknown key spelled like this gets "did you mean" even where it looks nothing alike.
OTHER_NAMES = {
    "learning_rate": "lr",
    "num_train_epochs": "epochs",
    "num_epochs": "epochs",
    "max_steps_per_epoch": "max_steps",
    "r": "rank",
    "lora_r": "rank",
    "lora_rank": "rank",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
    "target_modules": "targets",
    "lora_target_modules": "targets",
    "per_device_train_batch_size": "batch_size",
    "micro_batch_size": "batch_size",
    "train_batch_size": "batch_size",
    "gradient_accumulation_steps": "grad_accum",
    "max_seq_length": "seq_len",
    "max_length": "seq_len",
    "sequence_len": "seq_len",
    "seq_length": "seq_len",
    "context_length": "seq_len",
    "gradient_checkpointing": "checkpointing",
    "activation_checkpointing": "checkpointing",
    "optim": "optimizer",
    "lr_scheduler_type": "schedule",
    "lr_scheduler": "schedule",
    "warmup": "warmup_steps",
    "model_name_or_path": "model",
    "base_model": "model",
    "model_name": "model",
    "dataset": "data",
    "datasets": "data",
    "train_data": "data",
    "train_file": "data",
    "dataset_name": "data",
    "dataset_config": "data",
    "dataset_config_name": "data",
    "dataset_train_split": "data",
    "dataset_test_split": "eval_data",
    "dataset_streaming": "streaming",
    "buffer_size": "shuffle_buffer_size",
    "interleave_probs": "data",
    "mix_strategy": "stopping_strategy",
    "output": "output_dir",
    "out_dir": "output_dir",
    "save_steps": "save_every",
    "logging_steps": "log_every",
    "eval_steps": "eval_every",
    "save_total_limit": "keep_checkpoints",
    "bf16": "precision",
    "fp16": "precision",
    "dtype": "precision",
    "torch_dtype": "precision",
    "adapter": "method",
    "peft": "method",
    "use_peft": "method",
    "precompute_ref_log_probs": "precompute_reference",
}


class ConfigError(UserError, ValueError):
    """The training configuration has problems; ``problems`` holds one line each, naming the field."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        where = f" in {source}" if source else ""
        super().__init__(listed(f"invalid training configuration{where}", problems))


def _run_knobs() -> type[BaseModel]:
    """The knob fields of a training config, made from :class:`~memfit.spec.RunSpec` (declared there
    once: default and help). Their values are checked by :func:`memfit.spec.make_spec`, which names
    the knob and its allowed values better than a type error would, so any value is taken here."""
    fields: dict[str, Any] = {
        name: (Any, Field(specs.default(name), description=specs.help_text(name))) for name in specs.TRAINED_KNOBS
    }
    return create_model("RunKnobs", __config__=ConfigDict(extra="forbid", frozen=True), **fields)


def _objective_fields() -> type[BaseModel]:
    """The loss parameters of a training config (:class:`~memfit.spec.ObjectiveParams`), but for
    ``beta``, which is a knob (grpo's reference pass depends on it) and comes with the knobs."""
    fields = {name: (info.annotation, info) for name, info in ObjectiveParams.model_fields.items() if name != "beta"}
    return create_model("ObjectiveFields", __config__=ConfigDict(extra="forbid", frozen=True), **fields)


class TrainConfig(_run_knobs(), _objective_fields(), JsonForm):
    """Every setting of a training run: the :class:`~memfit.spec.RunSpec` knobs (``method``, ``rank``,
    ``batch_size``...), the preference objectives' loss parameters (:class:`~memfit.spec.ObjectiveParams`:
    ``beta``, ``loss_type``...) and what only training needs. Field docs double as the YAML reference
    (docs/train.md)."""

    # -- model ------------------------------------------------------------------------------
    model: str = Field(
        description="Hugging Face Hub id (org/name: downloaded when the run starts), local Hugging Face model folder (config.json + *.safetensors), a config.json, or a catalog name (with init: random)"
    )
    revision: str | None = Field(None, description=REVISION.help_for("train"))
    allow_pickle_weights: StrictBool = Field(
        False,
        description="a Hub model with only pickled .bin weights: download them, read them with torch.load(weights_only=True) and convert them to safetensors (trust the repo first)",
    )
    init: Literal["pretrained", "random"] = Field(
        "pretrained",
        description="pretrained: load the folder's weights; random: random weights (demos, tests, benchmarks)",
    )
    model_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="config.json fields to change, e.g. {num_hidden_layers: 2} (init: random only)",
    )
    tokenizer: str | None = Field(
        None,
        description="tokenizer folder; default: the model folder (or the Hub model's tokenizer), or the shipped tiny tokenizer with init: random",
    )

    # -- data -------------------------------------------------------------------------------
    data: list[str | DataSource] = Field(
        description="training data: a local file or folder, a Hugging Face Hub dataset id (org/name), or a list of sources, each a path or {path, subset, split, revision, columns, weight, format} (docs/data.md)"
    )
    data_format: Literal[
        "auto", "alpaca", "sharegpt", "messages", "text", "prompt_completion", "preference", "prompt"
    ] = Field(
        "auto",
        description="record format of every source (auto: detected from each source's first record; preference: chosen / rejected pairs, for objective dpo, orpo or simpo; prompt: a prompt and any other fields, for objective grpo, which reads every source so)",
    )
    train_on_inputs: StrictBool = Field(False, description="also take the loss on prompt tokens")
    eval_split: float = Field(0.0, description="fraction of the training examples held out for evaluation (0 = none)")
    eval_data: list[str | DataSource] | None = Field(
        None, description="evaluation data instead of a split: the same forms as data, read whole (never streamed)"
    )
    eval_every: int = Field(
        0, description="evaluate every N optimizer steps (0 = only at the end when there is eval data)"
    )
    streaming: StrictBool = Field(
        False,
        description="read the training data while training, as a stream (data larger than memory; Hub datasets are not downloaded first); needs max_steps",
    )
    shuffle_buffer_size: int = Field(
        1000, description="with streaming: rows of the stream shuffled together (0: the stream's order)"
    )
    stopping_strategy: Literal["all_exhausted", "first_exhausted"] = Field(
        "all_exhausted",
        description="a mix of weighted sources ends when every source was read whole, the others starting again (all_exhausted), or when the first runs out (first_exhausted)",
    )
    eval_prompts: list[Any] = Field(
        default_factory=list,
        description="prompts (text, or lists of {role, content} messages) whose greedy replies are written to metrics.jsonl at every evaluation and at the end",
    )
    eval_max_new_tokens: int = Field(
        DEFAULT_EVAL_MAX_NEW_TOKENS, description="the longest reply to an eval_prompts prompt, in tokens"
    )

    # -- grpo -------------------------------------------------------------------------------
    reward_funcs: list[str] = Field(
        default_factory=list,
        description="grpo: the reward functions (TRL's reward_funcs): each file.py:function (relative to this file's folder), package.module:function, or a built-in: think_format, length (docs/grpo.md)",
    )
    reward_weights: list[float] | None = Field(
        None, description="grpo: a weight for each reward function (TRL's reward_weights; default 1 each)"
    )
    max_prompt_length: int | None = Field(
        None,
        description="grpo: the longest prompt, in tokens (longer ones keep their last tokens); seq_len is then this plus max_completion_length unless given (default: seq_len - max_completion_length)",
    )

    # -- schedule ---------------------------------------------------------------------------
    epochs: float | None = Field(
        None, description="passes over the training data (default 1 when max_steps is not set)"
    )
    max_steps: int | None = Field(None, description="optimizer steps; takes precedence over epochs")
    lr: float = Field(2e-4, description="peak learning rate")
    weight_decay: float = Field(0.0, description="AdamW / SGD weight decay")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="learning-rate decay after warmup")
    warmup_steps: int | None = Field(None, description="optimizer steps of linear warmup from 0")
    warmup_ratio: float | None = Field(
        None, description="warmup as a fraction of the optimizer steps (instead of warmup_steps)"
    )
    min_lr_ratio: float = Field(0.0, description="lr at the end of a cosine or linear decay, as a fraction of lr")
    seed: int = Field(0, description="random seed (weights of init: random, LoRA init, data order, dropout)")

    # -- where and how ----------------------------------------------------------------------
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    output_dir: str | None = Field(
        None, description="run folder; default runs/<config file name>", json_schema_extra={"short": "-o"}
    )
    log_every: int = Field(1, description="write metrics every N optimizer steps")
    report_to: list[str] = Field(
        default_factory=list,
        description="also send the metrics to: none (default), all (every installed one), or tensorboard, wandb, mlflow (a list, or comma-separated; as the Hugging Face Trainer's report_to)",
    )
    save_every: int = Field(
        0, description="save a checkpoint every N optimizer steps (0 = only at the end and on interrupt)"
    )
    keep_checkpoints: int = Field(2, description="how many recent checkpoints to keep")
    gpu: str | None = Field(None, description=GPU.help_for("train"))
    budget: str | None = Field(None, description=BUDGET.help_for("train"))
    force: StrictBool = Field(False, description="train even when the plan says the run does not fit")
    fit: Literal["off", "auto"] = Field(
        "off",
        description="auto: before loading, choose the micro-batch split, checkpointing and tiling that fit the device (or gpu / budget), fastest first; the effective batch, method, rank, lr and data stay",
    )
    fit_optimizer: StrictBool = Field(
        False, description="let fit also choose a lighter optimizer (8-bit / paged AdamW)"
    )
    on_oom: Literal["continue", "stop"] = Field(
        "continue",
        description="when a step runs out of memory: continue with the next configuration down at the same effective batch and data order, or stop with a checkpoint",
    )

    @field_validator("data", "eval_data", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any, info) -> Any:
        """A path or source, or a list of them; each mapping becomes a :class:`DataSource`."""
        if value is None:
            return None
        items = [value] if isinstance(value, (str, Path, dict, DataSource)) else value
        if not isinstance(items, list):
            raise ValueError(
                f"{info.field_name}: expected a path, a Hub dataset id (org/name), a mapping with path: or a "
                f"list of them, got {type(value).__name__}"
            )
        sources, problems = [], []
        for index, item in enumerate(items):
            try:
                sources.append(_one_source(info.field_name, index, len(items), item))
            except ValueError as err:
                problems.append(str(err))
        if problems:
            raise ValueError("\n".join(problems))  # validate_config lists them one a line
        return sources

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_names(cls, value: Any) -> Any:
        from memfit.train.trackers import parse_report_to

        return parse_report_to(value)

    @field_validator("*", mode="before")
    @classmethod
    def _not_a_boolean(cls, value: Any, info) -> Any:
        # pydantic takes true as 1 (and 1.0); a YAML true where a number belongs is a mistake, not a number.
        kind = field_kind(cls.model_fields[info.field_name].annotation)
        if kind in ("int", "float") and isinstance(value, bool):
            raise ValueError(boolean_problem(info.field_name, kind, cls.model_fields[info.field_name].default))
        return value

    @field_validator("eval_prompts", mode="before")
    @classmethod
    def _one_prompt_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @property
    def spec(self) -> RunSpec:
        """The validated RunSpec of the knobs (sizes per GPU)."""
        return make_spec(**self.knobs())

    @property
    def objective_params(self) -> ObjectiveParams:
        """The objective's loss parameters (beta resolved for the objective, loss_type, simpo_gamma,
        cpo_alpha, grpo's epsilon, epsilon_high and scale_rewards); grpo's loss_type is dapo unless set."""
        values = {name: getattr(self, name) for name in ObjectiveParams.model_fields if name != "beta"}
        if self.objective == "grpo" and "loss_type" not in self.model_fields_set:
            values["loss_type"] = specs.LOSS_TYPES["grpo"][0]
        beta = self.beta if isinstance(self.beta, (int, float)) and not isinstance(self.beta, bool) else None
        if beta is None:
            beta = 0.0 if self.objective == "grpo" else specs.DEFAULT_BETA
        return ObjectiveParams(beta=beta, **values)

    @property
    def reward_weights_in_effect(self) -> list[float]:
        """grpo: the weight of each reward function (1 each unless ``reward_weights`` says)."""
        return list(self.reward_weights) if self.reward_weights is not None else [1.0] * len(self.reward_funcs)

    def knobs(self) -> dict[str, Any]:
        """The knobs this config sets, as ``memfit plan`` takes them (the others take their defaults).

        A ``null`` in the YAML for a knob whose default is not None (``max_grad_norm: null``: no
        clipping) is passed as ``"none"``: to :func:`~memfit.spec.make_spec` a None means "the
        default"."""
        knobs = {}
        for name in specs.TRAINED_KNOBS:
            if name not in self.model_fields_set:
                continue
            value = getattr(self, name)
            if value is None and specs.default(name) is not None:
                value = "none"
            knobs[name] = value
        return knobs

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def field_kind(annotation: Any) -> str | None:
    """``bool``, ``int`` or ``float`` for a field of that type (``Optional`` looked through), else None."""
    kinds = {a for a in (typing.get_args(annotation) or (annotation,)) if a is not type(None)}
    if kinds == {bool}:
        return "bool"
    if kinds and kinds <= {int, float}:
        return "float" if float in kinds else "int"
    return None


def boolean_problem(field: str, kind: str, default: Any = None) -> str:
    """What follows ``field: true`` where a number belongs (see :func:`type_problem`)."""
    number = "whole number" if kind == "int" else "number"
    example = (
        f" (e.g. {field}: {default})" if isinstance(default, (int, float)) and not isinstance(default, bool) else ""
    )
    return f"is true or false, not a {number}: write a {number}{example}"


def type_problem(field: str, value: Any, message: str, error_type: str = "") -> str:
    """One line for a value of the wrong type, naming the field, the value as YAML writes it and the
    type the field takes: a boolean field refuses text and numbers (pydantic's strict booleans: YAML
    reads yes and on as true, but 'yes' quoted is text, and 1 is a number), a number field refuses
    true and false."""
    shown = (
        {True: "true", False: "false"}[value] if isinstance(value, bool) else "null" if value is None else repr(value)
    )
    if error_type == "bool_type":
        what = (
            "text"
            if isinstance(value, str)
            else "a number"
            if isinstance(value, (int, float))
            else "null"
            if value is None
            else f"a {'list' if isinstance(value, list) else type(value).__name__}"
        )
        return f"{field}: {shown} is not true or false but {what}: write {field}: true or {field}: false (unquoted)"
    if message.startswith("is true or false"):
        return f"{field}: {shown} {message}"
    return f"{field}: {value!r}: {message}"


def _one_source(field: str, index: int, count: int, item: Any) -> str | DataSource:
    """One entry of ``data`` / ``eval_data``: a path kept as text, a mapping as a DataSource."""
    from memfit.train.data.sources import field_name

    name = field_name(field, index, count)
    if isinstance(item, (str, Path)):
        return str(item)
    if isinstance(item, DataSource):
        return item
    if not isinstance(item, dict):
        raise ValueError(f"{name}: expected a path, a Hub dataset id (org/name) or a mapping with path:, got {item!r}")
    if "path" not in item:
        raise ValueError(
            f"{name}: a source given as a mapping needs path: (a local file or folder, or a Hub dataset id org/name)"
        )
    try:
        return DataSource(**item)
    except ValidationError as err:
        details = []
        for e in err.errors():
            where = ".".join(str(p) for p in e.get("loc", ()))
            message = str(e.get("msg", "")).removeprefix("Value error, ")
            details.append(
                type_problem(f"{name}.{where}", e.get("input"), message, e.get("type", ""))
                if where
                else f"{name}: {message}"
            )
        raise ValueError("\n".join(details)) from None


# ------------------------------------------------------------------------------------------------
# Reading


def load_config(
    path: str | Path | None = None, overrides: dict[str, Any] | None = None, *, base_dir: str | Path | None = None
) -> TrainConfig:
    """Read the YAML at ``path`` (or none), apply ``overrides`` on top, validate everything.

    ``None`` values in ``overrides`` are ignored (an unset flag). Raises :class:`ConfigError`.
    """
    data: dict[str, Any] = {}
    source = None
    yaml_dir = Path(base_dir) if base_dir is not None else Path.cwd()
    if path is not None:
        path = Path(path)
        source = str(path)
        loaded = read_yaml(path)
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                [f"the file must hold a mapping of settings (key: value), not a {type(loaded).__name__}"], source
            )
        data = {str(k).replace("-", "_"): v for k, v in loaded.items()}
        yaml_dir = path.resolve().parent
        data = _resolve_paths(data, yaml_dir)
        if "output_dir" not in data:
            data["output_dir"] = str(Path("runs") / path.stem)
    flags = {k.replace("-", "_"): v for k, v in (overrides or {}).items() if v is not None}
    data.update(_resolve_paths(flags, Path.cwd()))
    return validate_config(data, source)


def read_yaml(path: Path) -> Any:
    """The YAML document in ``path``; :class:`ConfigError` for a file that is missing, a folder,
    not UTF-8 text, not valid YAML, or that gives a key twice (YAML keeps the last silently)."""
    import yaml

    if path.is_dir():
        raise ConfigError([f"config file {str(path)!r} is a folder; pass the YAML file (e.g. examples/tiny.yaml)"])
    if not path.is_file():
        raise ConfigError([f"config file {str(path)!r} does not exist"])
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError([f"not a text file (byte {err.start} is not UTF-8): pass a YAML file"], str(path)) from None
    try:
        return yaml.load(text, Loader=_strict_loader())
    except yaml.YAMLError as err:
        raise ConfigError([yaml_problem(err)], str(path)) from None


def yaml_problem(err: Exception) -> str:
    """A YAML error in one line: where, and what the parser saw."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    what = getattr(err, "problem", None) or str(err).splitlines()[0]
    context = getattr(err, "context", None)
    return f"not valid YAML at {where}{what}" + (f" ({context})" if context else "")


@functools.lru_cache(maxsize=1)
def _strict_loader():
    """A SafeLoader that refuses a mapping giving the same key twice (made on first use: pyyaml is
    imported only when a config is read)."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        """SafeLoader that refuses a mapping giving the same key twice."""

    def construct_mapping(loader, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} is given twice (lines {seen[key]} and {line}): keep one", key_node.start_mark
                )
            seen[key] = line
        return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return StrictLoader


def _resolve_paths(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    out = dict(data)
    if isinstance(out.get("reward_funcs"), (str, list)):
        out["reward_funcs"] = [
            _resolve_reward(entry, folder)
            for entry in ([out["reward_funcs"]] if isinstance(out["reward_funcs"], str) else out["reward_funcs"])
        ]
    for key in PATH_FIELDS:
        value = out.get(key)
        if isinstance(value, (str, Path)):
            out[key] = _resolve_one(key, str(value), folder)
        elif isinstance(value, dict):
            out[key] = _resolve_source(key, value, folder)
        elif isinstance(value, list):
            out[key] = [
                _resolve_one(key, str(v), folder) if isinstance(v, (str, Path)) else _resolve_source(key, v, folder)
                for v in value
            ]
    return out


def _resolve_reward(entry: Any, folder: Path) -> Any:
    """A reward function named as ``file.py:function``, its file relative to ``folder``."""
    if not isinstance(entry, str) or ".py:" not in entry:
        return entry
    path, _, function = entry.rpartition(":")
    resolved = Path(path).expanduser()
    return f"{resolved if resolved.is_absolute() else folder / resolved}:{function}"


def _resolve_source(key: str, value: Any, folder: Path) -> Any:
    """A data source given as a mapping, with its ``path`` resolved like a path written alone."""
    if isinstance(value, dict) and isinstance(value.get("path"), (str, Path)):
        return {**value, "path": _resolve_one(key, str(value["path"]), folder)}
    return value


def _resolve_one(key: str, value: str, folder: Path) -> str:
    path = Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    candidate = folder / path
    if key == "model" and not candidate.exists():
        return value  # a catalog name, not a path
    if key in ("data", "eval_data") and not candidate.exists():
        from memfit.train.data.sources import looks_like_dataset_id

        if looks_like_dataset_id(value):
            return value  # a Hub dataset id, not a path
    return str(candidate)


def validate_config(data: dict[str, Any], source: str | None = None) -> TrainConfig:
    """Validate a dict of settings; raise one :class:`ConfigError` listing every problem."""
    problems: list[str] = []
    fields = set(TrainConfig.model_fields)
    clean = {}
    for key, value in data.items():
        if key == "trust_remote_code" and key not in fields:
            if value:
                problems.append(
                    "trust_remote_code: memfit does not run Python code from model repos (trusting it would execute the "
                    "repo's code on this machine with your permissions); use a model whose architecture transformers ships."
                )
            continue  # false: what memfit does anyway
        if key not in fields:
            close = (
                [OTHER_NAMES[key]]
                if key in OTHER_NAMES
                else difflib.get_close_matches(key, sorted(fields), n=1, cutoff=0.6)
            )
            hint = f" Did you mean {close[0]!r}?" if close else ""
            problems.append(f"{key}: unknown setting.{hint}")
        else:
            clean[key] = value
    # YAML reads a bare on/off as a boolean.
    if isinstance(clean.get("checkpointing"), bool):
        clean["checkpointing"] = "on" if clean["checkpointing"] else "off"
    for required in ("model", "data"):
        if clean.get(required) in (None, "", []):
            problems.append(f"{required}: required (see docs/train.md)")
    for key in [k for k in specs.TRAINED_KNOBS if k in clean and specs.value_kind(k) == "bool"]:
        if not isinstance(clean[key], bool):  # make_spec reads a flag's text; a YAML file writes true or false
            problems.append(type_problem(key, clean.pop(key), "", "bool_type"))
    knobs = {
        k: ("none" if clean[k] is None and specs.default(k) is not None else clean[k])
        for k in specs.TRAINED_KNOBS
        if k in clean
    }
    prompt_cap = clean.get("max_prompt_length")
    if isinstance(prompt_cap, int) and not isinstance(prompt_cap, bool) and "seq_len" not in knobs:
        completion = knobs.get("max_completion_length", specs.default("max_completion_length"))
        if isinstance(completion, int) and prompt_cap > 0:
            knobs["seq_len"] = prompt_cap + completion  # TRL's two lengths: the sequence is the sum
    knobs_valid = False
    try:
        spec = make_spec(spelling="field", **knobs)
    except SpecError as err:
        problems.extend(err.problems)
    else:
        # The config holds the knobs as make_spec converted them (a flag's "2" is the number 2), so
        # that every later use of config.gpus or config.batch_size sees the type it was checked as.
        clean.update({k: getattr(spec, k) for k in knobs})
        if spec.is_grpo and "batch_size" not in knobs:
            clean["batch_size"] = spec.batch_size  # grpo's default: whole groups of completions (make_spec)
        range_problems = _size_problems({k: clean[k] for k in knobs if specs.value_kind(k) == "int"})
        problems.extend(range_problems)
        knobs_valid = not range_problems
    config = None
    try:
        config = TrainConfig(**clean)
    except ValidationError as err:
        for item in err.errors():
            loc = ".".join(str(p) for p in item.get("loc", ()))
            if item.get("type") == "missing":
                continue  # reported above
            if item.get("loc", ("",))[0] in specs.TRAINED_KNOBS:
                continue  # make_spec above names the knob and its allowed values better
            if item.get("loc", ("",))[0] in ("data", "eval_data") and item.get("type") == "value_error":
                problems.extend(
                    str(item.get("msg")).removeprefix("Value error, ").splitlines()
                )  # each names its source
                continue
            problems.append(
                type_problem(
                    loc, item.get("input"), str(item.get("msg")).removeprefix("Value error, "), item.get("type", "")
                )
            )
    if config is not None:
        problems.extend(_size_problems({k: getattr(config, k) for k in COUNT_FIELDS}))
        problems.extend(_semantic_problems(config, knobs_valid=knobs_valid))
        problems.extend(_output_problems(config, source))
    if problems:
        raise ConfigError(problems, source)
    assert config is not None
    return config


#: The largest whole number a training run takes in any field: PyTorch's sizes and indices, and the
#: seeds of its generators, are 64-bit (a larger one fails deep inside the run, e.g.
#: ``batch_size: 1.0e+20``).
MAX_WHOLE_NUMBER = 2**63 - 1


def _size_problems(values: dict[str, Any]) -> list[str]:
    """Whole numbers beyond what the run can take, one line each naming the field."""
    return [
        f"{name}: {value} is beyond the largest whole number a run takes (2**63 - 1: PyTorch's sizes "
        f"are 64-bit); give the {name} you mean"
        for name, value in values.items()
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_WHOLE_NUMBER
    ]


def _semantic_problems(c: TrainConfig, *, knobs_valid: bool = True) -> list[str]:
    """Problems of values that are each well-typed but do not make sense (cheap: no file reading
    beyond existence checks). ``knobs_valid``: the knobs passed make_spec (the checks of knob
    combinations need their values converted; a bad knob was reported already)."""
    problems = []
    if c.epochs is not None and not (c.epochs > 0 and math.isfinite(c.epochs)):
        problems.append(f"epochs: {c.epochs!r} must be more than 0 (e.g. epochs: 1)")
    if c.max_steps is not None and c.max_steps < 1:
        problems.append(f"max_steps: {c.max_steps!r} must be 1 or more")
    if not (c.lr > 0 and math.isfinite(c.lr)):
        problems.append(f"lr: {c.lr!r} must be a positive number (e.g. lr: 2e-4)")
    if c.weight_decay < 0:
        problems.append(f"weight_decay: {c.weight_decay!r} must be 0 or more")
    if c.warmup_steps is not None and c.warmup_ratio is not None:
        problems.append("warmup_steps and warmup_ratio: set one of them, not both")
    if c.warmup_steps is not None and c.warmup_steps < 0:
        problems.append(f"warmup_steps: {c.warmup_steps!r} must be 0 or more")
    if c.warmup_ratio is not None and not 0 <= c.warmup_ratio < 1:
        problems.append(f"warmup_ratio: {c.warmup_ratio!r} must be in [0, 1)")
    if not 0 <= c.min_lr_ratio <= 1:
        problems.append(f"min_lr_ratio: {c.min_lr_ratio!r} must be in [0, 1]")
    if knobs_valid:
        problems.extend(_multi_gpu_problems(c))
        problems.extend(_fit_problems(c))
    if c.objective in specs.choices("objective"):
        # beta is a knob: make_spec checked it already (for the objective it is given to).
        problems.extend(objective_problems(c.objective, c.objective_params, c.model_fields_set, check_beta=False))
    problems.extend(_grpo_problems(c))
    from memfit.train.trackers import report_to_problems

    problems.extend(report_to_problems(c.report_to))
    if not 0 <= c.eval_split < 1:
        problems.append(f"eval_split: {c.eval_split!r} must be a fraction in [0, 1) (e.g. eval_split: 0.05)")
    if c.eval_split > 0 and c.eval_data is not None:
        problems.append("eval_split and eval_data: use one of them, not both")
    problems.extend(_data_problems(c))
    problems.extend(_eval_prompt_problems(c))
    for name in ("eval_every", "save_every", "log_every", "keep_checkpoints"):
        value = getattr(c, name)
        low = 1 if name in ("log_every", "keep_checkpoints") else 0
        if value < low:
            problems.append(f"{name}: {value!r} must be {low} or more")
    problems.extend(_model_problems(c))
    for name in ("tokenizer",):
        value = getattr(c, name)
        if value is not None and not Path(value).is_dir():
            problems.append(f"{name}: {value!r} is not a folder (a tokenizer folder holds tokenizer.json)")
    if c.device.strip().lower() not in ("auto", "cpu", "cuda") and not c.device.strip().lower().startswith("cuda:"):
        problems.append(f"device: {c.device!r} is not one of auto, cpu, cuda, cuda:N")
    if c.budget is not None:
        from memfit.units import parse_bytes

        try:
            if parse_bytes(c.budget) <= 0:
                raise ValueError("must be more than 0 bytes")
        except ValueError as err:
            problems.append(f"budget: {c.budget!r}: {err} (e.g. budget: 24GiB)")
    if c.gpu is not None:
        from memfit.models.gpus import get_gpu

        try:
            get_gpu(c.gpu)
        except ValueError as err:
            problems.append(f"gpu: {err}")
    return problems


def _grpo_problems(c: TrainConfig) -> list[str]:
    """What grpo needs of a training config (its rewards, its lengths, its data) and what it rules out."""
    from memfit.train.rewards import spec_problems

    if c.objective != "grpo":
        given = [f for f in ("reward_funcs", "reward_weights", "max_prompt_length") if getattr(c, f) not in (None, [])]
        return [
            f"{f}: applies to objective: grpo, and this run's objective is {c.objective}. Remove {f}, or set objective: grpo."
            for f in given
        ]
    problems = []
    if not c.reward_funcs:
        problems.append(
            "reward_funcs: objective: grpo needs reward functions: e.g. reward_funcs: [rewards.py:my_reward] "
            "(file.py:function, package.module:function, or a built-in: think_format, length; docs/grpo.md)"
        )
    problems.extend(spec_problems(c.reward_funcs, c.reward_weights))
    if c.max_prompt_length is not None:
        if c.max_prompt_length < 1:
            problems.append(
                f"max_prompt_length: {c.max_prompt_length!r} must be 1 or more (e.g. max_prompt_length: 512)"
            )
        elif (
            isinstance(c.seq_len, int)
            and isinstance(c.max_completion_length, int)
            and c.max_prompt_length + c.max_completion_length > c.seq_len
        ):
            problems.append(
                f"max_prompt_length: {c.max_prompt_length} + max_completion_length: {c.max_completion_length} is "
                f"more than seq_len: {c.seq_len}: drop seq_len (it is then their sum), or lower one of them"
            )
    if c.eval_split > 0 or c.eval_data is not None:
        problems.append(
            "eval_split / eval_data: objective: grpo has no evaluation loss (its loss needs completions and "
            "rewards); drop them (eval_prompts still shows greedy replies)"
        )
    if c.streaming:
        problems.append("streaming: true with objective: grpo: its prompts are read in memory. Remove streaming.")
    if c.data_format not in ("auto", "prompt"):
        problems.append(
            f"data_format: {c.data_format!r} with objective: grpo, which reads every source as prompts "
            "(data_format: prompt, or auto)"
        )
    return problems


def _output_problems(c: TrainConfig, source: str | None) -> list[str]:
    """``output_dir`` may not be one of the run's inputs: the config file, the model or tokenizer
    folder, a local data source."""
    from memfit.files import input_clash
    from memfit.train.data.sources import as_sources, field_name

    if c.output_dir is None:
        return []
    inputs: dict[str, Any] = {
        "config file": source,
        "model folder": c.model if Path(c.model).exists() else None,
        "tokenizer folder": c.tokenizer,
    }
    for field in ("data", "eval_data"):
        sources = as_sources(getattr(c, field) or [])
        inputs.update(
            {f"{field_name(field, i, len(sources))} source": s.path for i, s in enumerate(sources) if not s.is_hub}
        )
    clash = input_clash(c.output_dir, "output_dir", inputs)
    return [clash] if clash else []


def _model_problems(c: TrainConfig) -> list[str]:
    """What is wrong with ``model``, ``revision`` and ``model_overrides``: a model that is not there,
    a seq_len beyond its positions, overrides transformers refuses (a Hub model's config is checked
    once it is fetched)."""
    from memfit.models.catalog import resolve_model
    from memfit.models.hub import is_hub_id

    problems: list[str] = []
    hub = is_hub_id(c.model)  # fetched once validation passed (pretrained) or now, config only (random)
    if c.revision is not None and not hub:
        problems.append(
            f"revision: {c.revision!r} applies only to a Hugging Face Hub model (model: org/name); "
            f"{c.model!r} is a local path or a catalog name. Remove revision."
        )
    model = None  # the model's config when it is on this machine (a Hub model's is checked once fetched)
    if c.init == "pretrained":
        folder = Path(c.model)
        if not folder.is_dir() and not hub:
            problems.append(
                f"model: {c.model!r} is not a local model folder or a Hugging Face Hub id (org/name). Pretrained weights "
                "are read from a folder with config.json and *.safetensors, or downloaded from the Hub; for a catalog "
                "name or a config.json add init: random."
            )
        elif folder.is_dir():
            try:
                model = resolve_model(c.model)
            except ValueError as err:
                problems.append(f"model: {err}")
        if c.model_overrides:
            problems.append("model_overrides: only with init: random (pretrained weights fix the architecture)")
    elif c.revision is None or hub:
        try:
            model = resolve_model(c.model, revision=c.revision)
        except ValueError as err:
            problems.append(f"model: {err}")
    if model is not None:
        seq_len = None if _size_problems({"seq_len": c.seq_len}) else c.seq_len  # too large: reported once, above
        found = model_problems(model.name, dict(model.config, **c.model_overrides), seq_len)
        problems.extend(found)
        if c.model_overrides and not any(p.startswith("model: ") for p in found):
            from memfit.train.overrides import override_problems

            problems.extend(override_problems(model.config, c.model_overrides))
    return problems


def model_problems(name: str, model_config: dict[str, Any], seq_len: Any) -> list[str]:
    """What the model's config rules out: an architecture transformers cannot build, a ``seq_len``
    beyond its positions (the messages ``memfit plan`` gives, spelled as YAML fields)."""
    from memfit.models.catalog import model_type_problem, seq_len_problem

    problem = model_type_problem(model_config)
    if problem:
        return [f"model: {problem}"]
    try:
        tokens = int(seq_len)  # the YAML's number, or a flag's text; make_spec reports a bad one
    except (TypeError, ValueError):
        return []
    too_long = seq_len_problem(name, model_config, tokens, spelling="field")
    return [too_long] if too_long else []


def _data_problems(c: TrainConfig) -> list[str]:
    """What is wrong with the data settings, found without reading any data (local paths must
    exist; a Hub dataset is asked about when the run starts)."""
    from memfit.train.data.sources import source_problems

    problems = source_problems("data", c.data, mixing=True) + source_problems("eval_data", c.eval_data, mixing=False)
    if c.streaming and c.max_steps is None:
        problems.append(
            "streaming: true needs max_steps: a stream has no length to count epochs in. Add max_steps: N "
            "(optimizer steps)."
        )
    if c.streaming and c.objective in specs.PREFERENCE_OBJECTIVES:
        problems.append(
            f"streaming: true with objective: {c.objective}: preference pairs are read in memory (their "
            "longest pair sets the plan, and precompute_reference reads them twice). Remove streaming."
        )
    if c.streaming and c.eval_split > 0:
        problems.append(
            f"eval_split: {c.eval_split!r} with streaming: true: a stream's length is not known, so it cannot be "
            "split. Give eval_data instead (e.g. eval_data: {path: org/name, split: test})."
        )
    if c.shuffle_buffer_size < 0:
        problems.append(f"shuffle_buffer_size: {c.shuffle_buffer_size!r} must be 0 or more (0: the stream's order)")
    return problems


def _eval_prompt_problems(c: TrainConfig) -> list[str]:
    """What ``eval_prompts`` and ``eval_max_new_tokens`` cannot be."""
    problems = [
        f"eval_prompts[{index}]: {problem}"
        for index, prompt in enumerate(c.eval_prompts)
        if (problem := prompt_problem(prompt))
    ]
    if c.eval_max_new_tokens < 1:
        problems.append(
            f"eval_max_new_tokens: {c.eval_max_new_tokens!r} must be 1 or more (e.g. eval_max_new_tokens: 64)"
        )
    if c.eval_prompts and c.gpus > 1:
        problems.append(
            f"eval_prompts with gpus: {c.gpus}: replies are generated by one process. Remove eval_prompts and "
            "ask the finished run with memfit generate RUN_DIR --prompts FILE."
        )
    return problems


def _fit_problems(c: TrainConfig) -> list[str]:
    """What ``fit: auto`` cannot do (the search itself runs at the start of the run)."""
    problems = []
    if c.fit == "auto" and c.gpus > 1:
        problems.append(
            f"fit: auto chooses for one process, not gpus: {c.gpus}. Use fit: off, or memfit fit --gpus {c.gpus} --write."
        )
    if c.fit_optimizer and c.fit != "auto":
        problems.append(
            "fit_optimizer: true only means something with fit: auto. Add fit: auto, or drop fit_optimizer."
        )
    return problems


def _multi_gpu_problems(c: TrainConfig) -> list[str]:
    """What memfit train cannot do on several GPUs (the planner may still plan it)."""
    if c.shard == "zero1":
        return [
            "shard: 'zero1' (optimizer states sharded, weights and gradients whole) is not trained by memfit; "
            "use zero2 (weights gathered from forward to backward, the rest sharded) or zero3 / fsdp."
        ]
    if c.gpus < 2:
        return []  # RunSpec refuses a shard without gpus >= 2
    problems = []
    if c.shard == "none":
        problems.append(
            f"shard: 'none' with gpus: {c.gpus}: say how the {c.gpus} processes split the model: ddp (each holds "
            f"everything), zero2, zero3 (= fsdp) or fsdp-offload; e.g. shard: fsdp (--shard fsdp), and start one "
            f"process per GPU: memfit train CONFIG --nproc {c.gpus} (or torchrun --nproc-per-node {c.gpus} -m memfit "
            "train CONFIG). For one process, set gpus: 1."
        )
    if c.precision in ("fp16", "fp16-mixed"):
        problems.append(
            f"precision: {c.precision!r} with gpus: {c.gpus}: fp16's loss scaling is not synchronised across processes. "
            f"Use precision: {c.precision.replace('fp16', 'bf16')} (or fp32)."
        )
    if c.step_in_backward:
        problems.append(
            f"step_in_backward: true with gpus: {c.gpus}: sharded gradients are complete only after their "
            "reduction, not when autograd makes them. Set step_in_backward: false."
        )
    if c.device.strip().lower().startswith("cuda:"):
        problems.append(
            f"device: {c.device!r} with gpus: {c.gpus}: each process takes the GPU of its LOCAL_RANK; use device: auto or cuda."
        )
    # The sharded trainer keeps 4-bit weights outside FSDP; int8 weights, DoRA's magnitudes and the
    # copies of modules_to_save have no such path yet (the planner still plans them per GPU).
    one_process = [
        text
        for on, text in (
            (c.method == "lora-8bit", "method: lora-8bit"),
            (c.dora, "dora: true"),
            (bool(c.modules_to_save), "modules_to_save"),
        )
        if on
    ]
    if one_process:
        problems.append(
            f"{', '.join(one_process)} with gpus: {c.gpus}: memfit train runs {'these' if len(one_process) > 1 else 'this'} "
            "on one process; set gpus: 1 (memfit plan --gpus still plans it per GPU)."
        )
    return problems


# ------------------------------------------------------------------------------------------------
# Derived values (pure)


def model_config_dict(config: TrainConfig) -> dict[str, Any]:
    """The model's config dict (config.json) with ``model_overrides`` applied."""
    from memfit.models.catalog import resolve_model

    data = dict(resolve_model(config.model, revision=config.revision).config)
    data.update(config.model_overrides)
    return data


def demo_dataset_path() -> Path:
    """The demo dataset shipped inside the package (``tiny-instruct.jsonl``: 320 short chat
    records, made by scripts/make_tiny_dataset.py); what ``memfit fit --write`` trains on when no
    --data is given, so it must be the installed copy, not one beside a source checkout."""
    from importlib import resources

    path = Path(str(resources.files("memfit") / "assets" / "data" / "tiny-instruct.jsonl"))
    if not path.is_file():
        raise ConfigError([f"data: the demo dataset is missing from {path}; reinstall memfit, or pass --data"])
    return path


def tokenizer_path(config: TrainConfig) -> Path:
    """Where the tokenizer is read from (see :attr:`TrainConfig.tokenizer`)."""
    if config.tokenizer is not None:
        return Path(config.tokenizer)
    if config.init == "pretrained":
        return Path(config.model)
    from memfit.train.data import tiny_tokenizer_path

    return tiny_tokenizer_path()


def total_steps(config: TrainConfig, batches_per_epoch: int | None) -> int:
    """Optimizer steps of the run: ``max_steps``, or ``epochs`` x steps per epoch (rounded up).
    ``batches_per_epoch`` None: the data is a stream, whose run counts ``max_steps`` alone."""
    if config.max_steps is not None:
        return config.max_steps
    if batches_per_epoch is None:
        raise ConfigError(["streaming: true needs max_steps: a stream has no length to count epochs in"])
    epochs = config.epochs if config.epochs is not None else 1.0
    return max(1, math.ceil(epochs * batches_per_epoch / config.grad_accum))


def warmup_steps(config: TrainConfig, steps: int) -> int:
    """Warmup steps in effect for a run of ``steps`` optimizer steps."""
    if config.warmup_steps is not None:
        return min(config.warmup_steps, steps)
    if config.warmup_ratio is not None:
        return int(config.warmup_ratio * steps)
    return 0


def lr_factor(step: int, *, total: int, warmup: int, schedule: str, min_ratio: float = 0.0) -> float:
    """Multiplier of the base lr for optimizer step ``step`` (0-based): linear warmup from 0 over
    ``warmup`` steps, then cosine / linear decay to ``min_ratio`` at ``total``, or constant."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    if schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape


# ------------------------------------------------------------------------------------------------
# Writing


def write_config(values: dict[str, Any], path: str | Path, *, header: str = "", overwrite: bool = False) -> TrainConfig:
    """Validate ``values`` as a train config and write them to ``path`` as YAML, or as JSON when its
    name ends in ``.json`` (which ``memfit train`` reads as well: JSON is YAML; the ``header`` of
    comments is left out there, JSON has none).

    The file is written to a temporary name and renamed, so a reader never sees half a file; an
    existing file is kept unless ``overwrite``. Relative paths in ``values`` are written as given
    (``memfit train`` resolves them against the YAML's folder). Returns the validated config.
    """
    import json

    import yaml

    from memfit.files import file_format, write_atomic

    path = Path(path)
    if path.exists() and not overwrite:
        raise ConfigError([f"{path} exists; choose another file name or pass --overwrite"])
    folder = path.resolve().parent
    checked = validate_config(_resolve_paths(dict(values), folder), source=str(path))
    if file_format(path, "yaml") == "json":
        text = json.dumps(values, indent=2) + "\n"
    else:
        text = header + yaml.safe_dump(values, sort_keys=False, default_flow_style=False)
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text)
    return checked
