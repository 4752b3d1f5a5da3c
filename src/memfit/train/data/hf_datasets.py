"""Data read through the Hugging Face ``datasets`` library: Hub datasets (``org/name``), Parquet and
Arrow files, folders written by ``save_to_disk``, and every source of a stream.

``datasets`` does the work with its own settings: its cache (``HF_DATASETS_CACHE``, by default
``~/.cache/huggingface/datasets``), ``HF_HUB_OFFLINE``, ``HF_TOKEN`` and ``HF_ENDPOINT``. memfit
adds two things around it:

- a Hub dataset's revision is first resolved to a commit (one API call, as for models), and the
  dataset is read at that commit, so a run records the commit it trained on and a resumed run reads
  the same files (:func:`hub_commit`);
- every way loading can fail becomes one :class:`DataError` line naming the config field, the
  dataset, what is wrong and the fix (``data: org/name: no split 'train'; its splits are ...``).

``datasets`` is imported inside these functions only: a run on local JSON files never pays for it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from memfit.train.data.errors import DataError
from memfit.train.data.sources import DataSource

#: The split read when a source names none (what ``load_dataset`` users mean by default).
DEFAULT_SPLIT = "train"
#: Builders of the ``datasets`` library for local files, by memfit's file type.
BUILDERS = {"json": "json", "jsonl": "json", "csv": "csv", "parquet": "parquet", "arrow": "arrow"}


def open_dataset(source: DataSource, name: str, *, streaming: bool, commit: str | None = None):
    """The rows of ``source`` as a ``datasets`` Dataset (``streaming``: an IterableDataset), with
    its columns checked against ``source.columns``.

    ``name`` is the config field that names the source (``data``, ``data[1]``), for messages;
    ``commit``: read a Hub dataset at this commit (see :func:`hub_commit`). Raises :class:`DataError`.
    """
    datasets = _import_datasets(name)
    split = source.split or DEFAULT_SPLIT
    try:
        if source.is_hub:
            dataset = datasets.load_dataset(source.path, name=source.subset, split=split,
                                            revision=commit or source.revision, streaming=streaming)
        elif source.is_saved_dataset:
            dataset = _saved_split(datasets.load_from_disk(source.path), source, name, split)
            if streaming:
                dataset = dataset.to_iterable_dataset()
        else:
            dataset = local_files(source.path, name, streaming=True)
    except DataError:
        raise
    except Exception as err:  # noqa: BLE001 - datasets raises many types; each is turned into one line
        raise load_error(err, source, name) from None
    check_columns(dataset, source, name)
    return dataset


def local_files(path: str | Path, name: str, *, streaming: bool = True):
    """The data files of a local path (a file, or a folder's files of one type) as a ``datasets``
    dataset. Read as a stream even when all of it is wanted: the files are read in place, without
    the copy ``datasets`` would otherwise write into its cache."""
    datasets = _import_datasets(name)
    from memfit.train.data.readers import SUFFIXES

    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in SUFFIXES) if path.is_dir() else [path]
    kinds = sorted({SUFFIXES[p.suffix.lower()] for p in files})
    if not files:
        raise DataError(f"{name}: {path} holds no data files ({', '.join(SUFFIXES)})")
    if len(kinds) > 1:
        raise DataError(f"{name}: {path} holds files of several types ({', '.join(kinds)}); a stream reads one type: "
                        "give each type as a source of its own")
    return datasets.load_dataset(BUILDERS[kinds[0]], data_files=[str(p) for p in files], split="train", streaming=streaming)


def _saved_split(saved, source: DataSource, name: str, split: str):
    """The split of a ``load_from_disk`` result (a Dataset has one; a DatasetDict one per name)."""
    if not hasattr(saved, "keys"):
        return saved
    if split not in saved:
        raise DataError(f"{name}: {source.path}: no split {split!r}; its splits are {', '.join(saved)}: set split: "
                        f"{next(iter(saved), 'train')}")
    return saved[split]


def check_columns(dataset, source: DataSource, name: str) -> None:
    """Raise one line when ``source.columns`` names a column the dataset does not have."""
    if not source.columns:
        return
    columns = dataset.column_names
    if columns is None:  # a stream whose features are known only once read: its first row says
        first = next(iter(dataset), None)
        columns = list(first) if isinstance(first, dict) else []
    for field_name, column in source.columns.items():
        if column not in columns:
            listed = ", ".join(map(str, columns)) or "none"
            example = next((c for c in columns if c not in source.columns.values()), columns[0] if columns else "column")
            raise DataError(f"{name}: {source.path}: columns: {field_name}: no column {column!r} in the dataset (its columns: "
                            f"{listed}); map {field_name} to one of them, e.g. columns: {{{field_name}: {example}}}")


def hub_commit(source: DataSource, name: str) -> str | None:
    """The commit ``source``'s revision is at on the Hub (one API call), so every file is read from
    it. None when the Hub cannot be asked (offline, no network): ``datasets`` then reads its cache.
    Raises :class:`DataError` for a dataset or revision that does not exist."""
    from huggingface_hub import HfApi, constants

    if source.revision is not None and re.fullmatch(r"[0-9a-f]{40}", source.revision):
        return source.revision
    try:
        timeout = float(getattr(constants, "HF_HUB_ETAG_TIMEOUT", 10) or 10)
        return HfApi().dataset_info(source.path, revision=source.revision, timeout=timeout).sha
    except Exception as err:  # noqa: BLE001 - classified below
        kind = _hub_kind(err)
        if kind in ("missing", "revision", "token"):
            raise load_error(err, source, name) from None
        return None  # offline, unreachable, or anything datasets may still answer from its cache


def _hub_kind(err: BaseException) -> str:
    """What a huggingface_hub or datasets error means: missing, gated, revision, token, network, other."""
    names = {type(e).__name__ for e in _chain(err)}
    text = " ".join(str(e) for e in _chain(err))
    if "GatedRepoError" in names or "is a gated dataset" in text:
        return "gated"
    if "RevisionNotFoundError" in names or re.search(r"Revision '.*' doesn't exist", text):
        return "revision"
    if "RepositoryNotFoundError" in names or "DatasetNotFoundError" in names:
        return "missing"
    if "OfflineModeIsEnabled" in names or "HF_HUB_OFFLINE" in text:
        return "offline"
    if names & {"ConnectionError", "ConnectError", "ConnectTimeout", "ReadTimeout", "TimeoutException", "LocalEntryNotFoundError"}:
        return "network"
    status = getattr(getattr(err, "response", None), "status_code", None)
    if status == 401:
        return "token"
    return "other"


def _chain(err: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while err is not None and err not in seen:
        seen.append(err)
        err = err.__cause__ or err.__context__
    return seen


def load_error(err: BaseException, source: DataSource, name: str) -> DataError:
    """The one-line :class:`DataError` for an error of ``datasets`` or the Hub loading ``source``."""
    path, text = source.path, str(err)
    endpoint = _endpoint()
    page = f"{endpoint}/datasets/{path}"
    if source.is_hub:
        kind = _hub_kind(err)
        if kind == "gated":
            if _token_in_use():
                fix = (f"the token in use (HF_TOKEN or `hf auth login`) has no access yet: request access at {page} with the "
                       "account the token belongs to, and run again once it is granted")
            else:
                fix = (f"accept its terms at {page} with your Hugging Face account, then set HF_TOKEN to a token of that "
                       "account (or run `hf auth login`)")
            return DataError(f"{name}: {path} is gated: {fix}.")
        if kind == "revision":
            return DataError(f"{name}: {path}: revision {source.revision!r} does not exist: give a branch, a tag or a full "
                             f"commit sha from {page}/commits/main, or leave revision out for main.")
        if kind == "missing":
            return DataError(f"{name}: {path!r} is not a dataset on {endpoint}: check the id (org/name, as in the dataset "
                             f"page's address {endpoint}/datasets/org/name), or for a private dataset set HF_TOKEN to a "
                             "token that can read it (or run `hf auth login`).")
        if kind == "token":
            return DataError(f"{name}: {endpoint} rejected the token in use (HF_TOKEN or `hf auth login`) for {path}: it is "
                             f"invalid or expired. Create a new one at {endpoint}/settings/tokens and set HF_TOKEN to it.")
        if kind in ("offline", "network"):
            kind = "offline" if _offline_mode() else kind
            reason = "HF_HUB_OFFLINE=1 is set" if kind == "offline" else f"cannot reach {endpoint}"
            fix = ("unset HF_HUB_OFFLINE to download it once" if kind == "offline" else
                   "connect and run again, or load it once where there is network and copy that cache here")
            return DataError(f"{name}: {path}: {reason}, and the dataset is not in the datasets cache at {_cache()}: {fix}.")
    found = re.search(r"(?:Unknown split \"[^\"]*\"\. Should be one of|Bad split: .*?\. Available splits:) \[(.*?)\]", text)
    if found:
        splits = _names(found.group(1))
        return DataError(f"{name}: {path}: no split {source.split or DEFAULT_SPLIT!r}; its splits are {', '.join(splits)}: "
                         f"set split: {splits[0] if splits else 'train'}")
    found = re.search(r"Config name is missing.*?available configs: \[(.*?)\]", text, re.S)
    if found:
        subsets = _names(found.group(1))
        return DataError(f"{name}: {path}: the dataset has several subsets ({', '.join(subsets)}); choose one, e.g. subset: {subsets[0]}")
    found = re.search(r"BuilderConfig '(.*?)' not found\. Available: \[(.*?)\]", text)
    if found:
        subsets = _names(found.group(2))
        return DataError(f"{name}: {path}: no subset {found.group(1)!r}; its subsets are {', '.join(subsets)}: set subset: {subsets[0]}")
    if type(err).__name__ in ("DataFilesNotFoundError", "EmptyDatasetError"):
        return DataError(f"{name}: {path}: no data files that datasets can read ({_first_line(text)}).")
    return DataError(f"{name}: {path}: datasets could not load it ({type(err).__name__}: {_first_line(text)}).")


def _names(listed: str) -> list[str]:
    return [part.strip().strip("'\"") for part in listed.split(",") if part.strip()]


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "no message"


def _import_datasets(name: str):
    try:
        import datasets
    except ImportError:
        raise DataError(f"{name}: reading Hub datasets, Parquet and Arrow files and streams needs the datasets library: "
                        "pip install datasets") from None
    return datasets


def _offline_mode() -> bool:
    """Whether HF_HUB_OFFLINE is in effect, for huggingface_hub or for datasets (each reads it at import)."""
    from huggingface_hub import constants

    datasets = sys.modules.get("datasets")  # imported by the load that failed, if it got that far
    return bool(getattr(constants, "HF_HUB_OFFLINE", False) or (datasets is not None and datasets.config.HF_HUB_OFFLINE))


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT.rstrip("/")


def _cache() -> str:
    import datasets

    return str(datasets.config.HF_DATASETS_CACHE)


def _token_in_use() -> bool:
    try:
        from huggingface_hub import get_token

        return bool(get_token())
    except Exception:  # noqa: BLE001 - a broken token store only changes the wording
        return False
