"""Models and adapters by their Hugging Face Hub id (``org/name``), through ``huggingface_hub``.

This module turns a Hub id and a revision into local files, and every way that can fail into one
:class:`HubError` line naming the repo, the problem and the fix. It uses huggingface_hub's cache
(``HF_HOME`` / ``HF_HUB_CACHE``), token (``HF_TOKEN`` or ``hf auth login``), ``HF_ENDPOINT`` and
``HF_HUB_OFFLINE`` exactly as huggingface_hub itself does.

What is fetched:

- ``memfit plan`` / ``memfit fit``: ``config.json`` alone (:func:`fetch_config`), never weights;
- ``memfit train`` / ``memfit merge``: ``config.json``, ``generation_config.json``, the tokenizer
  files and the safetensors weights (the index and the shards it names) (:func:`fetch_model`);
  pickled ``.bin`` weights only when the caller opts in, converted once to safetensors
  (:mod:`memfit.models.pickle_weights`);
- a PEFT adapter: ``adapter_config.json`` and ``adapter_model.safetensors``, with the tokenizer
  files a training run saved beside them (:func:`fetch_adapter`).

How: one API call (``model_info`` with file metadata) resolves the revision to a commit and lists
the files with their sizes and SHA-256 digests, so every problem with the repo, the revision or
its files is reported before a byte of weights is downloaded. Each file is then fetched with
``hf_hub_download`` at that commit: all files come from one commit, and a file already in the
cache costs no request. huggingface_hub writes a download to a temporary file and moves it into
the cache only once complete (resuming a dropped connection with a Range request), and a weights
file downloaded here is checked against the SHA-256 the Hub lists before anything uses it. Without
network, or with ``HF_HUB_OFFLINE=1``, the cached snapshot is used when it holds every file needed.

huggingface_hub is imported only inside these functions: only a Hub id pays for it.

This module is the transport alone: what memfit's catalog knows about Hub ids (the shipped copy
of a catalog model's config.json, close names for a repo that does not exist) is in
:mod:`memfit.models.catalog`, which calls this module, never the other way round.
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from memfit.models.config_file import read_config_file
from memfit.models.errors import HubError

#: ``org/name``: the Hub's rules (letters, digits, ``_``, ``-``, ``.``; each part starts and ends
#: with a letter, digit or ``_``; at most 96 characters each; no ``--`` or ``..``).
_PART = r"[A-Za-z0-9_](?:[\w.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"{_PART}/{_PART}")
#: A name ending like this is a file path the user mistyped, not a repo.
_FILE_SUFFIXES = (".json", ".yaml", ".yml", ".safetensors", ".bin", ".gguf", ".pt", ".pth", ".git")

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
PICKLE_INDEX = "pytorch_model.bin.index.json"
PICKLE_SINGLE = "pytorch_model.bin"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_PICKLE = "adapter_model.bin"
#: Tokenizer files as transformers saves them (root of the repo only).
TOKENIZER_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template*",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "sentencepiece*.model",
    "*.tiktoken",
)

#: Parallel downloads of weight shards (huggingface_hub's own default is 8; a few streams already
#: fill most links, and each one is a thread to stop on Ctrl-C).
DOWNLOAD_WORKERS = 4
#: Close names to offer for a repo id that does not exist (the catalog's: :func:`memfit.models.catalog.suggestions`).
Suggest = Callable[[str], list[str]]
_HASH_CHUNK_BYTES = 8 * 2**20


@dataclass(frozen=True)
class Snapshot:
    """Files of one repo at one commit, on this machine.

    ``folder`` is huggingface_hub's snapshot folder (``.../snapshots/<commit>``), or memfit's
    converted copy when pickled weights were converted; it is read, never written. ``note`` says
    when the Hub was not asked (offline, unreachable) and the cached copy was used instead.
    """

    repo_id: str
    revision: str
    commit: str
    folder: Path
    note: str | None = None
    downloaded_bytes: int = 0

    def record(self) -> dict[str, str]:
        """What a run records to be reproduced: repo, revision asked for, commit used."""
        return {"repo_id": self.repo_id, "revision": self.revision, "commit": self.commit}


# ------------------------------------------------------------------------------------------------
# Names


def looks_like_hub_id(text: str) -> bool:
    """True when ``text`` has the form of a Hub model id, ``org/name`` (regardless of local files)."""
    text = str(text)
    if not _REPO_ID.fullmatch(text) or "--" in text or ".." in text:
        return False
    return not text.lower().endswith(_FILE_SUFFIXES)


def is_hub_id(text: str) -> bool:
    """True when ``text`` means a Hub repo: an ``org/name`` that is not an existing local path.

    Local paths win: ``models/llama`` that exists next to the user is that folder.
    """
    return looks_like_hub_id(text) and not Path(str(text)).expanduser().exists()


# ------------------------------------------------------------------------------------------------
# What commands call


def fetch_config(
    repo_id: str, revision: str | None = None, *, local_only: bool = False, suggest: Suggest | None = None
) -> Snapshot:
    """Fetch ``config.json`` of ``repo_id`` at ``revision`` (default ``main``) and nothing else.

    ``local_only``: use the cache only. ``suggest``: close names for a repo that does not exist
    (:func:`memfit.models.catalog.suggestions`). Raises :class:`HubError`.
    """
    listing = _listing(repo_id, revision, include=(CONFIG_FILE,), local_only=local_only, suggest=suggest)
    if CONFIG_FILE not in listing.names:
        raise _no_config(listing)
    _download(listing, [CONFIG_FILE], progress=None)
    return listing.snapshot()


def read_config(snapshot: Snapshot) -> dict[str, Any]:
    """The config dict in a snapshot, checked (JSON object with a model_type; no remote code needed)."""
    from memfit.models.errors import ModelNotFoundError

    try:
        config = read_config_file(snapshot.folder / CONFIG_FILE)
    except ModelNotFoundError as err:
        raise HubError(f"{snapshot.repo_id}: {err}", "file") from None
    check_remote_code(config, snapshot.repo_id)
    return config


def fetch_model(
    repo_id: str,
    revision: str | None = None,
    *,
    weights: bool = True,
    allow_pickle: bool = False,
    opt_in: str = "allow_pickle=True",
    local_only: bool = False,
    console=None,
    progress: bool | str = True,
    suggest: Suggest | None = None,
) -> Snapshot:
    """Fetch what training or merging reads: config, generation config, tokenizer, weights.

    Args:
        weights: False fetches only the small files (config, tokenizer, the weights index) and
            checks that the repo has weights memfit can read; True fetches the weights too.
        allow_pickle: accept a repo whose only weights are pickled ``.bin`` files; they are
            converted once to safetensors in memfit's cache, whose folder is then returned.
            Safetensors weights are always preferred when the repo has both.
        opt_in: how the caller's user sets ``allow_pickle`` (named in the refusal).
        local_only: use the cache only (other ranks of a run, after rank 0 fetched).
        console: Rich console for progress (default: stderr).
        progress: True: a live bar on a terminal, plain lines otherwise; "plain": plain lines;
            False: nothing.
        suggest: close names for a repo that does not exist (:func:`memfit.models.catalog.suggestions`).

    Raises :class:`HubError`, before anything is downloaded wherever the problem can be seen in
    the file listing (missing config, no safetensors without the opt-in, remote code).
    """
    listing = _listing(repo_id, revision, include=_model_patterns(allow_pickle), local_only=local_only, suggest=suggest)
    if CONFIG_FILE not in listing.names:
        raise _no_config(listing)
    small = [CONFIG_FILE] + [n for n in (GENERATION_CONFIG_FILE,) if n in listing.names]
    small += sorted(n for n in listing.names if _matches(n, TOKENIZER_PATTERNS))
    layout = _weights_layout(listing, allow_pickle, opt_in)
    small += [layout.index] if layout.index else []
    _download(listing, small, progress=None)
    snapshot = listing.snapshot()
    read_config(snapshot)  # a broken config or one that needs remote code fails before the weights
    if not weights:
        return snapshot
    files = layout.files if layout.index is None else _index_shards(listing, layout.index)
    fetched = _download(listing, files, progress=_Progress(console, f"{repo_id} ({listing.commit[:7]})", progress))
    snapshot = listing.snapshot(downloaded_bytes=fetched)
    if layout.pickled:
        from memfit.models.pickle_weights import convert_checkpoint

        folder = convert_checkpoint(snapshot.folder, repo_id, snapshot.commit, files, layout.index, console=console)
        snapshot = Snapshot(snapshot.repo_id, snapshot.revision, snapshot.commit, folder, snapshot.note, fetched)
    return snapshot


def fetch_adapter_config(repo_id: str, revision: str | None = None) -> Snapshot | None:
    """Fetch ``adapter_config.json`` of ``repo_id`` when the repo is a PEFT adapter (that file and no
    config.json), as transformers' ``from_pretrained`` takes such a repo: its base with the adapter.
    None for a model repo, or a repo that is neither. Raises :class:`HubError`."""
    listing = _listing(repo_id, revision, include=(ADAPTER_CONFIG,))
    if CONFIG_FILE in listing.names or ADAPTER_CONFIG not in listing.names:
        return None
    _download(listing, [ADAPTER_CONFIG], progress=None)
    return listing.snapshot()


def fetch_adapter(
    repo_id: str,
    revision: str | None = None,
    *,
    allow_pickle: bool = False,
    opt_in: str = "--allow-pickle-weights",
    console=None,
    progress: bool | str = True,
    suggest: Suggest | None = None,
) -> Snapshot:
    """Fetch a PEFT adapter: adapter_config.json, its weights and any tokenizer files beside them.

    ``suggest`` as for :func:`fetch_model`. Raises :class:`HubError` (a model repo passed as an
    adapter is named as such).
    """
    listing = _listing(
        repo_id, revision, include=(ADAPTER_CONFIG, ADAPTER_WEIGHTS, *TOKENIZER_PATTERNS), suggest=suggest
    )
    if ADAPTER_CONFIG not in listing.names:
        hint = (
            " It is a model (config.json), not an adapter: pass it as the base model."
            if CONFIG_FILE in listing.names
            else " A PEFT adapter repo holds adapter_config.json and adapter_model.safetensors."
        )
        raise HubError(f"{listing.where} has no {ADAPTER_CONFIG}.{hint}", "file")
    if ADAPTER_WEIGHTS in listing.names:
        weights, pickled = [ADAPTER_WEIGHTS], False
    elif ADAPTER_PICKLE in listing.names:
        if not allow_pickle:
            raise _pickle_refusal(listing, [ADAPTER_PICKLE], opt_in)
        weights, pickled = [ADAPTER_PICKLE], True
    else:
        raise HubError(f"{listing.where} has no {ADAPTER_WEIGHTS}: its files are {_some(listing.names)}.", "no-weights")
    small = [ADAPTER_CONFIG] + sorted(n for n in listing.names if _matches(n, TOKENIZER_PATTERNS))
    _download(listing, small, progress=None)
    fetched = _download(listing, weights, progress=_Progress(console, f"{repo_id} ({listing.commit[:7]})", progress))
    snapshot = listing.snapshot(downloaded_bytes=fetched)
    if pickled:
        from memfit.models.pickle_weights import convert_checkpoint

        folder = convert_checkpoint(snapshot.folder, repo_id, snapshot.commit, weights, None, console=console)
        snapshot = Snapshot(snapshot.repo_id, snapshot.revision, snapshot.commit, folder, snapshot.note, fetched)
    return snapshot


def check_remote_code(config: dict[str, Any], repo_id: str) -> None:
    """Refuse a config that transformers can only build by running Python code from the repo.

    Such a config names a ``model_type`` transformers does not ship and points to the repo's own
    modules in ``auto_map``. A config with ``auto_map`` whose architecture transformers does ship
    is built from transformers' own code, so it passes.
    """
    auto_map = config.get("auto_map")
    if not auto_map:
        return
    model_type = config.get("model_type")
    from transformers import CONFIG_MAPPING

    if model_type in CONFIG_MAPPING:
        return
    modules = sorted(
        {
            str(v).split(".")[0] + ".py"
            for v in (auto_map.values() if isinstance(auto_map, dict) else [])
            if isinstance(v, str)
        }
    )
    where = f" ({', '.join(modules)})" if modules else ""
    raise HubError(
        f"{repo_id} needs trust_remote_code: its config.json names model_type {model_type!r}, which transformers does not "
        f"ship, and points to Python files in the repo{where}. Trusting remote code means running that code on this "
        "machine with your permissions. memfit does not run code from model repos (it builds every model from its "
        "config alone, on the meta device); use a model whose architecture transformers ships, or a transformers "
        "version that added this one.",
        "remote-code",
    )


def cache_dir() -> Path:
    """huggingface_hub's cache folder (HF_HUB_CACHE, default HF_HOME/hub)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).expanduser()


