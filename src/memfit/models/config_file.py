"""Read a model's ``config.json`` from disk, checked: the one reader of local and Hub configs alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memfit.models.errors import ModelNotFoundError


def read_config_file(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, with a ``model_type``; raise :class:`ModelNotFoundError` saying what is wrong and the fix."""
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
            'Add it (e.g. "model_type": "llama") or use the model\'s original config.json.'
        )
    return data
