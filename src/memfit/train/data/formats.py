"""The record formats, their detection, validation and normalization.

Every record becomes one of three normalized forms:

- chat: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...], "source": where}``,
  with ``"train_from": k`` when only the assistant turns from message ``k`` on are trained (a
  conversational prompt-completion record: its completion); TRL's vision format keeps a turn's
  content as its list of parts (``{"type": "image"}``, ``{"type": "text", "text": str}``) and the
  record's ``images`` beside the messages (:mod:`memfit.train.data.vision_records`);
- text: ``{"text": str, "source": where}``;
- prompt-completion text: ``{"prompt": str, "completion": str, "source": where}``;
- preference pair: ``{"pair": {"prompt", "chosen", "rejected", "chat"}, "source": where}``
  (:mod:`memfit.train.data.pairs`);
- a prompt alone (grpo, TRL's prompt-only format): ``{"rollout": {"prompt": str or messages,
  "columns": {the record's other fields}}, "source": where}``; the other fields go to the reward
  functions, as TRL passes a dataset's columns.

``source`` names the file and line (or the dataset and row) the record came from, for later error
messages. A source's ``columns`` (memfit field <- dataset column) are applied to each record before
its format is detected (:func:`map_columns`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from memfit.train.data.errors import DataError, Problems
from memfit.train.data.pairs import normalize_pair
from memfit.train.data.readers import RawRecord, expand_paths, json_type_name, read_file
from memfit.train.data.vision_records import check_content_parts, check_images, resolve_image_paths

# The keys that identify each format, in the order they are listed to users.
FORMAT_KEYS: dict[str, tuple[str, ...]] = {
    "alpaca": ("instruction", "output"),
    "sharegpt": ("conversations",),
    "messages": ("messages",),
    "text": ("text",),
    # TRL's prompt-completion: two strings, or two lists of messages (conversational).
    "prompt_completion": ("prompt", "completion"),
    # TRL's preference formats: chosen / rejected with a prompt, or sharing it (implicit prompt).
    "preference": ("chosen", "rejected"),
    # TRL's prompt-only format (grpo): a prompt, any other fields for the reward functions.
    "prompt": ("prompt",),
}
FORMATS = tuple(FORMAT_KEYS)
ROLES = ("system", "user", "assistant")
# ShareGPT exports name the speakers in several ways; all map onto the three chat roles.
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


def load_records(
    paths: str | Path | list[str | Path],
    format: str = "auto",
    columns: Mapping[str, str] | None = None,
    *,
    name: str | None = None,
) -> tuple[list[dict[str, Any]], str]:
    """Read, validate and normalize training records from local files.

    Args:
        paths: a file, a directory (its .json/.jsonl/.ndjson/.csv/.parquet/.arrow files, sorted) or
            a list of them. JSON files hold a list of records; JSONL one record per line; CSV one
            record per row (alpaca, text and prompt-completion text only); Parquet and Arrow files
            are read through the ``datasets`` library.
        format: ``alpaca``, ``sharegpt``, ``messages``, ``text``, ``prompt_completion``,
            ``preference`` or ``auto`` (detected from the keys of each file's first record; all
            files must agree).
        columns: memfit field <- the files' column, applied to every record first
            (``{"prompt": "question", "completion": "answer"}``); a column that no record of a file
            has is refused at once (:func:`column_problem`).
        name: the config field that names these files (``data``, ``data[1]``), for messages.

    Returns:
        The normalized records (see the module docstring) and the format name.

    Raises:
        DataError: listing every problem found (file, record or line, field), before any record is
            returned.
    """
    problems = Problems()
    check_format(format, problems)
    files = expand_paths(paths, problems)
    per_file = []
    for path in files:
        before = problems.count
        raw = read_file(path, problems)
        if columns and raw:
            _check_file_columns(path, raw, columns, name)
        per_file.append((path, [map_columns(r, columns) for r in raw] if columns else raw, problems.count > before))

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
        records += resolve_image_paths(normalize_records(raw_records, file_format, problems), path.parent)
    problems.raise_if_any()
    assert chosen is not None
    return records, chosen


def check_format(format: str, problems: Problems) -> None:
    """Raise at once for a format name that does not exist (nothing else can be checked without one)."""
    if format != "auto" and format not in FORMAT_KEYS:
        problems.add("format", f"unknown format {format!r}; use auto, {', '.join(FORMATS)}")
        problems.raise_if_any()


def normalize_records(raw_records: Iterable[RawRecord], format: str, problems: Problems) -> list[dict[str, Any]]:
    """The records of ``format`` normalized (see the module docstring); each bad one adds a problem."""
    normalize = _NORMALIZERS[format]
    records = []
    for raw in raw_records:
        record = normalize(raw, problems)
        if record is not None:
            records.append(record)
    return records


def normalize_record(raw: RawRecord, format: str, problems: Problems) -> dict[str, Any] | None:
    """One record of ``format`` normalized, or None (with its problems added)."""
    return _NORMALIZERS[format](raw, problems)


def map_columns(raw: RawRecord, columns: Mapping[str, str] | None) -> RawRecord:
    """``raw`` with its columns renamed to memfit's fields (``columns``: field <- column). A column
    that the record does not have is left for validation to report as the field missing."""
    if not columns or not isinstance(raw.value, dict):
        return raw
    value = dict(raw.value)
    for field_name, column in columns.items():
        if column in raw.value:
            # The source column wins over a field of the same name it would otherwise collide with.
            value.pop(column)
            value[field_name] = raw.value[column]
    return RawRecord(raw.where, value, raw.file_type)


def column_problem(columns: Mapping[str, str], have: Iterable[str], what: str = "the dataset") -> str | None:
    """The first entry of ``columns`` (memfit field <- column) whose column is not among ``have``, as one
    line naming the entry, the column, the columns there are and the fix; None when every one is there.
    (A mapping onto a column that is not there would be ignored, and the record read as it is.)"""
    have = [str(c) for c in have]
    for field_name, column in columns.items():
        if column in have:
            continue
        listed = ", ".join(have) or "none"
        others = [c for c in have if c not in columns.values()]
        if field_name in have:
            fix = f"remove the entry to read its own {field_name!r} column, or map {field_name} to another column"
        else:
            fix = (
                f"map {field_name} to one of them, e.g. columns: {{{field_name}: {(others or have or ['column'])[0]}}}"
            )
        return f"columns: {field_name}: no column {column!r} in {what} (its columns: {listed}); {fix}"
    return None


def _check_file_columns(path: Path, raw: list[RawRecord], columns: Mapping[str, str], name: str | None) -> None:
    """Raise one line when ``columns`` names a column that no record of the file ``path`` has."""
    have = dict.fromkeys(key for record in raw if isinstance(record.value, dict) for key in record.value)
    if not have:
        return  # no record is an object: validation names each
    problem = column_problem(columns, have, "the file")
    if problem:
        raise DataError(f"{name + ': ' if name else ''}{path}: {problem}")


def detect_format(raw: RawRecord, problems: Problems) -> str | None:
    """Name the format of a record from its keys; add a problem and return None when the keys
    match no format or more than one."""
    if not isinstance(raw.value, dict):
        problems.add(raw.where, f"record is {json_type_name(raw.value)}; expected an object")
        return None
    # A null field counts as absent, as validation treats it: datasets' readers give every row every
    # column of the dataset, null where the row has none.
    keys = {key for key, value in raw.value.items() if value is not None}
    matches = [name for name, needed in FORMAT_KEYS.items() if keys.issuperset(needed)]
    if len(matches) > 1 and "prompt" in matches:
        matches.remove("prompt")  # a prompt with more (a completion, a pair) is that format
    expected = "; ".join(f"{name} ({', '.join(needed)})" for name, needed in FORMAT_KEYS.items())
    if len(matches) == 1:
        return matches[0]
    found = ", ".join(sorted(map(str, keys))) or "none"
    if not matches:
        problems.add(
            raw.where,
            f"cannot tell the format from the keys ({found}); expected the keys of one of: {expected}. "
            "Map the columns onto these fields with columns: {field: column}, or set format explicitly",
        )
    else:
        problems.add(
            raw.where,
            f"keys ({found}) fit several formats ({', '.join(matches)}); set format to one of them",
        )
    return None


def _check_string(value: Any, raw: RawRecord, field: str, problems: Problems, *, required: bool = True) -> str | None:
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
    raw: RawRecord,
    problems: Problems,
    list_key: str,
    role_key: str,
    content_key: str,
    role_names: dict[str, str],
) -> dict[str, Any] | None:
    """Shared by sharegpt (conversations/from/value) and messages (messages/role/content)."""
    value = _record_object(raw, problems)
    if value is None:
        return None
    messages = _check_turns(value.get(list_key), raw, problems, list_key, role_key, content_key, role_names)
    if messages is None:
        return None
    if not any(m["role"] == "assistant" for m in messages):
        problems.add(raw.where, "conversation has no assistant turn, so nothing would be trained", list_key)
        return None
    images = check_images(value.get("images"), messages, raw, problems, list_key)
    if images is None:
        return None
    return {"messages": messages, **({"images": images} if images else {}), "source": raw.where}


def _check_turns(
    turns: Any,
    raw: RawRecord,
    problems: Problems,
    list_key: str,
    role_key: str,
    content_key: str,
    role_names: dict[str, str],
    first_index: int = 0,
) -> list[dict[str, str]] | None:
    """The turns of ``list_key`` as chat messages, or None with the problems added.
    ``first_index``: where these turns start in the whole conversation (a system turn may only come first)."""
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
            problems.add(
                raw.where,
                f"expected an object with {role_key!r} and {content_key!r}, got {json_type_name(turn)}",
                field,
            )
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
        elif role == "system" and index + first_index != 0:
            problems.add(raw.where, "a system turn may only come first", f"{field}.{role_key}")
        content = turn.get(content_key)
        if isinstance(content, list):
            content = check_content_parts(content, raw, f"{field}.{content_key}", problems)
        else:
            content = _check_string(content, raw, f"{field}.{content_key}", problems)
        if role is not None and content is not None:
            messages.append({"role": role, "content": content})
    if problems.count > before:
        return None
    return messages


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


def _normalize_prompt_completion(raw: RawRecord, problems: Problems) -> dict[str, Any] | None:
    """TRL's prompt-completion: ``prompt`` and ``completion`` both text (the completion is trained,
    after the prompt as it is), or both lists of messages (conversational: rendered with the chat
    template, the completion's assistant turns trained)."""
    value = _record_object(raw, problems)
    if value is None:
        return None
    prompt, completion = value.get("prompt"), value.get("completion")
    if isinstance(prompt, list) or isinstance(completion, list):
        if not (isinstance(prompt, list) and isinstance(completion, list)):
            text_field = "completion" if isinstance(prompt, list) else "prompt"
            problems.add(
                raw.where,
                f"expected a list of messages like the other field, got {json_type_name(value.get(text_field))}; "
                "give prompt and completion both as text or both as message lists",
                text_field,
            )
            return None
        roles = {r: r for r in ROLES}
        before = problems.count
        head = _check_turns(prompt, raw, problems, "prompt", "role", "content", roles)
        tail = _check_turns(completion, raw, problems, "completion", "role", "content", roles, first_index=len(prompt))
        if problems.count > before or head is None or tail is None:
            return None
        if not any(m["role"] == "assistant" for m in tail):
            problems.add(raw.where, "has no assistant turn, so nothing would be trained", "completion")
            return None
        return {"messages": head + tail, "train_from": len(head), "source": raw.where}
    before = problems.count
    prompt = _check_string(prompt, raw, "prompt", problems)
    completion = _check_string(completion, raw, "completion", problems)
    if problems.count > before:
        return None
    return {"prompt": prompt, "completion": completion, "source": raw.where}


def _normalize_prompt(raw: RawRecord, problems: Problems) -> dict[str, Any] | None:
    """TRL's prompt-only record (grpo): ``prompt`` as text, or a list of messages ending with a turn
    the model answers; every other field is kept for the reward functions."""
    value = _record_object(raw, problems)
    if value is None:
        return None
    prompt = value.get("prompt")
    if isinstance(prompt, list):
        prompt = _check_turns(prompt, raw, problems, "prompt", "role", "content", {r: r for r in ROLES})
        if prompt is not None and prompt[-1]["role"] == "assistant":
            problems.add(
                raw.where, "ends with an assistant turn: a prompt ends with the turn the model answers", "prompt"
            )
            return None
    else:
        prompt = _check_string(prompt, raw, "prompt", problems)
    if prompt is None:
        return None
    return {
        "rollout": {"prompt": prompt, "columns": {k: v for k, v in value.items() if k != "prompt"}},
        "source": raw.where,
    }


_NORMALIZERS = {
    "alpaca": _normalize_alpaca,
    "sharegpt": _normalize_sharegpt,
    "messages": _normalize_messages,
    "text": _normalize_text,
    "prompt_completion": _normalize_prompt_completion,
    "preference": normalize_pair,
    "prompt": _normalize_prompt,
}
