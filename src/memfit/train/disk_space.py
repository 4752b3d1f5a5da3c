"""Saving onto a disk that may fill up: what was being written is removed, and the error says how
much it needed, how much is free and on which disk.

Checkpoints and the run's output are written into a temporary folder and renamed into place
(:mod:`memfit.train.checkpointing`, :mod:`memfit.train.run_folder`). :func:`saving` wraps that
writing: on any failure the temporary folder is removed (what was there before stays as it was),
and a failure because the disk is full becomes a :class:`~memfit.train.errors.DiskFull` with one
line for the user. The writers do not all say "no space left": Python and safetensors do (errno 28,
``os error 28``); PyTorch's ``torch.save`` reports a position mismatch in its zip writer, raised while
handling the file's OSError when it writes to a Python file (the checkpoint writes it so) and with
no cause when it opens the path itself. So a write that failed while less is free than what was
still to be written counts as a full disk too.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.train.errors import DiskFull
from memfit.units import format_bytes

#: errno values of a full disk: no space left, or the user's quota reached.
FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)

#: How the writers that give no errno say it (safetensors: "I/O error: No space left on device
#: (os error 28)").
_FULL_DISK_TEXTS = ("no space left on device", "disk quota exceeded", "os error 28", "os error 122")

#: Below this much free space a failed write is put down to the full disk even when what was still
#: to be written is estimated smaller (file system blocks, metadata, estimates that are short).
_NEARLY_FULL_BYTES = 1 << 20


@dataclass
class Need:
    """Bytes a save needs, at least: what is known at its start, raised by the writer as it learns
    more (the tokenizer's files once written)."""

    bytes: int


@contextmanager
def saving(tmp: Path, *, what: str, needed_bytes: int, then: str) -> Iterator[Need]:
    """Write ``what`` into the temporary folder ``tmp``: on failure remove ``tmp``, and when the disk
    is full raise :class:`DiskFull` (saying what it needs, the free space and ``then``: what the user
    has left and does next). Other failures pass on unchanged."""
    need = Need(needed_bytes)
    try:
        yield need
    except BaseException as err:
        full = isinstance(err, Exception) and is_full_disk(err, free_bytes(tmp.parent), need.bytes - folder_bytes(tmp))
        shutil.rmtree(tmp, ignore_errors=True)
        if not full:
            raise
        raise DiskFull(full_disk_message(tmp.parent, what, need.bytes, then)) from None


def is_full_disk(err: BaseException, free_bytes_left: int | None, unwritten_bytes: int) -> bool:
    """Whether writing failed with ``err`` because the disk is full: the error, or one it was raised
    while handling, says so, or it is a write error (OSError, RuntimeError) while ``free_bytes_left``
    is less than the ``unwritten_bytes`` still to be written."""
    cause: BaseException | None = err
    for _ in range(16):  # torch.save's RuntimeError is raised while handling the file's OSError
        if cause is None:
            break
        if isinstance(cause, OSError) and cause.errno in FULL_DISK_ERRNOS:
            return True
        if any(text in str(cause).lower() for text in _FULL_DISK_TEXTS):
            return True
        cause = cause.__cause__ or cause.__context__
    if not isinstance(err, (OSError, RuntimeError)) or free_bytes_left is None:
        return False
    return free_bytes_left < max(unwritten_bytes, _NEARLY_FULL_BYTES)


def full_disk_message(folder: Path, what: str, needed_bytes: int | None, then: str) -> str:
    """``no space left on the disk mounted at /data for <what> in <folder>: it needs at least 1.2 GiB,
    300 MiB is free there. <then>`` (without the need when ``needed_bytes`` is None)."""
    free = free_bytes(folder)
    free_text = f"{format_bytes(free)} is free there" if free is not None else "the free space could not be read"
    need = f"it needs at least {format_bytes(needed_bytes)}, " if needed_bytes is not None else ""
    return (
        f"no space left on the disk mounted at {mount_point(folder)} for {what} in {folder}: {need}{free_text}. {then}"
    )


def after_full_disk(
    run_dir: Path, checkpoint: Path | None, *, named: str = "The run's last checkpoint", then: str = ""
) -> str:
    """What the user does after a full disk stopped the run in ``run_dir``: free some space and
    continue from ``checkpoint`` with ``--resume`` (``then``: what the resume does next), or, with no
    checkpoint saved, start again: a ``--resume`` would have nothing to start from, and a new run
    does not start in a folder that holds one which saved none."""
    if checkpoint is not None:
        return f"{named}, {checkpoint}, is whole: free some space there and run the same command with --resume{then}."
    return (
        f"No checkpoint was saved yet, so there is nothing to resume: free some space there (or choose an output_dir "
        f"on a larger disk) and start the run again in a new output_dir, or delete {run_dir} first."
    )


def free_bytes(path: Path) -> int | None:
    """Bytes the user may still write on the disk holding ``path`` (its nearest existing folder)."""
    for folder in (Path(path), *Path(path).parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def mount_point(path: Path) -> Path:
    """The mount point of the file system holding ``path``: which disk is full."""
    folder = Path(os.path.abspath(path))
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    while not os.path.ismount(folder) and folder != folder.parent:
        folder = folder.parent
    return folder


def folder_bytes(path: Path) -> int:
    """Disk space the files under ``path`` take, whole blocks counted (0 when it does not exist)."""
    if not Path(path).is_dir():
        return 0
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                stat = os.stat(os.path.join(root, name))
            except OSError:
                continue  # removed meanwhile
            total += max(stat.st_size, getattr(stat, "st_blocks", 0) * 512)
    return total


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` (nested dicts, lists and tuples), each storage once: about
    what ``torch.save`` or safetensors writes for it."""
    import torch

    seen: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.device.type == "meta":
                continue
            storage = item.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total
