"""Files dropped on the page: a model's config.json, or another tool's training config, read as data.

The page plans by name (``model=upload-1a2b3c4d5e6f``): the server reads the dropped file once,
keeps it under a name made from its content, and the plan and fit requests name it like a
catalog model. Nothing is executed: a config.json is JSON, parsed as data, kept in memory; no
code that ships with a model (``trust_remote_code``) is ever run.

What a dropped file can be is decided by :data:`MODEL_READERS`, an ordered list of small readers
(as PEFT dispatches its backends): the first that recognises the file returns the config. Another
tool's training config (an Axolotl or LLaMA-Factory YAML, TrainingArguments / TRL arguments,
with the DeepSpeed JSON it names dropped beside it) is read by :mod:`memfit.ui.tool_configs` and
planned as ``memfit plan CONFIG`` plans it; it is written into a folder of the server's own, which
goes when the server stops.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memfit.ui.tool_configs import ToolUpload

from memfit.ui.dropped_files import (
    MAX_UPLOAD_BYTES,
    UPLOAD_PREFIX,
    UploadError,
    check_size,
    decode_text,
    is_upload_name,
)

#: Dropped configs kept at once (the oldest is forgotten first).
MAX_KEPT = 64
#: Files dropped at once: a training config and the DeepSpeed or FSDP JSON it names.
MAX_FILES = 4

__all__ = [
    "MAX_FILES",
    "MAX_KEPT",
    "MAX_UPLOAD_BYTES",
    "ModelUpload",
    "UploadError",
    "UploadStore",
    "check_size",
    "is_upload_name",
    "read_json_object",
]


@dataclass(frozen=True)
class ModelUpload:
    """A config dropped on the page: the name plans use, the model's config (a config.json) or the
    tool config as read (``tool``), and the file's own name."""

    name: str
    config: dict[str, Any]
    filename: str
    tool: ToolUpload | None = None

    @property
    def planned(self) -> str | dict[str, Any]:
        """What the planner is given: the model's config, or the path of the tool config written."""
        return str(self.tool.path) if self.tool is not None else dict(self.config)

    @property
    def model(self) -> str | dict[str, Any]:
        """The model itself: the config.json's config, or the model the tool config names."""
        return self.tool.model if self.tool is not None else dict(self.config)

    def describe(self) -> dict[str, Any]:
        """What the page shows of it (``POST /api/model``'s answer)."""
        answer: dict[str, Any] = {
            "model": self.name,
            "filename": self.filename,
            "model_type": self.config.get("model_type"),
        }
        if self.tool is not None:
            answer.update(
                tool=self.tool.tool, tool_title=self.tool.title, base_model=self.tool.model, knobs=self.tool.knobs
            )
        return answer


def read_json_object(data: bytes, filename: str) -> dict[str, Any]:
    """``data`` parsed as one JSON object, or an :class:`UploadError` saying what it is instead."""
    text = decode_text(data, filename, "the model's config.json")
    try:
        value = json.loads(text)
    except ValueError as err:
        raise UploadError(f"{filename}: not valid JSON ({err}); drop the model's config.json.") from None
    if not isinstance(value, dict):
        raise UploadError(
            f"{filename}: holds a JSON {type(value).__name__}, not an object; drop the model's config.json."
        )
    return value


def is_model_config(config: Any, filename: str) -> bool:
    """Whether a dropped file is a model's config.json rather than another tool's training config:
    named config.json, or (``config``, parsed) a JSON object with ``model_type`` or ``architectures``
    (as :func:`memfit.interop.is_tool_config` tells them apart)."""
    if not filename.lower().endswith(".json"):
        return False
    if Path(filename).name.lower() == "config.json":
        return True
    return isinstance(config, dict) and ("model_type" in config or "architectures" in config)


def config_json_reader(data: bytes, filename: str) -> dict[str, Any] | None:
    """A Hugging Face config.json: a JSON object with a ``model_type``."""
    if not filename.lower().endswith(".json"):
        return None
    config = read_json_object(data, filename)
    if "model_type" not in config:
        raise UploadError(
            f'{filename}: has no model_type, so it is not a model\'s config.json (e.g. "model_type": "llama"); '
            "drop the config.json from the model's folder or its Hub page."
        )
    return config


