"""Local folders laid out as a Hub dataset repository: their subsets and splits, found as
``datasets.load_dataset(folder)`` finds them, and the files of the split a source asks for.

``datasets`` reads a folder's ``README.md`` front matter ``configs:`` (each subset's
``data_files`` per split, or its ``data_dir``), or else names the splits from the files' names and
folders: ``data/train-00000-of-00001.parquet`` and ``data/test-00000-of-00001.parquet``,
``train.jsonl`` and ``test.jsonl``, ``train/part-0.csv`` (the patterns of
``datasets.data_files.get_data_patterns``). memfit resolves a folder with those same functions and
reads the files of the chosen split with its own readers (a JSON Lines file's problems keep their
line numbers): the ``train`` split unless the source gives ``split`` (and ``subset``), so a
repository cloned from the Hub trains on its training split, not on its test split too.

A folder whose files name no split and whose README declares no ``configs`` is one split, ``train``:
its data files, sorted, not recursive.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from memfit.train.data.errors import DataError
from memfit.train.data.readers import SUFFIXES
from memfit.train.data.sources import DataSource

#: The split read when a source names none (what ``load_dataset`` users mean by default).
DEFAULT_SPLIT = "train"
#: The README a folder declares its subsets in, and the standalone YAML ``datasets`` reads beside it.
README = "README.md"
STANDALONE_YAML = ".huggingface.yaml"


def split_spec(source: DataSource) -> str:
    """The split a source reads: its ``split`` (a name, a slice ``train[:1000]``, a sum ``train+test``) or ``train``."""
    return (source.split or DEFAULT_SPLIT).strip()


def split_names(spec: str) -> list[str]:
    """The split names of a split spec: ``train[:10%]+test`` -> ``[train, test]``."""
    return [part.split("[")[0].split("(")[0].strip() for part in spec.split("+")]


def is_plain_split(spec: str) -> bool:
    """True when ``spec`` names one whole split (no slice, no sum)."""
    return re.fullmatch(r"[\w.-]+", spec) is not None


def folder_splits(folder: Path, subset: str | None, name: str) -> dict[str, list[Path]]:
    """The data files of each split of ``folder`` (of ``subset``, for a folder whose README declares
    several), as ``datasets`` resolves them; a plain folder is ``{"train": [folder]}`` (its files are
    read as before: sorted, not recursive). Raises :class:`DataError` naming ``name`` (the config
    field), the folder and the fix."""
    found = _patterns(folder, subset, name)
    if found is None:
        if subset is not None:
            raise DataError(
                f"{name}: subset: {subset!r}: {folder} declares no subsets (no configs: in the front matter of "
                f"a {README}); remove subset, or declare it as datasets reads it (docs/data.md)"
            )
        return {DEFAULT_SPLIT: [folder]}
    base, patterns = found
    from datasets.data_files import DataFilesDict

    try:
        resolved = DataFilesDict.from_patterns(patterns, base_path=str(base), allowed_extensions=list(SUFFIXES))
    except FileNotFoundError as err:
        raise DataError(
            f"{name}: {folder}: {_first_line(str(err))}; the files of each split must be data files memfit "
            f"reads ({', '.join(SUFFIXES)})"
        ) from None
    return {str(split): [Path(p) for p in files] for split, files in resolved.items()}


def split_files(source: DataSource, name: str) -> dict[str, list[Path]]:
    """The files of each split a local source's split spec names (in the spec's order), checked: a
    split the folder does not have is refused with the ones it has. A local file is its own ``train``
    split."""
    path = Path(source.path).expanduser()
    spec = split_spec(source)
    splits = folder_splits(path, source.subset, name) if path.is_dir() else {DEFAULT_SPLIT: [path]}
    wanted = split_names(spec)
    for split in wanted:
        if split not in splits:
            raise DataError(
                f"{name}: {source.path}: no split {split!r}; its splits are {', '.join(splits)}: set split: "
                f"{next(iter(splits))}"
            )
    return {split: splits[split] for split in dict.fromkeys(wanted)}


def _patterns(folder: Path, subset: str | None, name: str) -> tuple[Path, dict[str, list[str]]] | None:
    """(the folder the patterns are relative to, split -> data-file patterns), or None for a plain
    folder: the README's ``configs:`` first, else the patterns ``datasets`` infers from the names."""
    from datasets.data_files import DEFAULT_PATTERNS_ALL, EmptyDatasetError, get_data_patterns, sanitize_patterns

    configs = _configs(folder, name)
    if configs:
        chosen = _subset(configs, subset, folder, name)
        params = configs[chosen]
        base = folder / params["data_dir"] if params.get("data_dir") else folder
        if params.get("data_files") is not None:
            return base, sanitize_patterns(params["data_files"])
    else:
        base = folder
    try:
        patterns = get_data_patterns(str(base))
    except EmptyDatasetError:
        return None  # no files at all: the readers say the folder holds no data files
    if not configs and patterns == DEFAULT_PATTERNS_ALL:
        return None
    return base, patterns


def _configs(folder: Path, name: str) -> dict[str, dict[str, Any]]:
    """The subsets a folder's README front matter (and ``.huggingface.yaml``) declares, as ``datasets``
    reads them: config name -> its parameters (``data_files``, ``data_dir``, ``default``)."""
    readme, standalone = folder / README, folder / STANDALONE_YAML
    text = readme.read_text(encoding="utf-8", errors="replace") if readme.is_file() else ""
    if not text.startswith("---") and not standalone.is_file():
        return {}  # no front matter: nothing declared (and no "metadata block not found" log line)
    import yaml
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard, DatasetCardData

    try:
        data = DatasetCard(text).data if text.startswith("---") else DatasetCardData()
        if standalone.is_file():
            extra = yaml.safe_load(standalone.read_text(encoding="utf-8")) or {}
            data = DatasetCardData(**{**data.to_dict(), **extra})
        return dict(MetadataConfigs.from_dataset_card_data(data))
    except (ValueError, TypeError, yaml.YAMLError) as err:
        raise DataError(
            f"{name}: {folder}: the configs: of its {README} cannot be read as datasets reads them: "
            f"{_first_line(str(err))}"
        ) from None


def _subset(configs: dict[str, dict[str, Any]], subset: str | None, folder: Path, name: str) -> str:
    """The subset read: the one asked for, else the only one, the one named default, or the one marked ``default: true``."""
    if subset is not None:
        if subset not in configs:
            raise DataError(
                f"{name}: {folder}: no subset {subset!r}; its subsets are {', '.join(configs)}: set subset: "
                f"{next(iter(configs))}"
            )
        return subset
    defaults = [c for c, params in configs.items() if len(configs) == 1 or c == "default" or params.get("default")]
    if len(defaults) != 1:
        raise DataError(
            f"{name}: {folder}: the dataset has several subsets ({', '.join(configs)}); choose one, e.g. subset: "
            f"{next(iter(configs))}"
        )
    return defaults[0]


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "no message"
