"""The record formats, their detection, validation and normalization.

Every record becomes one of three normalized forms:

- chat: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...], "source": where}``
- text: ``{"text": str, "source": where}``
- preference pair: ``{"pair": {"prompt", "chosen", "rejected", "chat"}, "source": where}``
  (:mod:`memfit.train.data.pairs`)

``source`` names the file and line the record came from, for later error messages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memfit.train.data.errors import Problems
from memfit.train.data.pairs import normalize_pair
from memfit.train.data.readers import RawRecord, expand_paths, json_type_name, read_file

# The keys that identify each format, in the order they are listed to users.
FORMAT_KEYS: dict[str, tuple[str, ...]] = {
    "alpaca": ("instruction", "output"),
    "sharegpt": ("conversations",),
    "messages": ("messages",),
    "text": ("text",),
    "preference": ("chosen", "rejected"),
}
FORMATS = tuple(FORMAT_KEYS)
ROLES = ("system", "user", "assistant")
# ShareGPT exports name the speakers in several ways; all map onto the three chat roles.
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


def load_records(
    paths: str | Path | list[str | Path], format: str = "auto"
) -> tuple[list[dict[str, Any]], str]:
    """Read, validate and normalize training records from local files.

    Args:
        paths: a file, a directory (its .json/.jsonl/.ndjson/.parquet/.csv files, sorted) or a list
            of them. JSON files hold a list of records; JSONL one record per line; CSV one record per
            row (alpaca and text formats only); Parquet via pyarrow.
        format: ``alpaca``, ``sharegpt``, ``messages``, ``text``, ``preference`` or ``auto`` (detected from the keys
            of each file's first record; all files must agree).

    Returns:
        The normalized records (see the module docstring) and the format name.

    Raises:
        DataError: listing every problem found (file, record or line, field), before any record is
            returned.
    """
    problems = Problems()
    if format != "auto" and format not in FORMAT_KEYS:
        problems.add("format", f"unknown format {format!r}; use auto, {', '.join(FORMATS)}")
        problems.raise_if_any()
    files = expand_paths(paths, problems)
    per_file = []
    for path in files:
        before = problems.count
        per_file.append((path, read_file(path, problems), problems.count > before))

    chosen = None if format == "auto" else format
    detected_in: Path | None = None
    records: list[dict[str, Any]] = []
    for path, raw_records, unreadable in per_file:
        if not raw_records:
            if not unreadable:  # an unreadable file already has its problem; an empty list needs one
                problems.add(str(path), "no records")
            continue
        file_format = chosen
        if format == "auto":
            file_format = detect_format(raw_records[0], problems)
            if file_format is None:
                continue
            if chosen is None:
                chosen, detected_in = file_format, path
            elif file_format != chosen:
                problems.add(
                    str(path),
                    f"records look like the {file_format!r} format but {detected_in} holds {chosen!r}; "
                    "load files of one format at a time",
                )
                continue
        assert file_format is not None
        if raw_records[0].file_type == "csv" and file_format in ("sharegpt", "messages"):
            problems.add(
                str(path),
                f"CSV columns hold flat text, but the {file_format!r} format needs a list of turns; "
                "save it as JSON, JSONL or Parquet",
            )
            continue
        normalize = _NORMALIZERS[file_format]
        for raw in raw_records:
            record = normalize(raw, problems)
            if record is not None:
                records.append(record)
    problems.raise_if_any()
    assert chosen is not None
    return records, chosen


def detect_format(raw: RawRecord, problems: Problems) -> str | None:
    """Name the format of a record from its keys; add a problem and return None when the keys
    match no format or more than one."""
    if not isinstance(raw.value, dict):
        problems.add(raw.where, f"record is {json_type_name(raw.value)}; expected an object")
        return None
    keys = set(raw.value)
    matches = [name for name, needed in FORMAT_KEYS.items() if keys.issuperset(needed)]
    expected = "; ".join(f"{name} ({', '.join(needed)})" for name, needed in FORMAT_KEYS.items())
    if len(matches) == 1:
        return matches[0]
    found = ", ".join(sorted(map(str, keys))) or "none"
    if not matches:
        problems.add(
            raw.where,
            f"cannot tell the format from the keys ({found}); expected the keys of one of: {expected}. "
            "Rename the fields or set format explicitly",
        )
    else:
        problems.add(
            raw.where,
            f"keys ({found}) fit several formats ({', '.join(matches)}); set format to one of them",
        )
    return None


def _check_string(
    value: Any, raw: RawRecord, field: str, problems: Problems, *, required: bool = True
) -> str | None:
    """Return ``value`` if it is a non-empty string; add a problem naming ``field`` otherwise.
    Optional fields may be missing, null or empty."""
    if value is None:
        if required:
            problems.add(raw.where, "missing (required)", field)
        return None
    if not isinstance(value, str):
        problems.add(raw.where, f"expected a string, got {json_type_name(value)}", field)
        return None
    if required and not value.strip():
        problems.add(raw.where, "empty text", field)
        return None
    return value


def _record_object(raw: RawRecord, problems: Problems) -> dict | None:
    if not isinstance(raw.value, dict):
        problems.add(raw.where, f"record is {json_type_name(raw.value)}; expected an object")
        return None
    return raw.value


def _normalize_alpaca(raw: RawRecord, problems: Problems) -> dict[str, Any] | None:
    value = _record_object(raw, problems)
    if value is None:
        return None
    before = problems.count
    instruction = _check_string(value.get("instruction"), raw, "instruction", problems)
    extra_input = _check_string(value.get("input"), raw, "input", problems, required=False)
    output = _check_string(value.get("output"), raw, "output", problems)
    system = _check_string(value.get("system"), raw, "system", problems, required=False)
    if problems.count > before:
        return None
    assert instruction is not None and output is not None
    # The optional input follows the instruction after a blank line, as in the original alpaca prompt.
    prompt = f"{instruction}\n\n{extra_input}" if extra_input and extra_input.strip() else instruction
    messages = [{"role": "system", "content": system}] if system and system.strip() else []
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
    return {"messages": messages, "source": raw.where}


def _normalize_turns(
    raw: RawRecord, problems: Problems, list_key: str, role_key: str, content_key: str,
    role_names: dict[str, str],
) -> dict[str, Any] | None:
    """Shared by sharegpt (conversations/from/value) and messages (messages/role/content)."""
    value = _record_object(raw, problems)
    if value is None:
        return None
    turns = value.get(list_key)
    if turns is None:
        problems.add(raw.where, "missing (required)", list_key)
        return None
    if not isinstance(turns, list):
        problems.add(raw.where, f"expected a list of turns, got {json_type_name(turns)}", list_key)
        return None
    if not turns:
        problems.add(raw.where, "empty conversation", list_key)
        return None
    before = problems.count
    messages = []
    for index, turn in enumerate(turns):
        field = f"{list_key}[{index}]"
        if not isinstance(turn, dict):
            problems.add(raw.where, f"expected an object with {role_key!r} and {content_key!r}, got {json_type_name(turn)}", field)
            continue
        role_value = turn.get(role_key)
        role = role_names.get(role_value) if isinstance(role_value, str) else None
        if role_value is None:
            problems.add(raw.where, "missing (required)", f"{field}.{role_key}")
        elif role is None:
            problems.add(
                raw.where,
                f"unknown role {role_value!r}; expected one of {', '.join(role_names)}",
                f"{field}.{role_key}",
            )
        elif role == "system" and index != 0:
            problems.add(raw.where, "a system turn may only come first", f"{field}.{role_key}")
        content = turn.get(content_key)
        if isinstance(content, list):
            problems.add(
                raw.where,
                "expected a string, got a list (multimodal content parts are not supported)",
                f"{field}.{content_key}",
            )
            continue
        content = _check_string(content, raw, f"{field}.{content_key}", problems)
        if role is not None and content is not None:
            messages.append({"role": role, "content": content})
    if problems.count > before:
        return None
    if not any(m["role"] == "assistant" for m in messages):
        problems.add(raw.where, "conversation has no assistant turn, so nothing would be trained", list_key)
        return None
    return {"messages": messages, "source": raw.where}


def _normalize_sharegpt(raw: RawRecord, problems: Problems) -> dict[str, Any] | None:
    return _normalize_turns(raw, problems, "conversations", "from", "value", SHAREGPT_ROLES)


def _normalize_messages(raw: RawRecord, problems: Problems) -> dict[str, Any] | None:
    return _normalize_turns(raw, problems, "messages", "role", "content", {r: r for r in ROLES})


def _normalize_text(raw: RawRecord, problems: Problems) -> dict[str, Any] | None:
    value = _record_object(raw, problems)
    if value is None:
        return None
    text = _check_string(value.get("text"), raw, "text", problems)
    return None if text is None else {"text": text, "source": raw.where}


_NORMALIZERS = {
    "alpaca": _normalize_alpaca,
    "sharegpt": _normalize_sharegpt,
    "messages": _normalize_messages,
    "text": _normalize_text,
    "preference": normalize_pair,
}
