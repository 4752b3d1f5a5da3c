"""One validated description of a fine-tuning run: every knob the planner and the trainer share.

``RunSpec`` is the single place that knows the knobs, their defaults and what values are allowed.
Bad values are all collected and raised at once as a :class:`SpecError` whose lines name the
field, the value and the fix, before anything expensive runs.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

Method = Literal["full", "lora", "qlora"]
Precision = Literal["bf16", "fp16", "fp32"]
OptimizerName = Literal["adamw", "adamw8bit", "paged-adamw8bit", "sgd"]
Checkpointing = Literal["off", "on", "offload"]
Shard = Literal["none", "ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp-offload"]
Tiling = Literal["auto", "on", "off"]
Recipe = Literal["memfit", "hf"]

#: ``--tiling auto`` tiles the MLP from this many tokens a micro-batch: below it the MLP's
#: intermediates are small next to the rest of the step, and tiling would only add recomputation.
TILING_AUTO_TOKENS = 8192

#: ``--targets all-linear`` means every linear layer inside the decoder blocks (not the output head).
ALL_LINEAR = "all-linear"

_CHOICES: dict[str, tuple[str, ...]] = {
    "method": ("full", "lora", "qlora"),
    "precision": ("bf16", "fp16", "fp32"),
    "optimizer": ("adamw", "adamw8bit", "paged-adamw8bit", "sgd"),
    "checkpointing": ("off", "on", "offload"),
    "shard": ("none", "ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp-offload"),
    "tiling": ("auto", "on", "off"),
    "recipe": ("memfit", "hf"),
}

# How a field is spelled on the command line, for error messages.
_FLAG = {name: "--" + name.replace("_", "-") for name in (
    "method", "rank", "alpha", "dropout", "targets", "precision", "optimizer", "batch_size",
    "seq_len", "grad_accum", "checkpointing", "gpus", "shard", "tiling", "step_in_backward", "recipe",
)}


class SpecError(ValueError):
    """One or more bad knobs. ``problems`` holds one line per problem, each naming field, value and fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid run configuration:\n" + "\n".join(f"  - {p}" for p in problems))