def repo_cache_folder(repo_id: str) -> Path:
    """The cache folder of one model repo (``models--org--name``), which may not exist yet."""
    return cache_dir() / ("models--" + repo_id.replace("/", "--"))


# ------------------------------------------------------------------------------------------------
# The listing: one API call (or the cache)


@dataclass
class _Listing:
    repo_id: str
    revision: str
    commit: str
    sizes: dict[str, int | None]
    sha256: dict[str, str] = field(default_factory=dict)
    offline: str | None = None  # why the cache was used instead of the Hub (None: the Hub answered)
    include: tuple[str, ...] = ()
    suggest: Suggest | None = None  # close names for a repo that does not exist

    @property
    def names(self) -> set[str]:
        return set(self.sizes)

    @property
    def where(self) -> str:
        return self.repo_id if self.revision == "main" else f"{self.repo_id} (revision {self.revision})"

    @property
    def folder(self) -> Path:
        return repo_cache_folder(self.repo_id) / "snapshots" / self.commit

    def snapshot(self, downloaded_bytes: int = 0) -> Snapshot:
        note = None
        if self.offline:
            note = f"{self.offline}: using the cached copy of {self.repo_id} (commit {self.commit[:7]})"
        return Snapshot(self.repo_id, self.revision, self.commit, self.folder, note, downloaded_bytes)


