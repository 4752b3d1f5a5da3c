"""The server's scratch folder: one a ``memfit ui`` process, named by it, gone when it ends.

What the server writes to the temporary folder goes in here: its empty working folder, the dropped
training configs it writes (:mod:`memfit.ui.uploads`). multiprocessing's folder for the worker
server's socket stays in the temporary folder itself (a socket's path may not be longer than 107
bytes), and is named in the scratch folder as the server's (:func:`adopt`). The server removes
them when it stops; a server that could not (killed with SIGKILL, a crash, a power cut) leaves
them behind, and the next ``memfit ui`` removes them: a folder whose name is memfit's
(``memfit-ui-<pid>-<8 characters>``), owned by this user, whose process is gone, and the folders
it names.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

#: What a scratch folder's name starts with; the owner's process id and mkdtemp's 8 characters follow.
PREFIX = "memfit-ui-"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-[a-z0-9_]{8}")
#: The file in a scratch folder that names the folders outside it that its server made.
ADOPTED = "adopted-folders.txt"
#: How far a process's start time, as the system reports it, may lie after the moment it really
#: started (Linux counts it in clock ticks from a boot time rounded to the second).
START_TIME_SLACK_S = 2.0


def make_scratch(parent: str | Path | None = None) -> Path:
    """A new scratch folder for this process in ``parent`` (the temporary folder by default), after
    removing the ones of servers that are gone (:func:`remove_stale`)."""
    parent = Path(parent or tempfile.gettempdir())
    remove_stale(parent)
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent))


def adopt(scratch: Path, folder: str | Path) -> None:
    """Name ``folder`` (made by this process in the temporary folder, beside ``scratch``) to be
    removed with ``scratch`` by the next start, should this process end without removing it."""
    with open(scratch / ADOPTED, "a", encoding="utf-8") as names:
        names.write(f"{folder}\n")


def remove_stale(parent: str | Path | None = None) -> list[Path]:
    """Remove the scratch folders in ``parent`` that no running process owns; the ones removed.

    Only a folder named as :func:`make_scratch` names them, owned by this user, that is a folder
    (not a link), whose process has ended: either no process has its id, or the one that has it
    started after the folder was last changed (the id was reused)."""
    parent = Path(parent or tempfile.gettempdir())
    removed = []
    for folder in sorted(parent.glob(f"{PREFIX}*")):
        match = _NAME.fullmatch(folder.name)
        if match is None or not _ours(folder):
            continue
        if not _owner_alive(int(match.group(1)), folder.lstat().st_mtime):
            adopted = [parent / Path(line).name for line in _adopted(folder) if Path(line).parent == parent]
            for path in [*adopted, folder]:
                if path == folder or _ours(path):
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
    return removed


def _ours(path: Path) -> bool:
    """A folder (not a link) of this user's."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return path.is_dir() and not path.is_symlink() and info.st_uid == os.getuid()


def _adopted(folder: Path) -> list[str]:
    try:
        return [line for line in (folder / ADOPTED).read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError):
        return []


def _owner_alive(pid: int, changed_at: float) -> bool:
    """Whether process ``pid`` may be the one that made a folder last changed at ``changed_at``."""
    import psutil

    try:
        started = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # there, but not ours to ask about: keep its folder
        return True
    return started <= changed_at + START_TIME_SLACK_S
