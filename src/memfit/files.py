"""Writing files so that nobody ever sees half of one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same folder, then rename it.

    A reader sees the old file or the new one, never a partial write; if anything fails the
    temporary file is removed and ``path`` is untouched. The file gets the permissions a plain
    ``open(path, "w")`` would give (temporary files are created owner-only).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