def _listing(
    repo_id: str,
    revision: str | None,
    *,
    include: tuple[str, ...],
    local_only: bool = False,
    suggest: Suggest | None = None,
) -> _Listing:
    if not looks_like_hub_id(repo_id):
        raise HubError(f"{repo_id!r} is not a Hugging Face Hub id: write org/name, e.g. Qwen/Qwen2.5-7B.", "not-hub-id")
    revision = revision or "main"
    from huggingface_hub import HfApi, constants

    blocked = _cache_folder_problem()
    if blocked is not None:  # before any request: huggingface_hub would fail on it with a message about the server
        raise blocked
    if local_only:
        return _cached_listing(
            repo_id, revision, include, reason="the files were fetched by the first process", kind="offline"
        )
    if _offline_mode(constants):
        return _cached_listing(repo_id, revision, include, reason="HF_HUB_OFFLINE=1 is set", kind="offline")
    try:
        # A bounded wait (HF_HUB_ETAG_TIMEOUT, 10 s by default): a network that drops packets must not hang the command.
        timeout = float(getattr(constants, "HF_HUB_ETAG_TIMEOUT", 10) or 10)
        info = HfApi().model_info(repo_id, revision=revision, files_metadata=True, timeout=timeout)
    except Exception as err:  # noqa: BLE001 - every failure is classified and reported below
        kind = _kind(err)
        if kind in ("network", "offline"):
            reason = "HF_HUB_OFFLINE=1 is set" if kind == "offline" else f"cannot reach {_endpoint()} ({_short(err)})"
            return _cached_listing(repo_id, revision, include, reason=reason, kind=kind)
        raise _error(kind, err, repo_id, revision, include, suggest=suggest) from None
    sizes, digests = {}, {}
    for sibling in info.siblings or []:
        name = sibling.rfilename
        if "/" in name:  # memfit reads the repo root only (subfolders hold other formats)
            continue
        sizes[name] = sibling.size
        digest = _lfs_sha256(sibling.lfs)
        if digest:
            digests[name] = digest
    commit = info.sha
    if not commit:
        raise HubError(
            f"{_endpoint()} returned no commit for {repo_id}: HF_ENDPOINT may not point to a Hugging Face Hub.", "http"
        )
    _remember_revision(repo_id, revision, commit)
    return _Listing(repo_id, revision, commit, sizes, digests, include=include, suggest=suggest)


