"""Where training data comes from: a local file or folder, or a dataset on the Hugging Face Hub.

A source is written in a training config as a string (a path, or a Hub dataset id ``org/name``) or
as a mapping with the options a Hub dataset takes::

    data:
      - path: HuggingFaceH4/ultrachat_200k
        subset: default                       # the dataset's config name
        split: train_sft
        revision: main
        columns: {messages: conversation}     # memfit field <- dataset column
        weight: 0.7
      - path: ./local.jsonl
        weight: 0.3

:func:`as_sources` turns either spelling into :class:`DataSource`; :func:`source_problems` lists
what is wrong with a config's sources without reading any data (cheap: existence checks only).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from memfit.train.data.formats import FORMATS

#: Suffixes of data files: a name ending like this is a file, never a Hub dataset id.
DATA_SUFFIXES = (".json", ".jsonl", ".ndjson", ".csv", ".parquet", ".arrow", ".txt", ".tsv", ".gz", ".zst")
#: The record fields memfit reads, by format; ``columns`` maps dataset columns onto these.
FIELDS = (
    "messages",
    "conversations",
    "instruction",
    "input",
    "output",
    "system",
    "text",
    "prompt",
    "completion",
    "chosen",
    "rejected",
)
#: Files ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` write: a folder holding one is read
#: with ``datasets.load_from_disk``.
SAVED_DATASET_FILES = ("state.json", "dataset_dict.json")


class DataSource(BaseModel):
    """One source of training data: a local path or a Hub dataset id, and how to read it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(description="a local file or folder, or a Hugging Face Hub dataset id (org/name)")
    subset: str | None = Field(
        None, description="the dataset's subset (its config name, as in load_dataset(path, name))"
    )
    split: str | None = Field(
        None, description="the split to read (default train); slices such as train[:1000] without streaming"
    )
    revision: str | None = Field(None, description="branch, tag or commit of a Hub dataset (default main)")
    columns: dict[str, str] = Field(
        default_factory=dict, description="memfit field <- dataset column, e.g. {messages: conversation}"
    )
    weight: float | None = Field(
        None, description="share of this source in a mix of sources (any positive numbers; normalized)"
    )
    format: str | None = Field(None, description="record format of this source (default: data_format)")

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, value: Any) -> Any:
        if isinstance(value, dict):
            known = set(cls.model_fields)
            for key in value:
                if key not in known:
                    close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
                    hint = (
                        f"; did you mean {close[0]!r}?" if close else f"; a source takes {', '.join(cls.model_fields)}"
                    )
                    raise ValueError(f"unknown setting {key!r}{hint}")
        return value

    @field_validator("weight", mode="before")
    @classmethod
    def _weight_not_a_boolean(cls, value: Any) -> Any:
        # pydantic takes true as 1.0; a YAML true where a share belongs is a mistake, not a number.
        if isinstance(value, bool):
            raise ValueError("is true or false, not a number: write the source's share, e.g. weight: 0.7")
        return value

    @property
    def is_hub(self) -> bool:
        """True when :attr:`path` names a Hub dataset (``org/name`` that is not a local path)."""
        return is_dataset_id(self.path)

    @property
    def is_saved_dataset(self) -> bool:
        """True when :attr:`path` is a folder written by ``save_to_disk``."""
        folder = Path(self.path)
        return folder.is_dir() and any((folder / name).is_file() for name in SAVED_DATASET_FILES)

    def label(self) -> str:
        """How messages name this source: the path, with the subset and split of a Hub dataset."""
        details = [
            f"{key} {value}"
            for key, value in (("subset", self.subset), ("split", self.split), ("revision", self.revision))
            if value
        ]
        return f"{self.path} ({', '.join(details)})" if details else self.path


def looks_like_dataset_id(text: str) -> bool:
    """True when ``text`` has the form of a Hub dataset id, ``org/name``, and is not a data file's
    name (``data/train.jsonl`` that does not exist is a mistyped path, not a repo)."""
    from memfit.models.hub import looks_like_hub_id

    return looks_like_hub_id(text) and not str(text).lower().endswith(DATA_SUFFIXES)


