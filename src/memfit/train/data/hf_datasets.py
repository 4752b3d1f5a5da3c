"""Data read through the Hugging Face ``datasets`` library: Hub datasets (``org/name``), Parquet and
Arrow files, folders written by ``save_to_disk``, and every source of a stream.

``datasets`` does the work with its own settings: its cache (``HF_DATASETS_CACHE``, by default
``~/.cache/huggingface/datasets``), ``HF_HUB_OFFLINE``, ``HF_TOKEN`` and ``HF_ENDPOINT``. memfit
adds two things around it:

- a Hub dataset's revision is first resolved to a commit (one API call, as for models), and the
  dataset is read at that commit, so a run records the commit it trained on and a resumed run reads
  the same files; when that call finds the Hub offline or unreachable, the dataset is read from the
  datasets cache only, at once, instead of datasets asking again for every file with retries
  (:func:`hub_revision`);
- every way loading can fail becomes one :class:`DataError` line naming the config field, the
  dataset, what is wrong and the fix (``data: org/name: no split 'train'; its splits are ...``).

``datasets`` is imported inside these functions only: a run on local JSON files never pays for it.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from dataclasses import dataclass

from memfit.train.data.errors import DataError
from memfit.train.data.folders import DEFAULT_SPLIT, is_plain_split, split_files, split_spec
from memfit.train.data.formats import column_problem
from memfit.train.data.sources import DataSource

#: Builders of the ``datasets`` library for local files, by memfit's file type.
BUILDERS = {"json": "json", "jsonl": "json", "csv": "csv", "parquet": "parquet", "arrow": "arrow"}


@dataclass(frozen=True)
class HubRevision:
    """What the Hub said of a Hub source: the commit to read it at (None: not known, datasets
    resolves the revision itself) and, when only the datasets cache may be read, why
    (``HF_HUB_OFFLINE=1 is set``, ``cannot reach https://...``)."""

    commit: str | None
    cache_only: str | None = None

    def note(self, source: DataSource, name: str) -> str | None:
        """The line a run prints when it reads this source from the cache (None: the Hub answered)."""
        return (
            f"{name}: {source.path}: {self.cache_only}: reading the copy in the datasets cache"
            if self.cache_only
            else None
        )


def open_dataset(source: DataSource, name: str, *, streaming: bool, revision: HubRevision | None = None):
    """The rows of ``source`` as a ``datasets`` Dataset (``streaming``: an IterableDataset), with
    its columns checked against ``source.columns``.

    ``name`` is the config field that names the source (``data``, ``data[1]``), for messages;
    ``revision``: what :func:`hub_revision` found for a Hub source (its commit; the cache only).
    Raises :class:`DataError`.
    """
    datasets = _import_datasets(name)
    revision = revision or HubRevision(None)
    try:
        if source.is_hub:
            with _cache_only(revision.cache_only is not None):
                dataset = datasets.load_dataset(
                    source.path,
                    name=source.subset,
                    split=split_spec(source),
                    revision=revision.commit or source.revision,
                    streaming=streaming,
                )
        elif source.is_saved_dataset:
            dataset = _saved_split(datasets.load_from_disk(source.path), source, name, split_spec(source))
            if streaming:
                dataset = dataset.to_iterable_dataset()
        else:
            dataset = local_files(source, name)
    except DataError:
        raise
    except Exception as err:  # noqa: BLE001 - datasets raises many types; each is turned into one line
        raise load_error(err, source, name, cache_only=revision.cache_only) from None
    check_columns(dataset, source, name)
    return dataset


def local_files(source: DataSource, name: str):
    """The data files of a local source's split (a file; a folder's files, or the files of its split
    when it is laid out as a Hub dataset repository: :mod:`~memfit.train.data.folders`) as a
    ``datasets`` IterableDataset: the files are read in place, without the copy ``datasets`` would
    otherwise write into its cache."""
    datasets = _import_datasets(name)
    from memfit.train.data.readers import SUFFIXES, emptiness

    spec = split_spec(source)
    if not is_plain_split(spec):
        raise DataError(
            f"{name}: split: {spec!r}: a stream reads whole splits; read a slice or a sum of splits in memory "
            "(remove streaming), or give one split's name"
        )
    files = []
    for path in (p for paths in split_files(source, name).values() for p in paths):
        found = (
            sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in SUFFIXES)
            if path.is_dir()
            else [path]
        )
        if not found:
            raise DataError(f"{name}: {path} holds no data files ({', '.join(SUFFIXES)})")
        files += found
    for path in files:
        if path.suffix.lower() not in SUFFIXES:
            raise DataError(
                f"{name}: {path}: unsupported file type {path.suffix or '(no suffix)'!r}; use one of {', '.join(SUFFIXES)}"
            )
        empty = emptiness(path, SUFFIXES[path.suffix.lower()])
        if empty is not None:
            raise DataError(f"{name}: {path}: {empty}: give a file with records, or leave it out of {name}")
    kinds = sorted({SUFFIXES[p.suffix.lower()] for p in files})
    if len(kinds) > 1:
        raise DataError(
            f"{name}: {source.path} holds files of several types ({', '.join(kinds)}); a stream reads one type: "
            "give each type as a source of its own"
        )
    return datasets.load_dataset(BUILDERS[kinds[0]], data_files=[str(p) for p in files], split="train", streaming=True)