def _cached_listing(repo_id: str, revision: str, include: tuple[str, ...], *, reason: str, kind: str) -> _Listing:
    """The listing of the cached snapshot of ``revision``, or the HubError saying nothing is cached."""
    repo_folder = repo_cache_folder(repo_id)
    commit = revision if re.fullmatch(r"[0-9a-f]{40}", revision) else None
    ref = repo_folder / "refs" / revision
    if commit is None and ref.is_file():
        commit = ref.read_text().strip()
    folder = repo_folder / "snapshots" / commit if commit else None
    if folder is None or not folder.is_dir():
        raise _not_cached(repo_id, revision, include, reason, kind)
    sizes = {
        p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()
    }  # is_file: a dangling link is not a file
    return _Listing(repo_id, revision, commit, sizes, {}, offline=reason, include=include)


def _file_in_the_way(folder: Path) -> Path | None:
    """The file (or dangling link) that stands where ``folder`` or one of its parents must be a folder."""
    for candidate in (folder, *folder.parents):
        if candidate.is_symlink() or candidate.exists():
            return None if candidate.is_dir() else candidate
    return None


#: What each variable names, and the fix when a file stands in its way.
_CACHE_VARIABLES = {
    "HF_HOME": "huggingface_hub keeps its cache and your token in that folder. Set HF_HOME to a folder",
    "HF_HUB_CACHE": "huggingface_hub keeps its downloads in that folder. Set HF_HUB_CACHE to a folder",
    "HF_TOKEN_PATH": "huggingface_hub keeps your token at that path. Set HF_TOKEN_PATH to a file name in a folder",
}


