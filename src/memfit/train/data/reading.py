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
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Iterable, Sequence

from memfit.train.data.errors import Problems
from memfit.train.data.formats import check_format, detect_format, map_columns, normalize_record, normalize_records
from memfit.train.data.readers import RawRecord
from memfit.train.data.sources import FIELDS, DataSource, field_name, normalized_weights

#: Rows of each streamed source read, checked and tokenized before the run starts: a stream's
#: format, columns and chat template fail there, not hours in.
CHECK_ROWS = 16


@dataclass
class Loaded:
    """Records read in memory, and what was read: each source's format and Hub commit."""

    records: list[dict[str, Any]]
    formats: list[str]
    commits: list[str | None] = field(default_factory=list)


def hub_record(sources: Sequence[DataSource], commits: Sequence[str | None]) -> list[dict[str, Any]]:
    """What a run records of its Hub sources to be reproduced: path, subset, split, revision, commit."""
    return [{"path": s.path, "subset": s.subset, "split": s.split, "revision": s.revision, "commit": c}
            for s, c in zip(sources, commits) if s.is_hub]


def load_sources(sources: Sequence[DataSource], field: str = "data", *, format: str = "auto", seed: int = 0,
                 stopping_strategy: str = "all_exhausted", commits: Sequence[str | None] | None = None) -> Loaded:
    """Read every source in memory; with weights, mix them (:mod:`~memfit.train.data.mixing`).

    ``commits``: read each Hub source at this commit (a resumed run's), instead of asking the Hub.
    Raises :class:`~memfit.train.data.errors.DataError` (the first source with problems: all of its).
    """
    check_format(format, Problems())
    per_source, formats, used = [], [], []
    for index, source in enumerate(sources):
        name = field_name(field, index, len(sources))
        commit = _commit(source, name, commits, index)
        records, fmt = read_source(source, name, format=source.format or format, commit=commit)
        per_source.append(records)
        formats.append(fmt)
        used.append(commit)
    weights = normalized_weights(list(sources))
    if weights is None:
        records = [record for part in per_source for record in part]
    else:
        from memfit.train.data.mixing import mix_records

        records = mix_records(per_source, weights, seed, stopping_strategy)
    return Loaded(records, formats, used)


def read_source(source: DataSource, name: str, *, format: str = "auto", commit: str | None = None) -> tuple[list[dict[str, Any]], str]:
    """One source's records, normalized, and its format. Raises DataError listing its problems."""
    if not (source.is_hub or source.is_saved_dataset):
        from memfit.train.data.formats import load_records

        return load_records(source.path, format, columns=source.columns)
    from memfit.train.data.hf_datasets import open_dataset

    dataset = open_dataset(source, name, streaming=False, commit=commit)
    label = source.label()
    raw = [map_columns(RawRecord(f"{label}, row {i}", row, "hub"), source.columns) for i, row in enumerate(dataset, start=1)]
    problems = Problems()
    if not raw:
        problems.add(label, "no records in this split")
        problems.raise_if_any()
    fmt = format if format != "auto" else detect_format(raw[0], problems)
    records = normalize_records(raw, fmt, problems) if fmt is not None else []
    problems.raise_if_any()
    return records, fmt


def _commit(source: DataSource, name: str, commits: Sequence[str | None] | None, index: int) -> str | None:
    if not source.is_hub:
        return None
    if commits is not None and index < len(commits) and commits[index]:
        return commits[index]
    from memfit.train.data.hf_datasets import hub_commit

    return hub_commit(source, name)


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
        return StreamBatches(self.dataset, self.to_example, batch_size, seed=seed, shuffle_buffer_size=shuffle_buffer_size,
                             packer=packer, settings=settings, examples=self.examples)


def open_stream(sources: Sequence[DataSource], field: str = "data", *, tokenize, format: str = "auto", seed: int = 0,
                stopping_strategy: str = "all_exhausted", commits: Sequence[str | None] | None = None) -> Stream:
    """Open every source as a stream and mix them into one; check the first :data:`CHECK_ROWS`
    rows of each (format, columns, fields, tokenization) before anything else runs.

    ``tokenize``: a normalized record -> an example, or None when no token of it is trained.
    Raises :class:`~memfit.train.data.errors.DataError`.
    """
    from memfit.train.data.hf_datasets import open_dataset
    from memfit.train.data.mixing import mix_streams
    from memfit.train.data.stream import encode_rows

    check_format(format, Problems())
    encoded, formats, used, examples, labels = [], [], [], [], []
    for index, source in enumerate(sources):
        name = field_name(field, index, len(sources))
        commit = _commit(source, name, commits, index)
        dataset = open_dataset(source, name, streaming=True, commit=commit)
        fmt, checked = _check_first_rows(dataset, source, format=source.format or format, tokenize=tokenize)
        encoded.append(encode_rows(dataset, index, dict(source.columns), FIELDS))
        formats.append(fmt)
        used.append(commit)
        examples += checked
        labels.append(source.label())
    mixed = mix_streams(encoded, normalized_weights(list(sources)), seed, stopping_strategy)
    settings = {"sources": [s.model_dump(mode="json") for s in sources], "formats": formats, "stopping_strategy": stopping_strategy}
    return Stream(mixed, formats, used, examples, settings, tokenize, labels)


def _check_first_rows(dataset, source: DataSource, *, format: str, tokenize) -> tuple[str, list[dict[str, Any]]]:
    """(the source's format, the examples of its first rows), or DataError for their problems."""
    from memfit.train.data.chat import ChatTemplateError

    label = source.label()
    raw = [map_columns(RawRecord(f"{label}, row {i}", row, "hub"), source.columns)
           for i, row in enumerate(_first(dataset, CHECK_ROWS), start=1)]
    problems = Problems()
    if not raw:
        problems.add(label, "no records in this split")
        problems.raise_if_any()
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


def _first(dataset, count: int) -> Iterable[dict[str, Any]]:
    return islice(iter(dataset), count)
