"""``memfit fit CONFIG --write OUT``: the same tool's config, only its memory keys changed.

The fit's best configuration differs from the config in a few knobs (micro-batch, accumulation,
checkpointing, optimizer; the method when ``--method`` asked for others). Each knob is written back
through the rule that read it (:attr:`memfit.interop.keys.Rule.write`), into the config as the user
wrote it: a YAML is edited with ruamel.yaml's round trip, so comments, key order and quoting stay;
a JSON file is edited as text, only the values of the changed keys replaced, every other byte kept
(``2e-5`` stays ``2e-5``, a one-line file one line); a key the config did not have is added at its
end. OUT is written in the format its extension says (``.json``: JSON; ``.yaml`` / ``.yml``: YAML;
any other: the config's own), so a YAML config written to ``out.json`` becomes JSON. The input is
never touched, nor written over: OUT is never the config (:func:`memfit.files.check_not_an_input`),
and is written to a temporary file and renamed into place. The unified diff against the input is
returned for the command to print.
"""

from __future__ import annotations

import difflib
import io
import itertools
import json
import re
from pathlib import Path
from typing import Any

from memfit.errors import PathError
from memfit.files import check_not_an_input, file_format
from memfit.interop.keys import ABSENT, KeyMap

#: Knobs ``memfit fit`` chooses, in the order their keys are written.
WRITTEN_KNOBS = ("method", "batch_size", "grad_accum", "checkpointing", "optimizer")


def fitted_changes(
    keymap: KeyMap, raw: dict[str, Any], read_knobs: dict[str, Any], spec: dict[str, Any]
) -> dict[str, Any]:
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
    """Write ``config`` with the memory keys of the fitted ``spec`` to ``out``; return the unified diff.

    ``out`` is written in the format its extension says (:func:`memfit.files.file_format`), its folder made if
    it does not exist yet; it is never ``config`` itself, and an existing file is replaced only with
    ``overwrite``."""
    from memfit.interop import TOOLS, read_tool_config

    tool = read_tool_config(config)
    keymap = next(k for k in TOOLS if k.tool == tool.tool)
    text = Path(config).expanduser().read_text()
    raw = _load(text, file_format(Path(config), "yaml"))
    return write_changes(config, fitted_changes(keymap, dict(raw), tool.knobs, spec), out, overwrite=overwrite)


def write_changes(
    config: str | Path,
    changes: dict[str, Any],
    out: str | Path,
    *,
    overwrite: bool = False,
    spelled: dict[str, str] | None = None,
) -> str:
    """Write ``config`` (a YAML or JSON file) to ``out`` with ``changes`` (key -> new value) made, as
    the user wrote it otherwise (:func:`changed_text`). ``spelled``: the file's spelling of a key,
    where it differs (``grad-accum``). ``out`` is never ``config``, and is written whole to a
    temporary file, then renamed; its folder is made. Returns the unified diff."""
    config, out = Path(config).expanduser(), Path(out).expanduser()
    check_not_an_input(out, "--write", {"config being fitted": config}, overwrite=overwrite)
    text = config.read_text()
    renamed = {(spelled or {}).get(key, key): value for key, value in changes.items()}
    given = file_format(config, "yaml")
    new_text = changed_text(text, given, file_format(out, given), renamed)
    if out.exists() and not overwrite:
        raise PathError(f"--write {str(out)!r} exists; choose another file name or pass --overwrite.")
    from memfit.files import make_folder, write_atomic

    make_folder(out.parent)
    write_atomic(out, new_text)
    diff = difflib.unified_diff(
        text.splitlines(keepends=True), new_text.splitlines(keepends=True), fromfile=str(config), tofile=str(out)
    )
    return "".join(diff)