def _cache_folder_problem() -> HubError | None:
    """The HubError for a Hugging Face cache or token folder that cannot be a folder, because a file
    stands where it or a parent of it should be (``HF_HOME=~/notes.txt``), naming the variable the
    user set; None when both can be folders."""
    from huggingface_hub import constants

    home = "HF_HOME" if os.environ.get("HF_HOME") else None
    places = (
        (Path(constants.HF_HUB_CACHE).expanduser(), "HF_HUB_CACHE" if os.environ.get("HF_HUB_CACHE") else home),
        (
            Path(constants.HF_TOKEN_PATH).expanduser().parent,
            "HF_TOKEN_PATH" if os.environ.get("HF_TOKEN_PATH") else home,
        ),
    )
    for folder, variable in places:
        blocker = _file_in_the_way(folder)
        if blocker is None:
            continue
        if variable is None:  # the default place, under ~/.cache (or XDG_CACHE_HOME)
            reason = f"the Hugging Face cache folder {str(folder)!r} cannot be made: {str(blocker)!r} is a file, not a folder"
            return HubError(f"{reason}. Move that file away, or set HF_HOME to a folder.", "cache", reason=reason)
        value = os.environ[variable]
        where = "is a file" if blocker == Path(value).expanduser() else f"is under {str(blocker)!r}, a file"
        reason = f"{variable} ({value!r}) {where}, not a folder"
        return HubError(f"{reason}: {_CACHE_VARIABLES[variable]}, or unset it.", "cache", reason=reason)
    return None


def _remember_revision(repo_id: str, revision: str, commit: str) -> None:
    """Record ``revision -> commit`` in the cache's refs, as huggingface_hub does, so that the same
    revision resolves offline later. Files are fetched by commit, which records no ref."""
    if revision == commit:
        return
    ref = repo_cache_folder(repo_id) / "refs" / revision
    try:
        if ref.is_file() and ref.read_text().strip() == commit:
            return
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
        tmp.write_text(commit)
        os.replace(tmp, ref)
    except OSError:
        pass  # a read-only cache still serves this run; only offline use of the branch name needs the ref


# ------------------------------------------------------------------------------------------------
# Which files


@dataclass(frozen=True)
class _WeightsLayout:
    files: list[str]  # weight files (empty when an index lists them)
    index: str | None
    pickled: bool


def _weights_layout(listing: _Listing, allow_pickle: bool, opt_in: str) -> _WeightsLayout:
    """Which weights to fetch, in the loader's order of preference (safetensors first)."""
    names = listing.names
    if SAFETENSORS_INDEX in names:
        return _WeightsLayout([], SAFETENSORS_INDEX, False)
    if SAFETENSORS_SINGLE in names:
        return _WeightsLayout([SAFETENSORS_SINGLE], None, False)
    others = sorted(n for n in names if n.endswith(".safetensors"))
    if len(others) == 1:
        return _WeightsLayout(others, None, False)
    pickles = sorted(n for n in names if n.endswith(".bin") and n.startswith("pytorch_model"))
    if PICKLE_INDEX in names or PICKLE_SINGLE in names:
        if not allow_pickle:
            raise _pickle_refusal(listing, [PICKLE_INDEX] if PICKLE_INDEX in names else pickles, opt_in)
        if PICKLE_INDEX in names:
            return _WeightsLayout([], PICKLE_INDEX, True)
        return _WeightsLayout([PICKLE_SINGLE], None, True)
    if listing.offline:
        raise _not_cached(
            listing.repo_id,
            listing.revision,
            listing.include,
            listing.offline,
            "offline" if "HF_HUB_OFFLINE" in listing.offline else "network",
            missing="its weights",
        )
    raise HubError(
        f"{listing.where} has no weights memfit can read (model.safetensors or a model.safetensors.index.json with its "
        f"shards; pickled pytorch_model*.bin with the opt-in). Its files: {_some(names)}.",
        "no-weights",
    )


def _index_shards(listing: _Listing, index: str) -> list[str]:
    path = listing.folder / index
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise HubError(
            f"{listing.where}: {index} cannot be read ({err}); the repo's weights index is broken.", "file"
        ) from None
    bad = [s for s in shards if not isinstance(s, str) or "/" in s or s.startswith(".")]
    if bad:
        raise HubError(
            f"{listing.where}: {index} names shard {bad[0]!r} outside the repo root; memfit reads root files only.",
            "file",
        )
    return shards


def _model_patterns(allow_pickle: bool) -> tuple[str, ...]:
    patterns = ("*.json", "*.safetensors", *TOKENIZER_PATTERNS)
    return patterns + (("pytorch_model*.bin",) if allow_pickle else ())


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


# ------------------------------------------------------------------------------------------------
# Downloading