def _saved_split(saved, source: DataSource, name: str, split: str):
    """The split of a ``load_from_disk`` result (a Dataset has one; a DatasetDict one per name)."""
    if not hasattr(saved, "keys"):
        return saved
    if split not in saved:
        raise DataError(
            f"{name}: {source.path}: no split {split!r}; its splits are {', '.join(saved)}: set split: "
            f"{next(iter(saved), 'train')}"
        )
    return saved[split]


def check_columns(dataset, source: DataSource, name: str) -> None:
    """Raise one line when ``source.columns`` names a column the dataset does not have."""
    if not source.columns:
        return
    columns = dataset.column_names
    if columns is None:  # a stream whose features are known only once read: its first row says
        first = next(iter(dataset), None)
        columns = list(first) if isinstance(first, dict) else []
    problem = column_problem(source.columns, columns, "the dataset")
    if problem:
        raise DataError(f"{name}: {source.path}: {problem}")


def hub_revision(source: DataSource, name: str, pinned: str | None = None) -> HubRevision:
    """Ask the Hub (one API call) which commit ``source``'s revision (or ``pinned``, a resumed run's
    commit) is at, so every file is read from it. When the Hub cannot be asked (HF_HUB_OFFLINE or
    HF_DATASETS_OFFLINE set) or does not answer (no network, a server error), the source is read
    from the datasets cache only, at once: datasets would otherwise ask again for each file, five
    times with waits between (26 s), before it read the cache. Raises :class:`DataError` for a
    dataset or revision that does not exist, or a rejected token."""
    from huggingface_hub import HfApi, constants

    _import_datasets(name)  # its own offline setting (HF_DATASETS_OFFLINE) is read at import
    if _offline_mode():
        return HubRevision(pinned, f"{_offline_variable()} is set")
    try:
        timeout = float(getattr(constants, "HF_HUB_ETAG_TIMEOUT", 10) or 10)
        return HubRevision(HfApi().dataset_info(source.path, revision=pinned or source.revision, timeout=timeout).sha)
    except Exception as err:  # noqa: BLE001 - classified below
        kind = _hub_kind(err)
        if kind in ("missing", "revision", "token"):
            raise load_error(err, source, name) from None
        if kind == "network":
            return HubRevision(pinned, f"cannot reach the Hub at {_endpoint()} ({_short(err)})")
        return HubRevision(pinned)  # anything else: datasets may still answer


@contextlib.contextmanager
def _cache_only(on: bool):
    """While on: datasets and huggingface_hub do not ask the Hub. Both read HF_HUB_OFFLINE once, at
    import, into constants of theirs, which are set here for one load and then put back."""
    if not on:
        yield
        return
    import datasets
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE = saved


def _hub_kind(err: BaseException) -> str:
    """What a huggingface_hub or datasets error means: missing, gated, revision, token, offline,
    network (no answer, or a server error: 5xx, 408, 429), other."""
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
    if names & {
        "ConnectionError",
        "ConnectError",
        "ConnectTimeout",
        "ReadTimeout",
        "TimeoutException",
        "LocalEntryNotFoundError",
    }:
        return "network"
    if any(
        type(e).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "requests", "urllib3") for e in _chain(err)
    ):
        return "network"  # the transport's own errors: a connection reset, a server that closed before answering
    status = getattr(getattr(err, "response", None), "status_code", None)
    if status == 401:
        return "token"
    if status is not None and (status >= 500 or status in (408, 429)):
        return "network"
    return "other"


