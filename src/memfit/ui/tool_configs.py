"""Other tools' training configs dropped on the page: an Axolotl or LLaMA-Factory YAML, a file of
TrainingArguments / TRL arguments, with the DeepSpeed (or FSDP) JSON it names dropped beside it.

The page plans them as ``memfit plan CONFIG`` does (:mod:`memfit.interop`), which reads a config
from a file, and reads the DeepSpeed JSON it names from the config's folder. So a dropped config
is parsed as data here (YAML by ``yaml.safe_load``, JSON as JSON), and written, with the files it
names, into a folder of the server's own (:func:`write_dropped`): every file name a key gives is
replaced by the name of a file dropped with it, so that nothing the page sends can make the server
open a file of its choosing. The model it names must be a catalog name or a Hub id, as on the
page; a path to a model folder on this machine is refused with the command to run instead.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

from memfit.ui.dropped_files import UploadError, check_size, decode_text

#: Keys whose value may be a file the config names (relative to its folder), in any tool's config.
FILE_KEYS = ("deepspeed", "fsdp_config")
#: Suffixes of the configs memfit reads (memfit.interop).
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


@dataclass(frozen=True)
class ToolUpload:
    """A dropped tool config as the planner reads it: the file written in the server's folder, the
    name it was dropped under, and what :func:`memfit.interop.read_tool_config` read from it."""

    path: Path
    filename: str
    tool: str
    title: str
    model: str
    knobs: dict[str, str]


def parse(data: bytes, filename: str) -> Any:
    """The YAML or JSON in ``data`` (data only: ``yaml.safe_load`` builds no Python objects)."""
    import yaml

    check_size(data, filename)
    text = decode_text(data, filename, "the training config as it is on disk")
    try:
        return json.loads(text) if filename.lower().endswith(".json") else yaml.safe_load(text)
    except ValueError as err:
        raise UploadError(f"{filename}: not valid JSON ({err}).") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise UploadError(f"{filename}: not valid YAML{where}: {getattr(err, 'problem', None) or err}.") from None


def named_files(raw: Mapping[str, Any]) -> dict[str, str]:
    """The files ``raw`` names by key (``{"deepspeed": "ds_z3.json"}``): string values of :data:`FILE_KEYS`."""
    return {key: raw[key].strip() for key in FILE_KEYS if isinstance(raw.get(key), str) and raw[key].strip()}


def base_name(value: str) -> str:
    """The file name a path ends in, written with / or \\."""
    return PurePath(value.replace("\\", "/")).name


def write_dropped(folder: Path, main: tuple[str, Any], companions: Mapping[str, bytes]) -> ToolUpload:
    """Write the dropped config ``main`` (its name and parsed content) and the files it names
    into a new folder under ``folder``, read it as ``memfit plan`` does, and return what was read.

    ``companions``: the other files dropped with it, by name; a file a key names is found among
    them by its base name (``deepspeed: /home/me/ds_z3.json`` is the dropped ``ds_z3.json``)."""
    filename, raw = main
    if not isinstance(raw, Mapping):
        raise UploadError(
            f"{filename}: holds a {type(raw).__name__}, not a config of keys and values; drop a training "
            "config (Axolotl, LLaMA-Factory, TrainingArguments / TRL) or a model's config.json."
        )
    names = named_files(raw)
    rewritten = dict(raw)
    files: dict[str, bytes] = {}
    for key, value in names.items():
        base = base_name(value)
        if base not in companions:
            raise UploadError(
                f"{filename}: {key}: names {value!r}; drop that file together with {filename} (select both): "
                "the page reads no file on the server."
            )
        rewritten[key] = base
        files[base] = companions[base]
    digest = hashlib.sha256(
        json.dumps([filename, sorted(rewritten.items(), key=str), sorted(files.items())], default=repr).encode()
    ).hexdigest()[:12]
    own = folder / digest
    own.mkdir(parents=True, exist_ok=True)
    try:
        tool = _read(own, filename, rewritten, files)
    except UploadError:
        shutil.rmtree(own, ignore_errors=True)
        raise
    knobs = {
        k: ",".join(v) if isinstance(v, (tuple, list)) else str(v).lower() if isinstance(v, bool) else str(v)
        for k, v in tool.knobs.items()
    }
    return ToolUpload(own / base_name(filename), filename, tool.tool, tool.title, tool.model, knobs)


def _read(own: Path, filename: str, raw: Mapping[str, Any], files: Mapping[str, bytes]) -> Any:
    """Write the config and its files into ``own`` and read it with :func:`memfit.interop.read_tool_config`;
    its model must be one the page may name (a catalog name or a Hub id)."""
    from memfit.interop import ToolConfigError, read_tool_config
    from memfit.ui.params import QueryError, check_page_model

    for base, content in files.items():
        (own / base).write_bytes(content)
    path = own / base_name(filename)
    path.write_text(_dump(raw, path.suffix.lower()))
    try:
        tool = read_tool_config(path)
    except ToolConfigError as err:
        raise UploadError(str(err).replace(str(own) + "/", "").replace(str(own), ".")) from None
    try:
        check_page_model(tool.model)
    except QueryError:
        keys = ", ".join(tool.sources.get("model", ("model",)))
        raise UploadError(
            f"{filename}: {keys}: {tool.model!r} is a folder on this machine, which the page does not read; "
            f"name the model by its Hub id there, or run `memfit plan {filename}`."
        ) from None
    return tool


def _dump(raw: Mapping[str, Any], suffix: str) -> str:
    import yaml

    if suffix == ".json":
        return json.dumps(raw, indent=2)
    return yaml.safe_dump(dict(raw), sort_keys=False)