def is_dataset_id(text: str) -> bool:
    """True when ``text`` means a Hub dataset: it looks like one and is not a local path."""
    return looks_like_dataset_id(text) and not Path(str(text)).expanduser().exists()


def as_sources(value: str | DataSource | Iterable[str | DataSource] | None) -> list[DataSource]:
    """The sources a config's ``data`` (or ``eval_data``) names, each as a :class:`DataSource`."""
    if value is None:
        return []
    if isinstance(value, (str, Path, DataSource)):
        value = [value]
    return [item if isinstance(item, DataSource) else DataSource(path=str(item)) for item in value]


def field_name(field: str, index: int, count: int) -> str:
    """``data`` for a config's only source, ``data[1]`` for one of several."""
    return field if count == 1 else f"{field}[{index}]"


def source_problems(field: str, value: Any, *, mixing: bool) -> list[str]:
    """What is wrong with the sources of config field ``field`` (``data`` or ``eval_data``), one line
    each, without reading any data. ``mixing``: weights are allowed (training data)."""
    sources = as_sources(value)
    problems: list[str] = []
    for index, source in enumerate(sources):
        name = field_name(field, index, len(sources))
        problems += _one_source_problems(name, source)
    weighted = [s.weight is not None for s in sources]
    if any(weighted):
        if not mixing:
            problems.append(
                f"{field}: weight mixes training sources; evaluation reads every example of each source. Remove weight."
            )
        elif len(sources) < 2:
            problems.append(
                f"{field}: weight only means something in a list of two or more sources. Remove it, or add a source."
            )
        elif not all(weighted):
            missing = [field_name(field, i, len(sources)) for i, w in enumerate(weighted) if not w]
            problems.append(
                f"{', '.join(missing)}: no weight, while other sources have one: give every source a weight "
                "(e.g. 0.7 and 0.3) or none (every example of each, concatenated)."
            )
    return problems


def _one_source_problems(name: str, source: DataSource) -> list[str]:
    problems = []
    local = Path(source.path).expanduser()
    if not source.is_hub and not local.exists():
        problems.append(
            f"{name}: {source.path!r} does not exist: give a local file or folder, or a Hub dataset id (org/name)"
        )
    elif not source.is_hub:
        # A local folder has splits (and subsets) as datasets finds them (memfit.train.data.folders), a
        # folder written by save_to_disk splits only; a file is one split of its own, and only a Hub
        # dataset has revisions.
        kind, takes = (
            ("a folder written by save_to_disk", ("split",))
            if source.is_saved_dataset
            else ("a folder", ("subset", "split"))
            if local.is_dir()
            else ("a file", ())
        )
        for option in ("subset", "split", "revision"):
            if getattr(source, option) is not None and option not in takes:
                where = (
                    "a Hub dataset (org/name)" if option == "revision" else "a Hub dataset (org/name) or a local folder"
                )
                problems.append(f"{name}.{option}: applies to {where}; {source.path!r} is {kind}. Remove {option}.")
    for target, column in source.columns.items():
        if target not in FIELDS:
            close = difflib.get_close_matches(target, FIELDS, n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            problems.append(
                f"{name}.columns: {target!r} is not a field memfit reads ({', '.join(FIELDS)}); write "
                f"{{field: dataset column}}, e.g. {{messages: {column}}}.{hint}"
            )
        elif not isinstance(column, str) or not column:
            problems.append(f"{name}.columns.{target}: {column!r} must be the name of a column of the dataset")
    if source.weight is not None and not (source.weight > 0 and math.isfinite(source.weight)):
        problems.append(
            f"{name}.weight: {source.weight!r} must be a positive number (weights are normalized: 0.7 and 0.3, or 7 and 3)"
        )
    if source.format is not None:
        if source.format not in FORMATS:
            problems.append(f"{name}.format: {source.format!r} is not one of {', '.join(FORMATS)}")
    return problems


def normalized_weights(sources: list[DataSource]) -> list[float] | None:
    """The sources' weights as probabilities summing to 1 (None when they have none)."""
    if not sources or sources[0].weight is None:
        return None
    total = sum(s.weight or 0.0 for s in sources)
    return [(s.weight or 0.0) / total for s in sources]