def _chain(err: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while err is not None and err not in seen:
        seen.append(err)
        err = err.__cause__ or err.__context__
    return seen


def load_error(err: BaseException, source: DataSource, name: str, *, cache_only: str | None = None) -> DataError:
    """The one-line :class:`DataError` for an error of ``datasets`` or the Hub loading ``source``;
    ``cache_only``: why only the datasets cache was read (:class:`HubRevision`)."""
    if source.is_hub:
        found = _hub_error(err, source, name, cache_only)
        if found is not None:
            return found
    builder = _builder_error(err, source, name)
    if builder is None and cache_only:
        return not_cached(source, name, cache_only)
    return builder or DataError(
        f"{name}: {source.path}: datasets could not load it ({type(err).__name__}: {_first_line(str(err))})."
    )


def _hub_error(err: BaseException, source: DataSource, name: str, cache_only: str | None = None) -> DataError | None:
    """The line for what the Hub said of ``source`` (None: the error is not the Hub's)."""
    path, endpoint = source.path, _endpoint()
    page = f"{endpoint}/datasets/{path}"
    kind = _hub_kind(err)
    if kind == "gated":
        if _token_in_use():
            fix = (
                f"the token in use (HF_TOKEN or `hf auth login`) has no access yet: request access at {page} with the "
                "account the token belongs to, and run again once it is granted"
            )
        else:
            fix = (
                f"accept its terms at {page} with your Hugging Face account, then set HF_TOKEN to a token of that "
                "account (or run `hf auth login`)"
            )
        return DataError(f"{name}: {path} is gated: {fix}.")
    if kind == "revision":
        return DataError(
            f"{name}: {path}: revision {source.revision!r} does not exist: give a branch, a tag or a full "
            f"commit sha from {page}/commits/main, or leave revision out for main."
        )
    if kind == "missing":
        return DataError(
            f"{name}: {path!r} is not a dataset on {endpoint}: check the id (org/name, as in the dataset "
            f"page's address {endpoint}/datasets/org/name), or for a private dataset set HF_TOKEN to a "
            "token that can read it (or run `hf auth login`)."
        )
    if kind == "token":
        return DataError(
            f"{name}: {endpoint} rejected the token in use (HF_TOKEN or `hf auth login`) for {path}: it is "
            f"invalid or expired. Create a new one at {endpoint}/settings/tokens and set HF_TOKEN to it."
        )
    if kind in ("offline", "network"):
        reason = cache_only or (
            f"{_offline_variable()} is set" if _offline_mode() else f"cannot reach the Hub at {endpoint}"
        )
        return not_cached(source, name, reason)
    return None


def not_cached(source: DataSource, name: str, reason: str) -> DataError:
    """The line for a Hub dataset that only the datasets cache could have given, and does not hold."""
    where = f"{name}: {source.path}: {reason}, and the dataset is not in the datasets cache at {_cache()}"
    if "OFFLINE" in reason:
        variable = reason.split("=")[0]
        return DataError(f"{where}: unset {variable} to download it once.")
    return DataError(
        f"{where}: connect to the network and run again; or load it once where there is network, copy that "
        "cache here and set HF_HUB_OFFLINE=1 (or HF_DATASETS_OFFLINE=1) to read it without asking the Hub; or "
        "give a local path (the dataset's files, or a folder of them)."
    )


def _builder_error(err: BaseException, source: DataSource, name: str) -> DataError | None:
    """The line for a split, a subset or data files ``datasets`` did not find (None: none of these)."""
    path, text = source.path, str(err)
    found = re.search(
        r"(?:Unknown split \"[^\"]*\"\. Should be one of|Bad split: .*?\. Available splits:) \[(.*?)\]", text
    )
    if found:
        splits = _names(found.group(1))
        return DataError(
            f"{name}: {path}: no split {source.split or DEFAULT_SPLIT!r}; its splits are {', '.join(splits)}: "
            f"set split: {splits[0] if splits else 'train'}"
        )
    found = re.search(r"Config name is missing.*?available configs: \[(.*?)\]", text, re.S)
    if found:
        subsets = _names(found.group(1))
        return DataError(
            f"{name}: {path}: the dataset has several subsets ({', '.join(subsets)}); choose one, e.g. subset: {subsets[0]}"
        )
    found = re.search(r"BuilderConfig '(.*?)' not found\. Available: \[(.*?)\]", text)
    if found:
        subsets = _names(found.group(2))
        return DataError(
            f"{name}: {path}: no subset {found.group(1)!r}; its subsets are {', '.join(subsets)}: set subset: {subsets[0]}"
        )
    if type(err).__name__ in ("DataFilesNotFoundError", "EmptyDatasetError"):
        return DataError(f"{name}: {path}: no data files that datasets can read ({_first_line(text)}).")
    return None


def _names(listed: str) -> list[str]:
    return [part.strip().strip("'\"") for part in listed.split(",") if part.strip()]


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "no message"


def _import_datasets(name: str):
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{name}: reading Hub datasets, Parquet and Arrow files and streams needs the datasets library: "
            "pip install datasets"
        ) from None
    return datasets


def _offline_mode() -> bool:
    """Whether HF_HUB_OFFLINE is in effect, for huggingface_hub or for datasets (each reads it at import;
    datasets also from HF_DATASETS_OFFLINE)."""
    from huggingface_hub import constants

    datasets = sys.modules.get("datasets")  # imported by the load that failed, if it got that far
    return bool(
        getattr(constants, "HF_HUB_OFFLINE", False) or (datasets is not None and datasets.config.HF_HUB_OFFLINE)
    )


def _offline_variable() -> str:
    """The setting that makes datasets offline, as the user wrote it."""
    from huggingface_hub import constants

    if not getattr(constants, "HF_HUB_OFFLINE", False) and os.environ.get("HF_DATASETS_OFFLINE", "").upper() in (
        "1",
        "ON",
        "YES",
        "TRUE",
    ):
        return "HF_DATASETS_OFFLINE=1"
    return "HF_HUB_OFFLINE=1"


def _short(err: BaseException) -> str:
    text = _first_line(str(err))
    return type(err).__name__ if text == "no message" else f"{type(err).__name__}: {text}"


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
