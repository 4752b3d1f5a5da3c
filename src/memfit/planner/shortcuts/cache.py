"""Plans kept on disk, so that a plan made once is not made again by the next process.

A plan is a pure function of its inputs: the model's config, every knob, the target (GPU name,
memory, architecture), the runtime overrides, whether it extrapolates over depth, and the code that
makes it (memfit's own source and the libraries it runs: torch, transformers, PEFT, bitsandbytes...).
Each entry is keyed by a sha256 over all of those, so any change to any of them is a different key
and the plan is made afresh: nothing is ever invalidated in place, and nothing stale can be read.

- Where: ``$MEMFIT_CACHE/plans`` (by default ``~/.cache/memfit/plans``; the same root memfit's other
  caches use, :func:`memfit.files.memfit_cache_dir`). One small JSON file per entry.
- Off: ``MEMFIT_PLAN_CACHE=0`` (or ``--no-cache`` on ``memfit plan`` / ``memfit fit``, or
  ``memfit.plan(..., cache=False)``). Deleting the folder is always safe.
- Versions are read from package metadata (:func:`importlib.metadata.version`), not by importing
  the packages: a plan answered from the cache imports neither torch nor transformers.
- memfit's source is hashed by content (every ``.py``, ``.json`` and ``.yaml`` of the package but
  its demo assets), once per process: an edit, a checkout or a reinstall changes the key, where
  file sizes and modification times would not be safe across checkouts.
- Writes are atomic (:func:`memfit.files.write_atomic`): a reader sees a whole entry or none. An
  entry that cannot be read or parsed, or that is not for its key, is a miss and is overwritten.
  Any error of the cache itself (a read-only or full disk) is a miss, never a failed plan.
- At most :data:`MAX_ENTRIES` entries: past that, the least recently used (each hit refreshes the
  entry's modification time) are deleted.

What is stored must come back equal: :func:`store` refuses a value that does not survive a JSON
round trip unchanged (a tuple would come back a list), so the cache cannot change a result.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

#: The switch: ``MEMFIT_PLAN_CACHE=0`` (also ``false``, ``no``, ``off``) turns the cache off.
ENV_SWITCH = "MEMFIT_PLAN_CACHE"
_OFF = ("0", "false", "no", "off")
#: The subfolder of memfit's cache root that holds plans.
SUBFOLDER = "plans"
#: Entries kept at most (a plan is 2 to 5 KB: a few tens of MB at most).
MAX_ENTRIES = 4096
#: Bumped whenever what an entry holds, or how keys are made, changes.
FORMAT = 1
#: Libraries whose version is part of every key: the code a plan runs, besides memfit's own.
LIBRARIES = (
    "torch",
    "transformers",
    "peft",
    "bitsandbytes",
    "accelerate",
    "pydantic",
    "numpy",
    "safetensors",
    "mamba-ssm",
    "causal-conv1d",
    "flash-linear-attention",
)  # the last three: which path sequence mixers take
#: Temporary files of writes that were killed are removed once they are this old.
_STALE_TMP_SECONDS = 3600.0


def enabled() -> bool:
    """Whether plans are read from and written to the cache (``MEMFIT_PLAN_CACHE``, on by default)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in _OFF


def folder() -> Path:
    """Where the entries live: ``<memfit cache root>/plans``."""
    from memfit.files import memfit_cache_dir

    return memfit_cache_dir() / SUBFOLDER


@lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 over the relative paths and contents of memfit's own source files (computed once a process)."""
    return folder_digest(Path(__file__).resolve().parents[2])


def folder_digest(root: Path) -> str:
    """sha256 over the relative paths and contents of the ``.py``, ``.json`` and ``.yaml`` files
    under ``root`` (its ``assets`` folder aside: demo data and a tokenizer, which plans never read)."""
    digest = hashlib.sha256()
    files = sorted(
        p
        for p in root.rglob("*")
        if p.suffix in (".py", ".json", ".yaml")
        and p.is_file()
        and not {"__pycache__", "assets"} & set(p.relative_to(root).parts)
    )
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def library_version(name: str) -> str | None:
    """The installed version of distribution ``name`` from its metadata (no import), or None."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@lru_cache(maxsize=1)
def environment() -> dict[str, Any]:
    """What besides its inputs a plan depends on: memfit's source, the libraries and the interpreter."""
    return {
        "memfit_source": source_digest(),
        "libraries": {name: library_version(name) for name in LIBRARIES},
        "python": sys.version,
        "implementation": sys.implementation.name,
    }


def make_key(kind: str, inputs: dict[str, Any]) -> str | None:
    """The key of an entry of ``kind`` for ``inputs`` (with :func:`environment`), or None when the
    inputs have no canonical JSON form (then nothing is cached: a key that loses information could
    hand one input another's plan)."""
    try:
        text = json.dumps(
            {"format": FORMAT, "kind": kind, "environment": environment(), "inputs": inputs},
            sort_keys=True,
            separators=(",", ":"),
            allow_nan=False,
        )
    except (TypeError, ValueError):
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def _path(key: str) -> Path:
    return folder() / f"{key}.json"


def load(kind: str, key: str | None) -> Any | None:
    """The value stored under ``key``, or None (a miss: nothing there, unreadable, or not this entry)."""
    if key is None or not enabled():
        return None
    path = _path(key)
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if (
        not isinstance(entry, dict)
        or entry.get("format") != FORMAT
        or entry.get("kind") != kind
        or entry.get("key") != key
    ):
        return None
    try:
        os.utime(path)  # recently used: the last to be deleted when the cache is full
    except OSError:
        pass
    return entry.get("value")


def store(kind: str, key: str | None, value: Any) -> bool:
    """Keep ``value`` under ``key``; True when it was written. A value that does not come back from
    JSON exactly as it is is not stored, and an error of the disk is ignored (the cache is only
    ever a shortcut)."""
    if key is None or not enabled():
        return False
    try:
        text = json.dumps({"format": FORMAT, "kind": kind, "key": key, "value": value}, allow_nan=False)
    except (TypeError, ValueError):
        return False
    if json.loads(text)["value"] != value:
        return False
    from memfit.files import write_atomic

    try:
        path = _path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text)
        _prune(path.parent)
    except OSError:
        return False
    return True


def _prune(where: Path, max_entries: int | None = None) -> None:
    """Delete the least recently used entries past ``max_entries``, and temporary files of killed writes."""
    limit = MAX_ENTRIES if max_entries is None else max_entries
    with os.scandir(where) as found:
        names = [e.name for e in found if e.is_file()]
    stale_before = time.time() - _STALE_TMP_SECONDS
    for name in names:
        if name.startswith(".") and name.endswith(".tmp"):
            try:
                if os.stat(where / name).st_mtime < stale_before:
                    os.unlink(where / name)
            except OSError:
                pass
    entries = [n for n in names if n.endswith(".json") and not n.startswith(".")]
    if len(entries) <= limit:
        return
    aged = []
    for name in entries:
        try:
            aged.append((os.stat(where / name).st_mtime, name))
        except OSError:
            continue
    aged.sort()
    # Down to 90% of the limit, so that the next writes do not each list and sort the folder again.
    for _, name in aged[: len(aged) - int(limit * 0.9)]:
        try:
            os.unlink(where / name)
        except OSError:
            pass


def clear() -> int:
    """Delete every entry; the number deleted."""
    removed = 0
    try:
        with os.scandir(folder()) as found:
            names = [e.name for e in found if e.is_file() and e.name.endswith(".json")]
    except OSError:
        return 0
    for name in names:
        try:
            os.unlink(folder() / name)
            removed += 1
        except OSError:
            pass
    return removed