def _download(listing: _Listing, names: list[str], *, progress: _Progress | None) -> int:
    """Fetch ``names`` of ``listing`` into its snapshot folder; return the bytes downloaded now."""
    folder = listing.folder
    missing = [n for n in dict.fromkeys(names) if not (folder / n).is_file()]
    if listing.offline:
        if missing:
            kind = "offline" if "HF_HUB_OFFLINE" in listing.offline else "network"
            raise _not_cached(
                listing.repo_id, listing.revision, listing.include, listing.offline, kind, missing=", ".join(missing)
            )
        return 0
    if not missing:
        return 0
    absent = [n for n in missing if n not in listing.sizes]
    if absent:
        raise HubError(f"{listing.where} has no file {absent[0]}.", "file")
    total = sum(listing.sizes.get(n) or 0 for n in missing)
    bar = progress or _Progress(None, "", False)
    with bar.start(total):
        if len(missing) == 1 or progress is None:
            for name in missing:
                _download_one(listing, name, bar)
        else:
            _download_parallel(listing, missing, bar)
    return total


def _download_parallel(listing: _Listing, names: list[str], bar: _Progress) -> None:
    pool = ThreadPoolExecutor(max_workers=min(DOWNLOAD_WORKERS, len(names)), thread_name_prefix="memfit-hub")
    futures = [pool.submit(_download_one, listing, name, bar) for name in names]
    try:
        wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            if future.done() and future.exception() is not None:
                raise future.exception()
        for future in futures:
            future.result()
    except BaseException:
        # Ctrl-C or a failed file: the other downloads stop at their next chunk (their partial
        # files are deleted by huggingface_hub), queued ones never start.
        bar.cancelled.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _download_one(listing: _Listing, name: str, bar: _Progress) -> None:
    from huggingface_hub import hf_hub_download

    # huggingface_hub's own defaults (HF_ENDPOINT, HF_HUB_CACHE, HF_TOKEN) apply; the commit pins every file.
    kwargs: dict[str, Any] = {"repo_id": listing.repo_id, "filename": name, "revision": listing.commit}
    if _accepts_tqdm_class():
        kwargs["tqdm_class"] = bar.byte_counter()
    try:
        path = hf_hub_download(**kwargs)
    except KeyboardInterrupt:
        raise
    except Exception as err:  # noqa: BLE001 - classified below
        kind = _kind(err)
        if kind in ("network", "other"):
            kind = "interrupted"
        raise _error(
            kind, err, listing.repo_id, listing.revision, listing.include, filename=name, suggest=listing.suggest
        ) from None
    digest = listing.sha256.get(name)
    if digest is not None:
        bar.note("checking SHA-256")
        actual = _sha256(Path(path))
        if actual != digest:
            _discard(Path(path))
            raise HubError(
                f"{name} downloaded from {listing.where} does not match the SHA-256 the Hub lists for it "
                f"({actual[:12]}... instead of {digest[:12]}...). The file was deleted and nothing used it: run the same "
                "command again to download it anew.",
                "corrupt",
            )
    bar.file_done(name, listing.sizes.get(name) or 0)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_HASH_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _discard(pointer: Path) -> None:
    """Remove a cached file: the snapshot entry and the blob it points to."""
    blob = pointer.resolve()
    for path in (pointer, blob):
        try:
            path.unlink()
        except OSError:
            pass


@lru_cache(maxsize=1)
def _accepts_tqdm_class() -> bool:
    """Whether this huggingface_hub's hf_hub_download takes ``tqdm_class`` (older ones do not)."""
    import inspect

    from huggingface_hub import hf_hub_download

    return "tqdm_class" in inspect.signature(hf_hub_download).parameters


