"""``memfit fit CONFIG --write OUT``: the same tool's config, only its memory keys changed.

The fit's best configuration differs from the config in a few knobs (micro-batch, accumulation,
checkpointing, optimizer; the method when ``--method`` asked for others). Each knob is written back
through the rule that read it (:attr:`memfit.interop.keys.Rule.write`), into the config as the user
wrote it: a YAML is edited with ruamel.yaml's round trip, so comments, key order and quoting stay;
a key the config did not have is added at its end. The input is never touched: OUT is written to a
temporary file and renamed into place (with ``--overwrite``, over OUT, even when OUT is the input).
The unified diff against the input is returned for the command to print.
"""

from __future__ import annotations

import difflib
import io
import json
import re
from pathlib import Path
from typing import Any

from memfit.errors import PathError
from memfit.interop.keys import ABSENT, KeyMap

#: Knobs ``memfit fit`` chooses, in the order their keys are written.
WRITTEN_KNOBS = ("method", "batch_size", "grad_accum", "checkpointing", "optimizer")


def check_not_the_input(out: str | Path, config: str | Path, overwrite: bool) -> None:
    """Refuse ``--write`` onto the config being fitted, unless ``--overwrite`` says so."""
    if Path(out).expanduser().resolve() == Path(config).expanduser().resolve() and not overwrite:
        raise PathError(f"--write {str(out)!r} is the config being fitted; write another file, or pass --overwrite to "
                        "replace it (the new config is written in full first, then renamed over it)")


def fitted_changes(keymap: KeyMap, raw: dict[str, Any], read_knobs: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """Key -> new value for every knob of :data:`WRITTEN_KNOBS` the fit changed (nothing where the
    config already says it, spelled its own way)."""
    changes: dict[str, Any] = {}
    for knob in WRITTEN_KNOBS:
        if knob not in spec or _same(read_knobs.get(knob), spec[knob]):
            continue
        rule = next((r for r in keymap.rules if r.knob == knob and r.write is not None), None)
        if rule is None:
            continue
        for key, value in rule.write(spec[knob], raw).items():
            if raw.get(key, ABSENT) != value:
                changes[key] = value
    return changes


def _same(read: Any, chosen: Any) -> bool:
    if isinstance(read, (list, tuple)) or isinstance(chosen, (list, tuple)):
        return list(read or []) == list(chosen or [])
    return read == chosen


def write_fitted_config(config: str | Path, spec: dict[str, Any], out: str | Path, *, overwrite: bool = False) -> str:
    """Write ``config`` with the memory keys of the fitted ``spec`` to ``out``; return the unified diff."""
    from memfit.interop import TOOLS, read_tool_config

    tool = read_tool_config(config)
    keymap = next(k for k in TOOLS if k.tool == tool.tool)
    text = Path(config).expanduser().read_text()
    raw = json.loads(text) if Path(config).suffix.lower() == ".json" else _yaml().load(text)
    return write_changes(config, fitted_changes(keymap, dict(raw), tool.knobs, spec), out, overwrite=overwrite)


def write_changes(config: str | Path, changes: dict[str, Any], out: str | Path, *, overwrite: bool = False,
                  spelled: dict[str, str] | None = None) -> str:
    """Write ``config`` (a YAML or JSON file) to ``out`` with ``changes`` (key -> new value) made, as
    the user wrote it otherwise: a YAML through ruamel.yaml's round trip (comments, order and quoting
    kept; a key it did not have added at its end). ``spelled``: the file's spelling of a key, where
    it differs (``grad-accum``). The input is never touched: ``out`` is written whole to a temporary
    file, then renamed. Returns the unified diff."""
    config, out = Path(config).expanduser(), Path(out).expanduser()
    text = config.read_text()
    renamed = {(spelled or {}).get(key, key): value for key, value in changes.items()}
    new_text = _edit_json(text, renamed) if config.suffix.lower() == ".json" else _edit_yaml(text, renamed)
    if out.exists() and not overwrite:
        raise PathError(f"--write {str(out)!r} exists; choose another file name or pass --overwrite.")
    from memfit.files import write_atomic

    write_atomic(out, new_text)
    diff = difflib.unified_diff(text.splitlines(keepends=True), new_text.splitlines(keepends=True), fromfile=str(config),
                                tofile=str(out))
    return "".join(diff)


def _yaml():
    from ruamel.yaml import YAML

    yaml = YAML(typ="rt")
    yaml.preserve_quotes = True
    yaml.width = 4096  # never re-wrap a long line the user wrote
    return yaml


def _edit_yaml(text: str, changes: dict[str, Any]) -> str:
    yaml = _yaml()
    mapping, sequence, offset = _indents(text)
    yaml.indent(mapping=mapping, sequence=sequence, offset=offset)
    doc = yaml.load(text)
    for key, value in changes.items():
        doc[key] = value
    stream = io.StringIO()
    yaml.dump(doc, stream)
    return stream.getvalue()


def _indents(text: str) -> tuple[int, int, int]:
    """ruamel's (mapping, sequence, offset) indents for a YAML written like ``text``: block
    sequences under a key either flush (``- a``) or indented (``  - a``)."""
    lines = text.splitlines()
    for before, line in zip(lines, lines[1:]):
        key = re.match(r"^(\s*)[^\s#-][^:]*:\s*(#.*)?$", before)
        item = re.match(r"^(\s*)- ", line)
        if key and item:
            offset = len(item.group(1)) - len(key.group(1))
            return 2, offset + 2, offset
    return 2, 2, 0


def _edit_json(text: str, changes: dict[str, Any]) -> str:
    data = json.loads(text)
    data.update(changes)
    indent = re.search(r"\n([ \t]+)\"", text)
    return json.dumps(data, indent=indent.group(1) if indent else 2) + ("\n" if text.endswith("\n") else "")
