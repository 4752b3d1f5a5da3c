"""Writing files so that nobody ever sees half of one; checking, before any work, that they can be written.

Files and folders memfit creates get the permissions the user's umask gives (as ``open`` and
``mkdir`` would), also where they are first made under a private temporary name. Output paths are
checked before the work that fills them starts (:func:`check_folder_writable`,
:func:`check_file_writable`), never one of the command's inputs (:func:`check_not_an_input`: the
same file, however it is reached), and a folder made for a command that then failed is removed
while it is still empty (:func:`make_folder`, :func:`remove_if_empty`). A message about a file
written through a temporary name names the file, never the temporary name.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from memfit.errors import PathError


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same folder, then rename it.

    A reader sees the old file or the new one, never a partial write; if anything fails the
    temporary file is removed and ``path`` is untouched. The file gets the permissions a plain
    ``open(path, "w")`` would give (temporary files are created owner-only).
    """
    with atomic_file(path, binary=True) as handle:
        handle.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


@contextmanager
def atomic_file(path: str | Path, *, binary: bool = False) -> Iterator[IO]:
    """A file to write ``path``'s content into, line by line if need be: it is a temporary file in
    the same folder until the block ends, then renamed to ``path`` (see :func:`write_atomic`).

    An ``OSError`` on the way (a missing folder, a full disk) names ``path``, never the temporary
    name, which is the user's business only in that it is gone: removed on any failure."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise _naming(err, path, err.filename) from None  # the temporary name it tried
    try:
        with os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8") as handle:
            yield handle
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise _naming(err, path, tmp) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _naming(err: OSError, path: Path, tmp: str | None) -> OSError:
    """``err`` about ``path`` (the file the user asked for) rather than the temporary file ``tmp``
    beside it; an error about another file, or without a number, is passed on as it was."""
    if err.errno is None or err.filename not in (None, tmp):
        return err
    return type(err)(err.errno, err.strerror or os.strerror(err.errno), str(path))


#: The text formats a file's extension names.
FORMATS = {".json": "json", ".yaml": "yaml", ".yml": "yaml"}


def file_format(path: str | Path, default: str) -> str:
    """``json`` or ``yaml``, as the extension of ``path`` says; ``default`` for any other extension.
    A file memfit writes is in the format its name says (``fit --write out.json`` writes JSON)."""
    return FORMATS.get(Path(path).suffix.lower(), default)


def write_or_check(out_dir: str | Path, files: dict[str, str], *, check: bool) -> int:
    """Write generated ``files`` (name -> text) into ``out_dir``, or with ``check`` only compare.

    Returns a process exit code: with ``check``, 1 when a file is missing or differs (each is
    named on stderr), else 0.
    """
    import sys

    out_dir = Path(out_dir)
    if check:
        stale = [
            n for n, t in files.items() if not (out_dir / n).is_file() or (out_dir / n).read_text(encoding="utf-8") != t
        ]
        for name in stale:
            print(f"out of date: {out_dir / name}", file=sys.stderr)
        return 1 if stale else 0
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        write_atomic(out_dir / name, text)
        print(f"wrote {out_dir / name}")
    return 0


# ------------------------------------------------------------------------------------------------
# memfit's cache


def memfit_cache_dir() -> Path:
    """memfit's own cache folder: $MEMFIT_CACHE, else $XDG_CACHE_HOME/memfit, else ~/.cache/memfit.

    One root for every kind of thing memfit caches, each in a subfolder of its own (``converted/``:
    pickled checkpoints converted to safetensors; ``plans/``: plans, :mod:`memfit.planner.shortcuts.cache`).
    """
    explicit = os.environ.get("MEMFIT_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "memfit"


# ------------------------------------------------------------------------------------------------
# Permissions


def current_umask() -> int:
    """The process's umask (reading it means setting it: it is put back at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def make_temp_folder(prefix: str, parent: str | Path) -> Path:
    """A new uniquely named folder in ``parent`` with the permissions ``mkdir`` gives (``mkdtemp``
    alone makes it owner-only, 0700, and the folder may become a user's output once renamed)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(path, 0o777 & ~current_umask())
    return path


def apply_umask(path: str | Path) -> None:
    """Give ``path`` and everything under it the permissions ``open``/``mkdir`` would have given
    (for trees written by libraries that create private temporary files)."""
    mask = current_umask()
    root = Path(path)
    for folder, _, files in os.walk(root):
        os.chmod(folder, 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o666 & ~mask)


def process_alive(pid: int) -> bool:
    """Whether a process with id ``pid`` exists on this machine (this process included): a
    temporary folder named with the id of a process that is gone was abandoned by it."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by someone else
    except OverflowError:
        return False  # not a possible process id
    return True


