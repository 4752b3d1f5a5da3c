"""The shipped model catalog, and turning a user's model argument into a config.

A model argument is one of: a catalog name (``llama-3.1-8b``), a path to a ``config.json``, or a
local Hugging Face model folder that holds one. The catalog files are the ``config.json`` files the
model authors publish with their weights; ``SOURCES.md`` beside them says where each came from.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any


class ModelNotFoundError(ValueError):
    """The model argument is neither a catalog name nor a readable config."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved model argument: its display name, its config dict and where it came from."""

    name: str
    config: dict[str, Any]
    origin: str  # "catalog", "config.json" or "folder"
    path: Path | None = None  # the folder (for a local model) or config file


def _catalog_dir():
    return resources.files("memfit.models") / "catalog"


@lru_cache(maxsize=1)
def catalog_names() -> tuple[str, ...]:
    """Names of the shipped model configs, sorted."""
    return tuple(sorted(p.name[: -len(".json")] for p in _catalog_dir().iterdir() if p.name.endswith(".json")))


def load_catalog_config(name: str) -> dict[str, Any]:
    """The config dict of catalog model ``name`` (exact name)."""
    return json.loads((_catalog_dir() / f"{name}.json").read_text())


def _normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def resolve_model(model: str | Path | dict) -> ModelSource:
    """Resolve a catalog name, a config.json path or a model folder (or a config dict) to a ModelSource.

    Raises :class:`ModelNotFoundError` with a "did you mean" hint for unknown names, and with the
    file and the parser's message for an unreadable or invalid config.json.
    """
    if isinstance(model, dict):
        return ModelSource(name=str(model.get("_name_or_path") or model.get("model_type") or "custom"), config=dict(model), origin="dict")
    text = str(model)
    path = Path(text).expanduser()
    key = _normalise(text)
    if key in catalog_names() and not path.exists():
        return ModelSource(name=key, config=load_catalog_config(key), origin="catalog")
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ModelNotFoundError(
                f"model folder {str(path)!r} has no config.json. Point to a Hugging Face model folder "
                "(with config.json and *.safetensors), a config.json file, or a catalog name (see `memfit models`)."
            )
        return ModelSource(name=path.resolve().name, config=_read_config(config_path), origin="folder", path=path)
    if path.is_file():
        return ModelSource(name=_name_from_config_path(path), config=_read_config(path), origin="config.json", path=path)
    if any(sep in text for sep in ("/", "\\")) or text.endswith(".json"):
        raise ModelNotFoundError(f"model path {text!r} does not exist.")
    close = difflib.get_close_matches(key, catalog_names(), n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise ModelNotFoundError(
        f"unknown model {text!r}.{hint} Use a catalog name (`memfit models` lists them), a path to a "
        "config.json, or a local model folder."
    )


def _name_from_config_path(path: Path) -> str:
    return path.resolve().parent.name if path.name == "config.json" else path.stem


def _read_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except UnicodeDecodeError as err:
        raise ModelNotFoundError(f"{path}: not a text file ({err}). Expected a JSON config.json.") from None
    except json.JSONDecodeError as err:
        raise ModelNotFoundError(
            f"{path}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}). "
            "Fix the file or point to the model's original config.json."
        ) from None
    except OSError as err:
        raise ModelNotFoundError(f"{path}: cannot be read ({err.strerror}).") from None
    if not isinstance(data, dict):
        raise ModelNotFoundError(f"{path}: a config.json must hold a JSON object, got {type(data).__name__}.")
    if "model_type" not in data:
        raise ModelNotFoundError(
            f"{path}: no 'model_type' field, so transformers cannot tell which architecture to build. "
            "Add it (e.g. \"model_type\": \"llama\") or use the model's original config.json."
        )
    return data
