"""``memfit.interop``: plan and fit the configs people already have.

Axolotl YAMLs, LLaMA-Factory YAMLs, and YAML or JSON files of Hugging Face ``TrainingArguments``
with TRL's arguments are read into a model, RunSpec knobs and what memfit does not model
(:func:`read_tool_config`); the DeepSpeed JSON or FSDP settings they name are read too. Each
tool's keys are a declarative table (:mod:`memfit.interop.axolotl`,
:mod:`~memfit.interop.llamafactory`, :mod:`~memfit.interop.hf`), from which ``docs/interop.md``
is generated. ``memfit fit CONFIG --write OUT`` writes the same tool's config back with only the
memory keys changed (:mod:`memfit.interop.writing`).

Above :mod:`memfit.spec` and :mod:`memfit.models`, below the planner.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memfit.interop import axolotl, hf, llamafactory
from memfit.interop.keys import KeyMap
from memfit.interop.reading import (
    ToolConfig,
    ToolConfigError,
    is_memfit_config as _is_memfit,
    read_tool_config as _read,
)

#: The tools whose configs memfit reads, in the order they are told apart.
TOOLS: tuple[KeyMap, ...] = (axolotl.KEYMAP, llamafactory.KEYMAP, hf.KEYMAP)

_SUFFIXES = (".yaml", ".yml", ".json")


def is_tool_config(model: Any) -> bool:
    """Whether ``model`` (what ``memfit plan`` was given) names another tool's config file: a YAML,
    or a JSON that is not a model's config.json (one with ``model_type`` or ``architectures``)."""
    if not isinstance(model, (str, Path)):
        return False
    path = Path(model).expanduser()
    try:
        if path.suffix.lower() not in _SUFFIXES or not path.is_file():
            return False
    except OSError:  # a name longer than the file system takes: no file, and resolving the model says so
        return False
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return False  # not JSON at all: resolving it as a model's config.json says what is wrong
        return isinstance(data, dict) and not ("model_type" in data or "architectures" in data)
    return True


def is_memfit_config(raw: Any) -> bool:
    """Whether the mapping ``raw`` (a YAML read) is memfit's own training config, not another tool's:
    its model is named by ``model``, and by none of the tools' keys for it."""
    return isinstance(raw, dict) and _is_memfit(raw, TOOLS)


def read_tool_config(path: str | Path, *, model: str | None = None) -> ToolConfig:
    """Read an Axolotl, LLaMA-Factory or TRL / TrainingArguments config (see :mod:`memfit.interop`);
    ``model``: the model to plan in place of the config's (``--model``)."""
    return _read(path, TOOLS, model=model)


__all__ = ["TOOLS", "ToolConfig", "ToolConfigError", "is_memfit_config", "is_tool_config", "read_tool_config"]
