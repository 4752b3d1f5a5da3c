"""Read local data files into raw records, each tagged with where it came from.

One small reader per file type. Readers never raise on bad content: they add a problem (with the
file and line) and carry on, so validation can report everything at once.

JSON, JSON Lines and CSV are read here, not through ``datasets``: its JSON reader names a broken
line by its row within a block of the file and a pyarrow message, not by the file's line; it
refuses a column whose values change type before memfit can name the record and field; and it
copies every file into its Arrow cache first. Parquet and Arrow files, whose types are fixed per
column and whose damage is per file, are read through ``datasets`` (:func:`read_rows`), as is every
file of a stream (:mod:`memfit.train.data.hf_datasets`).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.train.data.errors import Problems

SUFFIXES = {
    ".json": "json",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".csv": "csv",
}


@dataclass(frozen=True)
class RawRecord:
    """One record as read from disk. ``where`` is what error messages print (``data.jsonl, line 3``);
    ``file_type`` is json, jsonl, csv, parquet, arrow or hub (a Hub dataset's row); CSV records
    hold strings only."""

    where: str
    value: Any
    file_type: str


def expand_paths(paths: str | Path | list[str | Path] | tuple[str | Path, ...], problems: Problems) -> list[Path]:
    """Turn the user's paths into data files: a directory stands for its data files (sorted, not
    recursive). Missing paths and unsupported file types become problems."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in SUFFIXES)
            if not found:
                problems.add(str(path), f"directory holds no data files ({', '.join(SUFFIXES)})")
            files.extend(found)
        elif not path.exists():
            problems.add(str(path), "no such file or directory")
        elif path.suffix.lower() not in SUFFIXES:
            problems.add(
                str(path),
                f"unsupported file type {path.suffix or '(no suffix)'!r}; use one of {', '.join(SUFFIXES)}",
            )
        else:
            files.append(path)
    if not files and not problems:
        problems.add("paths", "no data files given")
    return files


def read_file(path: Path, problems: Problems) -> list[RawRecord]:
    """Read one data file (type from its suffix) into raw records."""
    kind = SUFFIXES[path.suffix.lower()]
    empty = emptiness(path, kind)
    if empty is not None:
        problems.add(str(path), empty)
        return []
    return _READERS[kind](path, problems)


def emptiness(path: Path, kind: str) -> str | None:
    """Why the data file ``path`` of type ``kind`` holds no record, when that is known without reading
    it: no bytes at all, or a Parquet file whose footer counts 0 rows. (Given to ``datasets``, the first
    stops its JSON reader with a bare StopIteration and the second its Parquet reader with pyarrow's
    "BatchSize must be greater than 0".) None: the reader finds out."""
    try:
        if path.stat().st_size == 0:
            return "empty file (0 bytes)"
    except OSError:
        return None  # the reader says why it cannot be read
    if kind != "parquet":
        return None
    try:
        import pyarrow.parquet as pq

        rows = pq.ParquetFile(path).metadata.num_rows
    except Exception:  # noqa: BLE001 - no pyarrow, or a damaged footer: the reader says why
        return None
    return "no records (a Parquet file of 0 rows)" if rows == 0 else None


def _read_text(path: Path, problems: Problems) -> str | None:
    try:
        # utf-8-sig: files saved by spreadsheet programs often start with a byte-order mark.
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        problems.add(str(path), f"not UTF-8 text (byte {exc.start}); save the file as UTF-8")
        return None
    except OSError as exc:
        problems.add(str(path), f"cannot read file: {exc.strerror or exc}")
        return None
    if not text.strip():
        problems.add(str(path), "empty file")
        return None
    return text


def _read_jsonl_text(path: Path, text: str, problems: Problems) -> list[RawRecord]:
    records = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue  # blank lines (a trailing newline, a gap) carry no record
        where = f"{path}, line {line_number}"
        try:
            records.append(RawRecord(where, json.loads(line), "jsonl"))
        except json.JSONDecodeError as exc:
            problems.add(where, f"invalid JSON: {exc.msg} (column {exc.colno})")
    return records


def _read_jsonl(path: Path, problems: Problems) -> list[RawRecord]:
    text = _read_text(path, problems)
    return [] if text is None else _read_jsonl_text(path, text, problems)


def _read_json(path: Path, problems: Problems) -> list[RawRecord]:
    text = _read_text(path, problems)
    if text is None:
        return []
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data" and exc.lineno > 1:
            # One object per line saved as .json: read it as the JSON Lines it is.
            return _read_jsonl_text(path, text, problems)
        problems.add(str(path), f"invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}")
        return []
    if not isinstance(data, list):
        problems.add(
            str(path),
            f"top level is {json_type_name(data)}; expected a list of records [{{...}}, ...] "
            "(or save one record per line as .jsonl)",
        )
        return []
    return [RawRecord(f"{path}, record {i}", value, "json") for i, value in enumerate(data, start=1)]


def _read_csv(path: Path, problems: Problems) -> list[RawRecord]:
    text = _read_text(path, problems)
    if text is None:
        return []
    reader = csv.DictReader(text.splitlines(keepends=True))
    records = []
    header_width = len(reader.fieldnames or [])
    start_line = reader.line_num + 1  # line_num counts lines read so far: the header
    for row in reader:
        where = f"{path}, line {start_line}"
        start_line = reader.line_num + 1
        if None in row:
            problems.add(where, f"row has more fields than the header ({header_width}); quote fields that hold commas")
            continue
        missing = [k for k, v in row.items() if v is None]
        if missing:
            problems.add(where, f"row has fewer fields than the header; missing {', '.join(missing)}")
            continue
        records.append(RawRecord(where, dict(row), "csv"))
    return records


def read_rows(path: Path, kind: str) -> Iterator[dict[str, Any]]:
    """The rows of one local Parquet or Arrow file (``kind``: parquet or arrow, the name of the
    ``datasets`` builder too), read through ``datasets``. Raises ImportError when ``datasets`` is
    not installed, and what the reader raises for a damaged file."""
    import datasets

    yield from datasets.load_dataset(kind, data_files=[str(path)], split="train", streaming=True)


def _read_columnar(path: Path, problems: Problems, kind: str) -> list[RawRecord]:
    title = {"parquet": "Parquet", "arrow": "Arrow"}[kind]
    try:
        rows = list(read_rows(path, kind))
    except ImportError:
        problems.add(str(path), f"reading {title} files needs the datasets library: pip install datasets")
        return []
    except Exception as exc:  # noqa: BLE001 - pyarrow and datasets raise several types for damaged files
        cause = exc.__cause__ or exc
        problems.add(
            str(path),
            f"cannot read {title} file: {str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__}",
        )
        return []
    return [RawRecord(f"{path}, row {i}", row, kind) for i, row in enumerate(rows, start=1)]


def json_type_name(value: Any) -> str:
    """The JSON name of a value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


_READERS: dict[str, Callable[[Path, Problems], list[RawRecord]]] = {
    "json": _read_json,
    "jsonl": _read_jsonl,
    "csv": _read_csv,
    "parquet": lambda path, problems: _read_columnar(path, problems, "parquet"),
    "arrow": lambda path, problems: _read_columnar(path, problems, "arrow"),
}
