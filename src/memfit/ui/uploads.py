"""Files dropped on the page: a model's config.json, read as data and kept in memory by name.

The page plans by name (``model=upload-1a2b3c4d5e6f``): the server reads the dropped file once,
keeps the config under a name made from its content, and the plan and fit requests name it like a
catalog model. Nothing is written to disk and nothing is executed: the file is JSON, parsed as
data; no code that ships with a model (``trust_remote_code``) is ever run.

What a dropped file can be is decided by :data:`MODEL_READERS`, an ordered list of small readers
(as PEFT dispatches its backends): the first that recognises the file returns the config. Readers
of other tools' training configs (an Axolotl or LLaMA-Factory YAML) belong in this list; the page
then plans the model and knobs they name.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from memfit.errors import UserError

#: The largest file the page takes (a config.json is a few KiB; a run's memory.jsonl a few hundred).
MAX_UPLOAD_BYTES = 1 << 20
#: Dropped configs kept at once (the oldest is forgotten first).
MAX_KEPT = 64
_PREFIX = "upload-"


class UploadError(UserError, ValueError):
    """A dropped file the page cannot use; the message names the file and the fix."""


@dataclass(frozen=True)
class ModelUpload:
    """A model config dropped on the page: the name plans use, the config, the file's own name."""

    name: str
    config: dict[str, Any]
    filename: str


def is_upload_name(model: str) -> bool:
    """Whether ``model`` names a dropped config (``upload-`` and twelve hex digits)."""
    digits = model[len(_PREFIX):]
    return model.startswith(_PREFIX) and len(digits) == 12 and all(c in "0123456789abcdef" for c in digits)


def check_size(data: bytes, filename: str) -> None:
    """Refuse a file over :data:`MAX_UPLOAD_BYTES` (the body is read no further than that)."""
    if len(data) > MAX_UPLOAD_BYTES:
        raise UploadError(f"{filename}: more than {MAX_UPLOAD_BYTES // 2**20} MiB; the page takes files up to that size.")


def read_json_object(data: bytes, filename: str) -> dict[str, Any]:
    """``data`` parsed as one JSON object, or an :class:`UploadError` saying what it is instead."""
    try:
        value = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise UploadError(f"{filename}: not UTF-8 text (byte {err.start}); drop the model's config.json.") from None
    except ValueError as err:
        raise UploadError(f"{filename}: not valid JSON ({err}); drop the model's config.json.") from None
    if not isinstance(value, dict):
        raise UploadError(f"{filename}: holds a JSON {type(value).__name__}, not an object; drop the model's config.json.")
    return value


def config_json_reader(data: bytes, filename: str) -> dict[str, Any] | None:
    """A Hugging Face config.json: a JSON object with a ``model_type``."""
    if not filename.lower().endswith(".json"):
        return None
    config = read_json_object(data, filename)
    if "model_type" not in config:
        raise UploadError(
            f"{filename}: has no model_type, so it is not a model's config.json (e.g. \"model_type\": \"llama\"); "
            "drop the config.json from the model's folder or its Hub page."
        )
    return config


#: Readers tried in order; each returns the model config, None when the file is not its kind, or
#: raises :class:`UploadError` when it is its kind but broken.
MODEL_READERS: list[Callable[[bytes, str], dict[str, Any] | None]] = [config_json_reader]


class UploadStore:
    """Dropped model configs by name, the newest :data:`MAX_KEPT` (safe to use from several threads)."""

    def __init__(self, max_kept: int = MAX_KEPT) -> None:
        self._kept: OrderedDict[str, ModelUpload] = OrderedDict()
        self._lock = threading.Lock()
        self._max_kept = max_kept

    def add(self, data: bytes, filename: str) -> ModelUpload:
        """Read a dropped file with the first reader that knows it; keep and return its config."""
        check_size(data, filename)
        for reader in MODEL_READERS:
            config = reader(data, filename)
            if config is not None:
                break
        else:
            raise UploadError(f"{filename}: not a file the page can plan; drop a model's config.json.")
        digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
        upload = ModelUpload(_PREFIX + digest, config, filename)
        with self._lock:
            self._kept[upload.name] = upload
            self._kept.move_to_end(upload.name)
            while len(self._kept) > self._max_kept:
                self._kept.popitem(last=False)
        return upload

    def get(self, name: str) -> ModelUpload:
        """The upload ``name``, or an :class:`UploadError` saying to drop the file again."""
        with self._lock:
            upload = self._kept.get(name)
        if upload is None:
            raise UploadError(
                f"model: {name!r} is a config.json dropped on the page before this server started (or one of many "
                "since); drop the file on the page again."
            )
        return upload
