"""The model a config is planned on: the config's own, or ``--model``; and a PEFT adapter named as it.

A recipe may name an adapter repository where a model goes (``model_name_or_path:
org/zephyr-7b-sft-qlora``: ``adapter_config.json``, its base in ``base_model_name_or_path``), as
the alignment-handbook's DPO recipes do on top of their SFT adapters. transformers'
``from_pretrained`` loads such a repository as its base with the adapter on it, and the recipe
trains on. memfit plans the base model, and takes the adapter's settings (rank, alpha, dropout,
targets, DoRA, rsLoRA, modules_to_save) as the method's wherever the config names none of its own
(:func:`adapter_knob`); the plan says so (:attr:`ModelChoice.adapter`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.json_form import JsonForm
from memfit.models.catalog import PeftAdapter, peft_adapter

#: PEFT's LoraConfig defaults, where an adapter_config.json leaves a field out.
_PEFT_DEFAULTS = {"r": 8, "lora_alpha": 8, "lora_dropout": 0.0, "use_dora": False, "use_rslora": False}

#: memfit knob -> the adapter_config.json field it comes from.
ADAPTER_FIELDS = {
    "rank": "r",
    "alpha": "lora_alpha",
    "dropout": "lora_dropout",
    "targets": "target_modules",
    "dora": "use_dora",
    "rslora": "use_rslora",
    "modules_to_save": "modules_to_save",
}


@dataclass
class ModelChoice(JsonForm):
    """The model a config is planned on, and where it came from.

    ``given``: the model ``--model`` put in place of the config's (``replaced``: the config's own).
    ``adapter``: the PEFT adapter named as the model, whose base ``model`` is."""

    model: str | None
    revision: str | None
    given: bool = False
    replaced: str | None = None
    adapter: PeftAdapter | None = None
    from_adapter: tuple[str, ...] = ()  # the knobs taken from the adapter's settings

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"given_model": self.given, "replaced": self.replaced}
        if self.adapter is not None:
            out["adapter"] = {
                "name": self.adapter.name,
                "base": self.adapter.base,
                "hub": self.adapter.hub,
                "settings": {
                    k: self.adapter.config.get(f) for k, f in ADAPTER_FIELDS.items() if f in self.adapter.config
                },
                "taken": list(self.from_adapter),
            }
        return out


def given_model(value: str) -> str:
    """``--model``'s value: a path relative to the working directory (made absolute), else as typed (a
    catalog name or a Hub id)."""
    text = str(value).strip()
    path = Path(text).expanduser()
    return str(path.resolve()) if path.exists() else text


def choose_model(model: str | None, revision: str | None, given: str | None) -> ModelChoice:
    """The model to plan: ``given`` (``--model``) in place of the config's ``model`` (whose
    ``revision`` then no longer applies), and, when that names a PEFT adapter, its base.

    Raises ``ValueError`` (a line for the user) for an adapter whose base cannot be told."""
    choice = ModelChoice(model, revision)
    if given is not None and str(given).strip():
        choice = ModelChoice(given_model(given), None, given=True, replaced=model)
    if not choice.model:
        return choice
    adapter = peft_adapter(choice.model, choice.revision)
    if adapter is None:
        return choice
    if adapter.base is None:
        raise ValueError(
            f"{adapter.name!r} is a PEFT adapter (adapter_config.json) that names no base_model_name_or_path: "
            "name its base model there, or plan the base model with --model"
        )
    choice.adapter, choice.model, choice.revision = adapter, adapter.base, adapter.base_revision
    return choice


def adapter_knob(adapter: PeftAdapter, knob: str) -> Any:
    """The value of memfit ``knob`` the adapter's settings give (None: the adapter has nothing to say
    about it). ``method``: LoRA, which the adapter is (its quantization is the config's)."""
    from memfit.spec import ALL_LINEAR

    if knob == "method":
        return "lora"
    field = ADAPTER_FIELDS.get(knob)
    if field is None:
        return None
    value = adapter.config.get(field, _PEFT_DEFAULTS.get(field))
    if knob == "targets":
        if isinstance(value, str):
            return (ALL_LINEAR,) if value.strip().lower() in ("all-linear", "all_linear") else None
        return tuple(str(v) for v in value) if isinstance(value, (list, tuple)) and value else None
    if knob == "modules_to_save":
        return tuple(str(v) for v in value) if isinstance(value, (list, tuple)) and value else None
    return value


def is_lora(adapter: PeftAdapter) -> bool:
    """Whether the adapter is LoRA (DoRA and rsLoRA are LoRA's options), the kind memfit plans."""
    return str(adapter.config.get("peft_type", "LORA")).upper() == "LORA"