def changed_text(text: str, given: str, wanted: str, changes: dict[str, Any]) -> str:
    """The config ``text`` (in format ``given``) with ``changes`` made, in format ``wanted``: edited
    in place when the two agree, written afresh from its values when they do not."""
    if given == wanted:
        return edit_json_text(text, changes) if given == "json" else _edit_yaml(text, changes)
    data = {**_load(text, given, safe=True), **changes}
    if wanted == "json":
        return json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n"
    import yaml

    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)


def _load(text: str, given: str, *, safe: bool = False) -> Any:
    """A config's values: JSON, or YAML (ruamel's round trip, or plain values with ``safe``)."""
    if given == "json":
        return json.loads(text)
    if safe:
        from ruamel.yaml import YAML

        return YAML(typ="safe").load(text)
    return _yaml().load(text)


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
    for before, line in itertools.pairwise(lines):
        key = re.match(r"^(\s*)[^\s#-][^:]*:\s*(#.*)?$", before)
        item = re.match(r"^(\s*)- ", line)
        if key and item:
            offset = len(item.group(1)) - len(key.group(1))
            return 2, offset + 2, offset
    return 2, 2, 0


def edit_json_text(text: str, changes: dict[str, Any]) -> str:
    """The JSON object ``text`` with the top-level keys of ``changes`` set to their values: an
    existing key's value replaced where it stands (the last one, where a key is given twice, as a
    JSON reader keeps), a new key added after the last, spaced as the keys before it. Every other
    byte of ``text`` is kept."""
    members, close = _json_members(text)
    edits: list[tuple[int, int, str]] = []  # (start, end, replacement), applied from the end
    placed = {key: (value_start, value_end) for key, _, _, value_start, value_end in members}  # the last of a key
    added = []
    for key, value in changes.items():
        written = json.dumps(value, ensure_ascii=False)
        if key in placed:
            edits.append((*placed[key], written))
        else:
            added.append((key, written))
    if added:
        at = members[-1][4] if members else close
        edits.append((at, at, _json_addition(text, members, added)))
    for start, end, replacement in sorted(edits, reverse=True):
        text = text[:start] + replacement + text[end:]
    return text


_JSON_SPACE = re.compile(r"[ \t\n\r]*")


def _json_members(text: str) -> tuple[list[tuple[str, int, int, int, int]], int]:
    """The top-level members of the JSON object ``text``, each (key, key start, key end, value start,
    value end), and where its closing brace is."""
    decoder = json.JSONDecoder()
    at = _JSON_SPACE.match(text, 0).end()
    if text[at : at + 1] != "{":
        raise ValueError("not a JSON object")
    at = _JSON_SPACE.match(text, at + 1).end()
    members: list[tuple[str, int, int, int, int]] = []
    while text[at] != "}":
        key_start = at
        key, key_end = decoder.raw_decode(text, at)
        at = _JSON_SPACE.match(text, key_end).end() + 1  # past the colon
        value_start = _JSON_SPACE.match(text, at).end()
        _, value_end = decoder.raw_decode(text, value_start)
        members.append((key, key_start, key_end, value_start, value_end))
        at = _JSON_SPACE.match(text, value_end).end()
        if text[at] == ",":
            at = _JSON_SPACE.match(text, at + 1).end()
    return members, at


def _json_addition(text: str, members: list[tuple[str, int, int, int, int]], added: list[tuple[str, str]]) -> str:
    """The text of the ``added`` members (key, value as JSON), to go after the last member of
    ``text``: each with the comma, line break and indent that come before the last key, and its
    key-value separator (``", "`` and ``": "`` in an empty object)."""
    if not members:
        return ", ".join(f"{json.dumps(key, ensure_ascii=False)}: {value}" for key, value in added)
    last = members[-1]
    before = text[members[-2][4] : last[1]] if len(members) > 1 else "," + text[text.index("{") + 1 : last[1]]
    colon = text[last[2] : last[3]]
    return "".join(f"{before}{json.dumps(key, ensure_ascii=False)}{colon}{value}" for key, value in added)