# ------------------------------------------------------------------------------------------------
# Output paths, checked before the work


def nearest_existing(path: str | Path) -> Path:
    """``path`` itself if it exists, else its closest ancestor that does."""
    path = Path(os.path.abspath(Path(path).expanduser()))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_folder_writable(path: str | Path, option: str) -> None:
    """Raise :class:`~memfit.errors.PathError` unless ``path`` is a folder memfit can create or
    write into. ``option`` names where the path came from (``--out``, ``output_dir``).

    A file is created and removed in the folder (or the closest ancestor that exists): on a
    read-only mount, or as root, the permission bits alone do not tell.
    """
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise PathError(f"{option} {str(path)!r} is a file, not a folder: choose a folder path.")
    _probe(nearest_existing(path), path, option)


def check_file_writable(path: str | Path, option: str, *, make_parents: bool = False) -> None:
    """Raise :class:`~memfit.errors.PathError` unless a file can be written at ``path``: not a
    folder, its folder exists (or, with ``make_parents``, can be created) and may be written."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise PathError(f"{option} {str(path)!r} is a folder: pass a file path.")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.exists() and not make_parents:
        raise PathError(
            f"{option} {str(path)!r}: the folder {str(parent)!r} does not exist; create it or choose another path."
        )
    _probe(nearest_existing(parent), path, option)


_PROBE_REASONS = {
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "the file system is read-only",
    errno.ENOSPC: "no space left on the device",
}


def _probe(folder: Path, path: Path, option: str) -> None:
    if not folder.is_dir():
        raise PathError(f"{option} {str(path)!r}: {str(folder)!r} is a file, not a folder; choose another path.")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".memfit-probe-")
    except OSError as err:
        reason = _PROBE_REASONS.get(err.errno or 0, err.strerror or str(err))
        raise PathError(
            f"{option} {str(path)!r}: cannot write in {str(folder)!r} ({reason}); choose a path you may write to."
        ) from None
    os.close(fd)
    os.unlink(probe)


def make_folder(path: str | Path) -> list[Path]:
    """Create folder ``path`` and its missing parents; return the folders created, outermost first
    (for :func:`remove_if_empty` after a failure)."""
    path = Path(path).expanduser()
    missing = []
    walk = Path(os.path.abspath(path))
    while not walk.exists() and walk != walk.parent:
        missing.append(walk)
        walk = walk.parent
    path.mkdir(parents=True, exist_ok=True)
    return list(reversed(missing))


def remove_if_empty(created: list[Path]) -> None:
    """Remove the folders :func:`make_folder` created, innermost first, while they are empty: a
    command that failed leaves no empty output folder behind (anything written stays)."""
    for folder in reversed(created):
        try:
            folder.rmdir()
        except OSError:
            return  # not empty (something was written), or gone: leave it and its parents


# ------------------------------------------------------------------------------------------------
# Inputs are never outputs


def same_path(a: str | Path, b: str | Path) -> bool:
    """Whether ``a`` and ``b`` are the same file or folder: through symbolic links, relative paths
    and hard links (``os.path.samefile``, where both exist); two paths of which one does not exist
    are the same when they resolve to the same place."""
    a, b = Path(a).expanduser(), Path(b).expanduser()
    if hasattr(os.path, "samefile"):
        try:
            return os.path.samefile(a, b)
        except OSError:
            pass  # one of them does not exist (yet)
    return os.path.realpath(a) == os.path.realpath(b)


def input_clash(
    out: str | Path, option: str, inputs: Mapping[str, str | Path | None], *, overwrite: bool = False
) -> str | None:
    """The line that refuses output ``out`` (given as ``option``) because it is one of the command's
    ``inputs`` (how each was given, e.g. ``--prompts file``, -> its path; None: not given), or None.
    ``overwrite``: the user passed ``--overwrite``, which the line answers."""
    for given_as, path in inputs.items():
        if path is not None and str(path) != "" and same_path(out, path):
            same = "" if str(out) == str(path) else f" {str(path)!r}"
            answer = ", --overwrite or not (it replaces only what memfit wrote)" if overwrite else ""
            return (
                f"{option} {str(out)!r} is the {given_as}{same}, which this command reads: memfit never writes over "
                f"its inputs{answer}. Choose another {option}."
            )
    return None


def check_not_an_input(
    out: str | Path, option: str, inputs: Mapping[str, str | Path | None], *, overwrite: bool = False
) -> None:
    """Raise :class:`~memfit.errors.PathError` when output ``out`` is one of the command's ``inputs``
    (see :func:`input_clash`), whatever ``--overwrite`` says."""
    problem = input_clash(out, option, inputs, overwrite=overwrite)
    if problem:
        raise PathError(problem)