class _Progress:
    """Download progress: a Rich bar when stderr is a terminal, plain lines otherwise, or nothing.

    huggingface_hub reports bytes through a tqdm-like class; :meth:`byte_counter` makes one that
    forwards every chunk here (and stops the download once :attr:`cancelled` is set).
    """

    def __init__(self, console, label: str, mode: bool | str):
        self.label = label
        self.enabled = bool(mode)
        self.live = mode is True or mode == "auto"  # a live bar when the console is a terminal; "plain": lines only
        self.console = console
        self.cancelled = threading.Event()
        self._bar = None
        self._task = None
        self._lock = threading.Lock()
        self._started = 0.0
        self._total = 0

    def start(self, total_bytes: int) -> _Progress:
        """Set the bytes to download; use the result as a context manager."""
        self._total = total_bytes
        return self

    def __enter__(self) -> _Progress:
        self._started = time.perf_counter()
        if not self.enabled:
            return self
        if self.console is None:
            from memfit.console import make_console

            self.console = make_console(stderr=True)
        if self.live and self.console.is_terminal:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._bar = Progress(
                TextColumn("[bold]download[/] {task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self._total or None)
        else:
            self.console.print(f"downloading {self.label}: {_size(self._total)}", highlight=False)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._bar is not None:
            self._bar.stop()
        if self.enabled and exc_type is None:
            seconds = time.perf_counter() - self._started
            self.console.print(f"downloaded {self.label}: {_size(self._total)} in {seconds:.1f} s", highlight=False)

    def advance(self, nbytes: int) -> None:
        if self.cancelled.is_set():
            raise KeyboardInterrupt("download cancelled")
        if self._bar is not None and nbytes:
            self._bar.update(self._task, advance=nbytes)

    def note(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=f"{self.label}: {text}")

    def file_done(self, name: str, nbytes: int) -> None:
        if self.enabled and self._bar is None:
            with self._lock:
                self.console.print(f"  {name} ({_size(nbytes)})", highlight=False)

    def byte_counter(self) -> type:
        progress = self

        class _ByteCounter:
            """The part of tqdm's interface huggingface_hub uses; extra arguments are ignored."""

            def __init__(self, *args, **kwargs):
                initial = kwargs.get("initial") or 0
                if initial:
                    progress.advance(initial)

            def update(self, n=1):
                progress.advance(int(n or 0))

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def __getattr__(self, name: str) -> Callable[..., None]:
                return lambda *args, **kwargs: None  # set_description, close, refresh, update_transfer...

        return _ByteCounter


def _size(nbytes: int) -> str:
    from memfit.units import format_bytes

    return format_bytes(nbytes)


# ------------------------------------------------------------------------------------------------
# Errors


def _offline_mode(constants) -> bool:
    check = getattr(constants, "is_offline_mode", None)
    return bool(check() if callable(check) else getattr(constants, "HF_HUB_OFFLINE", False))


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT.rstrip("/")


def _page(repo_id: str) -> str:
    return f"{_endpoint()}/{repo_id}"


def _token_in_use() -> bool:
    try:
        from huggingface_hub import get_token

        return bool(get_token())
    except Exception:  # noqa: BLE001 - a broken token store only changes the wording
        return bool(os.environ.get("HF_TOKEN"))


def _kind(err: BaseException) -> str:
    """Classify a huggingface_hub error (the classes differ a little between versions)."""
    from huggingface_hub import errors

    def cls(name: str) -> tuple[type, ...]:
        found = getattr(errors, name, None)
        if found is None:
            import huggingface_hub.utils as utils

            found = getattr(utils, name, None)
        return (found,) if isinstance(found, type) else ()

    if isinstance(err, cls("GatedRepoError")):
        return "gated"
    if isinstance(err, cls("RepositoryNotFoundError")):
        return "missing-repo"
    if isinstance(err, cls("RevisionNotFoundError")):
        return "revision"
    if isinstance(err, cls("OfflineModeIsEnabled")):
        return "offline"
    if isinstance(err, cls("LocalEntryNotFoundError")):  # before EntryNotFoundError: a subclass of it in 1.x
        cause = err.__cause__ or err.__context__
        return "offline" if cause is not None and isinstance(cause, cls("OfflineModeIsEnabled")) else "network"
    if isinstance(err, cls("EntryNotFoundError")):
        return "file"
    if isinstance(err, cls("HfHubHTTPError")):
        response = getattr(err, "response", None)
        status = getattr(response, "status_code", None)
        if status == 401:
            return "token"
        if status == 403:
            return "forbidden"
        if status is not None and (status >= 500 or status in (408, 429)):
            return "network"
        return "http"
    if isinstance(err, (ConnectionError, TimeoutError)):
        return "network"
    if isinstance(err, PermissionError) or getattr(err, "errno", None) in (
        errno.EACCES,
        errno.EROFS,
        errno.ENOSPC,
        errno.EDQUOT,
        errno.ENOTDIR,
    ):
        return "cache"
    module = type(err).__module__.split(".")[0]
    if module in ("httpx", "httpx2", "httpcore", "requests", "urllib3"):
        return "network"
    return "other"


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _error(
    kind: str,
    err: BaseException,
    repo_id: str,
    revision: str,
    include: tuple[str, ...],
    *,
    filename: str | None = None,
    suggest: Suggest | None = None,
) -> HubError:
    """The HubError for a classified huggingface_hub error (``suggest``: close names for a missing repo)."""
    where = repo_id if revision == "main" else f"{repo_id} (revision {revision})"
    if kind == "missing-repo":
        hints = suggest(repo_id) if suggest is not None else []
        hint = f" Did you mean {' or '.join(hints)}?" if hints else ""
        return HubError(
            f"{repo_id!r} is not a local path and not a model on {_endpoint()}.{hint} If the repo is private, set HF_TOKEN "
            "to a token that can read it (or run `hf auth login`).",
            kind,
            reason=f"{repo_id} does not exist on {_endpoint()}",
        )
    if kind == "gated":
        if _token_in_use():
            reason = f"{repo_id} is gated and the token in use has no access to it"
            fix = (
                f"the token in use (HF_TOKEN or `hf auth login`) has no access yet: request access at {_page(repo_id)} "
                "with the account the token belongs to, and run again once it is granted."
            )
        else:
            reason = f"{repo_id} is gated and no Hugging Face token is set"
            fix = (
                f"accept its terms at {_page(repo_id)} with your Hugging Face account, then set HF_TOKEN to a token "
                "of that account (or run `hf auth login`)."
            )
        return HubError(f"{repo_id} is gated: {fix}", kind, reason=reason)
    if kind == "revision":
        return HubError(
            f"revision {revision!r} does not exist in {repo_id}: give a branch, a tag or a full commit sha from "
            f"{_page(repo_id)}/commits/main, or leave the revision out for main.",
            kind,
        )
    if kind == "file":
        return HubError(f"{where} has no file {filename or '?'}.", kind)
    if kind in ("network", "offline"):
        reason = "HF_HUB_OFFLINE=1 is set" if kind == "offline" else f"cannot reach {_endpoint()} ({_short(err)})"
        return _not_cached(repo_id, revision, include, reason, kind)
    if kind == "token":
        return HubError(
            f"{_endpoint()} rejected the token in use (HF_TOKEN or `hf auth login`) for {repo_id}: it is invalid or expired. "
            f"Create a new one at {_endpoint()}/settings/tokens and set HF_TOKEN to it.",
            kind,
        )
    if kind == "forbidden":
        return HubError(
            f"{_endpoint()} refused to serve {where} (HTTP 403): the token in use (HF_TOKEN or `hf auth login`) cannot read "
            f"it. Use a token with read access to {repo_id}.",
            kind,
        )
    if kind == "cache":
        reason = f"the Hugging Face cache at {cache_dir()} cannot be used ({_short(err)})"
        return HubError(
            f"cannot write {filename or 'the files of ' + repo_id} to the Hugging Face cache at {cache_dir()} ({_short(err)}): "
            "set HF_HOME (or HF_HUB_CACHE) to a writable folder with room for the model.",
            kind,
            reason=reason,
        )
    if kind == "interrupted":
        return HubError(
            f"downloading {filename} from {where} failed ({_short(err)}). Run the same command again: files already "
            "downloaded are kept, and a partly downloaded file is never used.",
            kind,
        )
    return HubError(
        f"{_endpoint()} could not serve {where}: {_short(err)}. Check HF_ENDPOINT ({_endpoint()}) and try again.", kind
    )


def _not_cached(
    repo_id: str, revision: str, include: tuple[str, ...], reason: str, kind: str, *, missing: str | None = None
) -> HubError:
    where = repo_id if revision == "main" else f"{repo_id} (revision {revision})"
    rev = "" if revision == "main" else f" --revision {revision}"
    patterns = " ".join(f"'{p}'" for p in include[:6]) or "'config.json'"
    command = f"`hf download {repo_id}{rev} --include {patterns}`"
    what = f" is not fully in the cache (missing: {missing})" if missing else " is not in the cache"
    if kind == "offline" and reason.startswith("HF_HUB_OFFLINE"):
        fix = f"Unset HF_HUB_OFFLINE to download it, or download it beforehand with {command}."
    elif kind == "offline":
        fix = "Run the command again: the first process fetches it."
    else:
        fix = (
            f"Connect and run again, or download it where there is network with {command}, copy that cache "
            "folder here and set HF_HUB_OFFLINE=1."
        )
    return HubError(f"{reason}, and {where}{what} at {cache_dir()}. {fix}", kind, reason=reason)


def _no_config(listing: _Listing) -> HubError:
    if ADAPTER_CONFIG in listing.names:
        hint = (
            " It is a PEFT adapter (adapter_config.json), not a model: pass it as the adapter (memfit merge --adapter)."
        )
    else:
        hint = " memfit needs a transformers model repo: config.json and safetensors weights."
    return HubError(f"{listing.where} has no {CONFIG_FILE}.{hint}", "file")


def _pickle_refusal(listing: _Listing, files: list[str], opt_in: str) -> HubError:
    return HubError(
        f"{listing.where} has no safetensors weights, only pickled PyTorch files ({_some(files)}). memfit does not load "
        "pickle files unless asked: unpickling a file can run code its author put in it. If you trust this repo, opt in "
        f"with {opt_in}: memfit then reads them with torch.load(weights_only=True), which refuses anything but tensors, "
        "and converts them once to safetensors.",
        "pickle",
    )


def _some(names) -> str:
    names = sorted(names)
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "") if names else "none"


def _lfs_sha256(lfs) -> str | None:
    if lfs is None:
        return None
    digest = getattr(lfs, "sha256", None)
    if digest is None and isinstance(lfs, dict):
        digest = lfs.get("sha256")
    return str(digest) if digest else None