#: Readers tried in order; each returns the model config, None when the file is not its kind, or
#: raises :class:`UploadError` when it is its kind but broken.
MODEL_READERS: list[Callable[[bytes, str], dict[str, Any] | None]] = [config_json_reader]


class UploadStore:
    """Dropped configs by name, the newest :data:`MAX_KEPT` (safe to use from several threads).
    Tool configs are written under a folder of the store's own, removed with the store."""

    def __init__(self, max_kept: int = MAX_KEPT) -> None:
        self._kept: OrderedDict[str, ModelUpload] = OrderedDict()
        self._lock = threading.Lock()
        self._max_kept = max_kept
        self._folder: Path | None = None

    def add(self, data: bytes, filename: str) -> ModelUpload:
        """Read one dropped file (a model's config.json or a tool's config); keep and return it."""
        return self.add_files({filename: data})

    def add_files(self, files: dict[str, bytes]) -> ModelUpload:
        """Read files dropped together: one config (a model's config.json, or a tool's training config
        with the DeepSpeed / FSDP JSON files it names); keep and return it."""
        from memfit.ui.tool_configs import CONFIG_SUFFIXES, base_name, named_files, parse, write_dropped

        if not files:
            raise UploadError("no file: drop a model's config.json or a training config.")
        if len(files) > MAX_FILES:
            raise UploadError(
                f"{len(files)} files at once: drop one config (with the DeepSpeed JSON it names), at most {MAX_FILES} files."
            )
        for filename, data in files.items():
            check_size(data, filename)
        configs = [name for name in files if name.lower().endswith(CONFIG_SUFFIXES)]
        if len(files) == 1 and not configs:
            return self._model_config(*next(iter(files.items())))
        # A file named config.json is a model's (its own reader says what is wrong with it).
        parsed = {
            name: None if base_name(name).lower() == "config.json" else parse(files[name], name) for name in configs
        }
        named = {
            base_name(value) for raw in parsed.values() if isinstance(raw, dict) for value in named_files(raw).values()
        }
        mains = [name for name in configs if base_name(name) not in named]
        if len(mains) != 1 or (len(files) > 1 and is_model_config(parsed[mains[0]], mains[0])):
            raise UploadError(
                f"{', '.join(mains or files)}: drop one config at a time (a model's config.json, or a training "
                "config with the DeepSpeed JSON it names)."
            )
        main = mains[0]
        if is_model_config(parsed[main], main):
            return self._model_config(main, files[main])
        companions = {base_name(name): data for name, data in files.items() if name != main}
        tool = write_dropped(self._own_folder(), (main, parsed[main]), companions)
        return self._keep(ModelUpload(UPLOAD_PREFIX + tool.path.parent.name, {}, main, tool))

    def _model_config(self, filename: str, data: bytes) -> ModelUpload:
        for reader in MODEL_READERS:
            config = reader(data, filename)
            if config is not None:
                break
        else:
            raise UploadError(
                f"{filename}: not a file the page can plan; drop a model's config.json or a training "
                "config (Axolotl, LLaMA-Factory, TrainingArguments / TRL: .yaml, .yml or .json)."
            )
        digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
        return self._keep(ModelUpload(UPLOAD_PREFIX + digest, config, filename))

    def _own_folder(self) -> Path:
        with self._lock:
            if self._folder is None:
                self._folder = Path(tempfile.mkdtemp(prefix="memfit-ui-configs-"))
                weakref.finalize(self, shutil.rmtree, str(self._folder), True)
            return self._folder

    def _keep(self, upload: ModelUpload) -> ModelUpload:
        with self._lock:
            self._kept[upload.name] = upload
            self._kept.move_to_end(upload.name)
            while len(self._kept) > self._max_kept:
                _, gone = self._kept.popitem(last=False)
                if gone.tool is not None:
                    shutil.rmtree(gone.tool.path.parent, ignore_errors=True)
        return upload

    def get(self, name: str) -> ModelUpload:
        """The upload ``name``, or an :class:`UploadError` saying to drop the file again."""
        with self._lock:
            upload = self._kept.get(name)
        if upload is None:
            raise UploadError(
                f"model: {name!r} is a config dropped on the page before this server started (or one of many "
                "since); drop the file on the page again."
            )
        return upload