class RunSpec(BaseModel):
    """The knobs of a fine-tuning run that decide its memory.

    Sizes are per GPU: ``batch_size`` is the micro-batch one GPU processes in one forward pass;
    ``grad_accum`` micro-batches make one optimizer step.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Method = "lora"
    rank: int = Field(16, description="LoRA rank r (lora, qlora)")
    alpha: float | None = Field(None, description="LoRA alpha; default 2 x rank")
    dropout: float = Field(0.0, description="LoRA dropout probability")
    targets: tuple[str, ...] = Field((ALL_LINEAR,), description="module names LoRA attaches to")
    precision: Precision = "bf16"
    optimizer: OptimizerName = "adamw"
    batch_size: int = 1
    seq_len: int = 2048
    grad_accum: int = 1
    checkpointing: Checkpointing = "on"
    gpus: int = 1
    shard: Shard = "none"
    tiling: Tiling = Field("auto", description="sequence-tiled MLP: auto (on from TILING_AUTO_TOKENS tokens a micro-batch), on, off")
    step_in_backward: bool = Field(False, description="full fine-tuning: each parameter's optimizer step runs in backward")
    recipe: Recipe = Field("memfit", description="memfit: memfit's step; hf: the plain Hugging Face + PEFT step (planner only)")

    @field_validator("targets", mode="before")
    @classmethod
    def _split_targets(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _check_combinations(self) -> "RunSpec":
        problems = []
        if self.method == "qlora" and self.precision == "fp32":
            problems.append(
                "--precision: fp32 cannot be used with --method qlora: 4-bit weights are dequantized "
                "to a 16-bit compute dtype. Use --precision bf16 (or fp16 on cards without bf16)."
            )
        if self.method == "full" and self.precision == "fp16":
            problems.append(
                "--precision: fp16 is not supported for --method full: pure fp16 weights and "
                "optimizer states overflow and underflow. Use --precision bf16 or fp32."
            )
        if self.step_in_backward and self.method != "full":
            problems.append(
                f"--step-in-backward: only for --method full (got --method {self.method}): adapters' "
                "gradients are small, there is nothing to save. Drop --step-in-backward."
            )
        if self.step_in_backward and self.grad_accum != 1:
            problems.append(
                f"--step-in-backward: needs --grad-accum 1 (got {self.grad_accum}): each parameter is "
                "updated as soon as its gradient exists, so gradients cannot accumulate over micro-batches."
            )
        if self.step_in_backward and self.recipe == "hf":
            problems.append("--step-in-backward: the hf recipe has no optimizer step in backward. Use --recipe memfit.")
        if self.shard != "none" and self.gpus < 2:
            problems.append(f"--shard: {self.shard} needs --gpus 2 or more (got --gpus {self.gpus}).")
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @property
    def lora_alpha(self) -> float:
        """LoRA alpha in effect (2 x rank unless set)."""
        return float(self.alpha) if self.alpha is not None else 2.0 * self.rank

    @property
    def uses_adapters(self) -> bool:
        return self.method in ("lora", "qlora")

    @property
    def tiles_sequence(self) -> bool:
        """Whether the decoder MLPs and norms run over chunks of the sequence (``tiling`` resolved)."""
        return tiles_sequence(self.tiling, self.recipe, self.batch_size * self.seq_len)

    def knobs(self) -> dict[str, Any]:
        """Every knob with its resolved value, as plain JSON types."""
        data = self.model_dump()
        data["targets"] = list(self.targets)
        data["alpha"] = self.lora_alpha
        return data


def tiles_sequence(tiling: str, recipe: str, tokens: int) -> bool:
    """``--tiling`` resolved for a micro-batch of ``tokens`` tokens (the hf recipe never tiles)."""
    if recipe == "hf" or tiling == "off":
        return False
    return tiling == "on" or tokens >= TILING_AUTO_TOKENS


_POSITIVE_INT_FIELDS = ("rank", "batch_size", "seq_len", "grad_accum", "gpus")


def make_spec(**knobs: Any) -> RunSpec:
    """Build a :class:`RunSpec` from keyword knobs, or raise :class:`SpecError` listing every problem.

    Unknown knob names get a "did you mean" suggestion; ``None`` values mean "use the default".
    """
    problems: list[str] = []
    clean: dict[str, Any] = {}
    fields = set(RunSpec.model_fields)
    for name, value in knobs.items():
        if value is None:
            continue
        key = name.replace("-", "_")
        if key not in fields:
            close = difflib.get_close_matches(key, sorted(fields), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else f" Known knobs: {', '.join(sorted(fields))}."
            problems.append(f"unknown knob {name!r}.{hint}")
            continue
        if key in _CHOICES and isinstance(value, str):
            value = value.strip().lower()
            if value not in _CHOICES[key]:
                close = difflib.get_close_matches(value, _CHOICES[key], n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                problems.append(f"{_FLAG[key]}: {value!r} is not one of {', '.join(_CHOICES[key])}.{hint}")
                continue
        if key in _POSITIVE_INT_FIELDS:
            if isinstance(value, bool) or not _is_int_like(value):
                problems.append(f"{_FLAG[key]}: {value!r} is not a whole number. Use e.g. {_FLAG[key]} {_EXAMPLE[key]}.")
                continue
            value = int(value)
            if value < 1:
                problems.append(f"{_FLAG[key]}: {value} must be 1 or more (e.g. {_FLAG[key]} {_EXAMPLE[key]}).")
                continue
        if key == "alpha" and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
            problems.append(f"--alpha: {value!r} must be a positive number (e.g. --alpha 32).")
            continue
        if key == "dropout" and (not isinstance(value, (int, float)) or not 0.0 <= float(value) < 1.0):
            problems.append(f"--dropout: {value!r} must be in [0, 1) (e.g. --dropout 0.05).")
            continue
        clean[key] = value
    if problems:
        raise SpecError(problems)
    try:
        return RunSpec(**clean)
    except ValidationError as err:
        raise SpecError(_pydantic_problems(err)) from None


_EXAMPLE = {"rank": 16, "batch_size": 4, "seq_len": 2048, "grad_accum": 8, "gpus": 2}


def _is_int_like(value: Any) -> bool:
    if isinstance(value, int):
        return True
    if isinstance(value, float):
        return value.is_integer()
    if isinstance(value, str):
        return value.strip().lstrip("-").isdigit()
    return False


def _pydantic_problems(err: ValidationError) -> list[str]:
    problems = []
    for item in err.errors():
        loc = [str(part) for part in item.get("loc", ()) if part != "__root__"]
        message = str(item.get("msg", "")).removeprefix("Value error, ")
        if loc:
            field = _FLAG.get(loc[0], loc[0])
            problems.append(f"{field}: {item.get('input')!r}: {message}")
        else:
            problems.extend(line for line in message.splitlines() if line)
    return problems
