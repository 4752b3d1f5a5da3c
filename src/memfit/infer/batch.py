"""``memfit generate``: the replies to a JSONL file of prompts, each written beside its prompt.

A line of the prompts file is a JSON string (the user's message), or an object with ``prompt``
(text, or a list of ``{role, content}`` messages) or ``messages`` (a list of them, as in a
``messages``-format training file: a record whose last message is the user's). The output holds
the same records, in the same order, with ``generation`` (the reply), ``new_tokens`` and ``stopped``
(``eos`` or ``max_new_tokens``) added; a string line becomes ``{"prompt": ...}``. A vision-language
model's prompts may hold image parts (``{"type": "image"}``) and an ``images`` list of file paths
(relative to the prompts file), TRL's vision format, as its training data does. The file is written
under a temporary name and renamed once complete, and an existing file is replaced only when asked.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memfit.errors import PathError, UserError, listed
from memfit.train.generation import Sampling, generate_reply, prompt_messages, prompt_problem

#: How many bad lines one error lists (the rest are counted).
SHOWN_PROBLEMS = 5


class PromptsError(UserError, ValueError):
    """The prompts file cannot be read as prompts; the message names the lines."""


def read_prompts(path: Path) -> list[tuple[dict[str, Any], list[dict[str, str]]]]:
    """(record as it will be written, its chat messages) for every line of ``path``; blank lines are
    skipped. Raises :class:`PromptsError` naming every bad line (the first few) before any model is read."""
    if path.is_dir():
        raise PromptsError(f"--prompts {str(path)!r} is a folder; pass a JSONL file (one prompt a line)")
    if not path.is_file():
        raise PromptsError(f"--prompts {str(path)!r} does not exist")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise PromptsError(f"--prompts {str(path)!r} is not UTF-8 text (byte {err.start}); pass a JSONL file") from None
    items, problems = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as err:
            problems.append(f"line {number}: not JSON ({err}); write one JSON string or object a line")
            continue
        try:
            record, prompt = _record(value)
            problem = prompt_problem(prompt)
        except ValueError as err:
            problem = str(err)
        if problem:
            problems.append(f"line {number}: {problem}")
            continue
        missing = [i for i in _images(record, path.parent) if not Path(i).is_file()] if isinstance(record, dict) else []
        if missing:
            problems.append(f"line {number}: images: no file {missing[0]}; give the path relative to the prompts file")
            continue
        items.append((record, prompt_messages(prompt)))
    if problems:
        more = [f"... and {len(problems) - SHOWN_PROBLEMS} more"] if len(problems) > SHOWN_PROBLEMS else []
        raise PromptsError(listed(f"--prompts {path}", problems[:SHOWN_PROBLEMS] + more))
    if not items:
        raise PromptsError(f"--prompts {path} holds no prompt; write one JSON string or object a line")
    return items


def _record(value: Any) -> tuple[dict[str, Any], Any]:
    if isinstance(value, str):
        return {"prompt": value}, value
    if not isinstance(value, dict):
        raise ValueError(f"a {type(value).__name__}: write a JSON string, or an object with prompt or messages")
    if "generation" in value:
        raise ValueError("already has a generation; pass the prompts, not an earlier output")
    keys = [key for key in ("prompt", "messages") if key in value]
    if len(keys) != 1:
        raise ValueError("an object needs one of prompt (text or messages) or messages")
    return value, value[keys[0]]


def _images(record: dict[str, Any], folder: Path) -> list[str]:
    """A record's ``images``, relative paths made relative to ``folder`` (the prompts file's)."""
    return [str(folder / image) for image in record.get("images") or []]


def check_out(out: Path, overwrite: bool, inputs: dict[str, str | Path | None] | None = None) -> None:
    """``--out`` must be a file memfit may create, or replace with ``overwrite``, and none of the
    command's ``inputs`` (how each was given -> its path; checked first)."""
    from memfit.files import check_file_writable, check_not_an_input

    check_not_an_input(out, "--out", inputs or {}, overwrite=overwrite)
    if out.exists() and not out.is_dir() and not overwrite:
        raise PathError(f"--out {str(out)!r} exists; choose another file name or pass --overwrite")
    check_file_writable(out, "--out", make_parents=True)


def generate_file(
    chat_model: Any,
    items: list[tuple[dict[str, Any], list[dict[str, str]]]],
    out: Path,
    sampling: Sampling,
    progress: Callable[[int, int], None] = lambda done, total: None,
    prompts_folder: Path = Path("."),
) -> int:
    """Write the reply to every prompt of ``items`` to ``out`` (atomically); return how many. A record's
    ``images`` are paths relative to ``prompts_folder``."""
    from memfit.files import atomic_file

    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out) as file:
        for done, (record, messages) in enumerate(items, start=1):
            processor = getattr(chat_model, "processor", None)
            vision = {"processor": processor, "images": _images(record, prompts_folder)} if processor else {}
            reply = generate_reply(
                chat_model.model, chat_model.tokenizer, messages, sampling, chat_model.device, **vision
            )
            file.write(
                json.dumps(
                    {**record, "generation": reply.text, "new_tokens": reply.new_tokens, "stopped": reply.stopped},
                    ensure_ascii=False,
                )
                + "\n"
            )
            progress(done, len(items))
    return len(items)
