"""A config's sources into training data: every source read, checked and normalized in memory
(:func:`load_sources`), or opened as one stream whose first rows are checked (:func:`open_stream`).

Local JSON, JSON Lines and CSV files are read by memfit's readers (:mod:`~memfit.train.data.readers`,
which say why); everything else, and every source of a stream, through ``datasets``
(:mod:`~memfit.train.data.hf_datasets`). Each source has its own format (detected from its first
record, or its ``format``) and column mapping; the records of all sources share memfit's
normalized forms (:mod:`~memfit.train.data.formats`), so sources of different formats mix.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from memfit.train.data.errors import DataError, Problems
from memfit.train.data.folders import split_spec
from memfit.train.data.formats import check_format, detect_format, map_columns, normalize_record, normalize_records
from memfit.train.data.readers import RawRecord
from memfit.train.data.sources import FIELDS, DataSource, field_name, normalized_weights

#: Rows of each streamed source read, checked and tokenized before the run starts: a stream's
#: format, columns and chat template fail there, not hours in.
CHECK_ROWS = 16


@dataclass
class Loaded:
    """Records read in memory, and what was read: each source's format and Hub commit, and the notes
    a run prints about them (a Hub dataset read from the cache)."""

    records: list[dict[str, Any]]
    formats: list[str]
    commits: list[str | None] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def hub_record(sources: Sequence[DataSource], commits: Sequence[str | None]) -> list[dict[str, Any]]:
    """What a run records of its Hub sources to be reproduced: path, subset, split, revision, commit."""
    return [
        {"path": s.path, "subset": s.subset, "split": s.split, "revision": s.revision, "commit": c}
        for s, c in zip(sources, commits)
        if s.is_hub
    ]


def load_sources(
    sources: Sequence[DataSource],
    field: str = "data",
    *,
    format: str = "auto",
    seed: int = 0,
    stopping_strategy: str = "all_exhausted",
    commits: Sequence[str | None] | None = None,
) -> Loaded:
    """Read every source in memory; with weights, mix them (:mod:`~memfit.train.data.mixing`).

    ``commits``: read each Hub source at this commit (a resumed run's), instead of asking the Hub.
    Raises :class:`~memfit.train.data.errors.DataError` (the first source with problems: all of its).
    """
    check_format(format, Problems())
    per_source, formats, used, notes = [], [], [], []
    for index, source in enumerate(sources):
        name = field_name(field, index, len(sources))
        revision = _revision(source, name, commits, index)
        records, fmt = read_source(source, name, format=source.format or format, revision=revision)
        per_source.append(records)
        formats.append(fmt)
        used.append(revision.commit if revision else None)
        notes += [revision.note(source, name)] if revision and revision.cache_only else []
    weights = normalized_weights(list(sources))
    if weights is None:
        records = [record for part in per_source for record in part]
    else:
        from memfit.train.data.mixing import mix_records

        records = mix_records(per_source, weights, seed, stopping_strategy)
    return Loaded(records, formats, used, notes)


def read_source(
    source: DataSource, name: str, *, format: str = "auto", revision=None
) -> tuple[list[dict[str, Any]], str]:
    """One source's records, normalized, and its format. ``revision``: a Hub source's
    (:class:`~memfit.train.data.hf_datasets.HubRevision`). Raises DataError listing its problems."""
    if not (source.is_hub or source.is_saved_dataset):
        return _read_local(source, name, format)
    from memfit.train.data.hf_datasets import open_dataset

    dataset = open_dataset(source, name, streaming=False, revision=revision)
    label = source.label()
    raw = [
        map_columns(RawRecord(f"{label}, row {i}", row, "hub"), source.columns)
        for i, row in enumerate(dataset, start=1)
    ]
    problems = Problems()
    if not raw:
        raise _no_records(source, name)
    fmt = format if format != "auto" else detect_format(raw[0], problems)
    records = normalize_records(raw, fmt, problems) if fmt is not None else []
    problems.raise_if_any()
    return records, fmt


def _read_local(source: DataSource, name: str, format: str) -> tuple[list[dict[str, Any]], str]:
    """A local file's or folder's records (a folder laid out as a Hub dataset repository: its split's,
    :mod:`~memfit.train.data.folders`). A slice or a sum of splits (``train[:1000]``, ``train+test``)
    reads each split named whole, then cuts as ``datasets`` cuts."""
    from memfit.train.data.folders import is_plain_split, split_files
    from memfit.train.data.formats import load_records

    files, spec = split_files(source, name), split_spec(source)
    if is_plain_split(spec):
        return load_records(next(iter(files.values())), format, columns=source.columns, name=name)
    parts = {split: load_records(paths, format, columns=source.columns, name=name) for split, paths in files.items()}
    kinds = {split: fmt for split, (_, fmt) in parts.items()}
    if len(set(kinds.values())) > 1:
        held = ", ".join(f"{split} holds {fmt}" for split, fmt in kinds.items())
        raise DataError(
            f"{name}: split: {spec!r}: the splits hold records of different formats ({held}); read one split"
        )
    from datasets import ReadInstruction

    try:
        cuts = ReadInstruction.from_spec(spec).to_absolute(
            {split: len(records) for split, (records, _) in parts.items()}
        )
    except (ValueError, AssertionError) as err:
        raise DataError(
            f"{name}: split: {spec!r}: {err} (e.g. split: train[:1000], train[:5%] or train+test)"
        ) from None
    records = [record for cut in cuts for record in parts[cut.splitname][0][cut.from_ : cut.to]]
    if not records:
        raise DataError(f"{name}: split: {spec!r} selects no record of {source.path}: widen the slice")
    return records, next(iter(kinds.values()))


def _revision(source: DataSource, name: str, commits: Sequence[str | None] | None, index: int):
    """A Hub source's :class:`~memfit.train.data.hf_datasets.HubRevision` (None for a local one): at the
    commit a resumed run recorded, if any."""
    if not source.is_hub:
        return None
    from memfit.train.data.hf_datasets import hub_revision

    pinned = commits[index] if commits is not None and index < len(commits) and commits[index] else None
    return hub_revision(source, name, pinned)


@dataclass
class Stream:
    """The sources of a run opened as one stream: the encoded rows, how a row becomes an example,
    the examples of the rows checked at the start, and what was read (formats, Hub commits)."""

    dataset: Any
    formats: list[str]
    commits: list[str | None]
    examples: list[dict[str, Any]]
    settings: dict[str, Any]
    tokenize: Any  # record -> example | None
    labels: list[str]
    notes: list[str] = field(default_factory=list)  # what a run prints about its sources (a Hub dataset from the cache)

    def to_example(self, encoded: str) -> tuple[dict[str, Any] | None, str | None]:
        """An encoded row (:func:`~memfit.train.data.stream.encode_rows`) as a training example:
        (example or None, why the row is not valid or None)."""
        from memfit.train.data.chat import ChatTemplateError

        source, values = json.loads(encoded)
        problems = Problems(max_listed=1)
        where = f"{self.labels[source]}, a row of the stream"
        record = normalize_record(RawRecord(where, values, "hub"), self.formats[source], problems)
        if record is None:
            return None, problems.listed[0] if problems.listed else f"{where}: not valid"
        try:
            return self.tokenize(record), None
        except ChatTemplateError as err:
            return None, f"{record['source']}: {err}"

    def batches(self, batch_size: int, *, seed: int, shuffle_buffer_size: int, packer=None):
        """The run's batches (:class:`~memfit.train.data.stream.StreamBatches`)."""
        from memfit.train.data.stream import StreamBatches

        settings = {**self.settings, "packing": packer is not None}
        return StreamBatches(
            self.dataset,
            self.to_example,
            batch_size,
            seed=seed,
            shuffle_buffer_size=shuffle_buffer_size,
            packer=packer,
            settings=settings,
            examples=self.examples,
        )


def open_stream(
    sources: Sequence[DataSource],
    field: str = "data",
    *,
    tokenize,
    format: str = "auto",
    seed: int = 0,
    stopping_strategy: str = "all_exhausted",
    commits: Sequence[str | None] | None = None,
) -> Stream:
    """Open every source as a stream and mix them into one; check the first :data:`CHECK_ROWS`
    rows of each (format, columns, fields, tokenization) before anything else runs.

    ``tokenize``: a normalized record -> an example, or None when no token of it is trained.
    Raises :class:`~memfit.train.data.errors.DataError`.
    """
    from memfit.train.data.hf_datasets import open_dataset
    from memfit.train.data.mixing import mix_streams
    from memfit.train.data.stream import encode_rows

    check_format(format, Problems())
    encoded, formats, used, examples, labels, notes = [], [], [], [], [], []
    for index, source in enumerate(sources):
        name = field_name(field, index, len(sources))
        revision = _revision(source, name, commits, index)
        dataset = open_dataset(source, name, streaming=True, revision=revision)
        fmt, checked = _check_first_rows(dataset, source, name, format=source.format or format, tokenize=tokenize)
        encoded.append(encode_rows(dataset, index, dict(source.columns), FIELDS))
        formats.append(fmt)
        used.append(revision.commit if revision else None)
        notes += [revision.note(source, name)] if revision and revision.cache_only else []
        examples += checked
        labels.append(source.label())
    mixed = mix_streams(encoded, normalized_weights(list(sources)), seed, stopping_strategy)
    settings = {
        "sources": [s.model_dump(mode="json") for s in sources],
        "formats": formats,
        "stopping_strategy": stopping_strategy,
    }
    return Stream(mixed, formats, used, examples, settings, tokenize, labels, notes)


def _check_first_rows(
    dataset, source: DataSource, name: str, *, format: str, tokenize
) -> tuple[str, list[dict[str, Any]]]:
    """(the source's format, the examples of its first rows), or DataError for their problems."""
    from memfit.train.data.chat import ChatTemplateError

    label = source.label()
    try:
        raw = [
            map_columns(RawRecord(f"{label}, row {i}", row, "hub"), source.columns)
            for i, row in enumerate(_first(dataset, CHECK_ROWS), start=1)
        ]
    except Exception as err:  # noqa: BLE001 - pyarrow and datasets raise many types for a file they cannot read
        text = str(err).strip().splitlines()[0] if str(err).strip() else "no message"
        raise DataError(f"{name}: {label}: cannot read its first rows ({type(err).__name__}: {text})") from None
    problems = Problems()
    if not raw:
        raise _no_records(source, name)
    fmt = format if format != "auto" else detect_format(raw[0], problems)
    records = normalize_records(raw, fmt, problems) if fmt is not None else []
    examples = []
    for record in records:
        try:
            example = tokenize(record)
        except ChatTemplateError as err:
            problems.add(record["source"], str(err))
            continue
        if example is not None:
            examples.append(example)
    problems.raise_if_any(f"the first {len(raw)} rows of {label}")
    assert fmt is not None
    return fmt, examples


def _no_records(source: DataSource, name: str) -> DataError:
    split = f" in split {split_spec(source)!r}" if source.is_hub or source.split else ""
    return DataError(
        f"{name}: {source.label()}: no records{split}: give a source that holds records, or leave it out of {name}"
    )


def _first(dataset, count: int) -> Iterable[dict[str, Any]]:
    return islice(iter(dataset), count)
