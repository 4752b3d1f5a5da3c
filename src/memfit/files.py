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


def write_or_check(out_dir: str | Path, files: dict[str, str], *, check: bool) -> int:
    """Write generated ``files`` (name -> text) into ``out_dir``, or with ``check`` only compare.

    Returns a process exit code: with ``check``, 1 when a file is missing or differs (each is
    named on stderr), else 0.
    """
    import sys

    out_dir = Path(out_dir)
    if check:
        stale = [n for n, t in files.items() if not (out_dir / n).is_file() or (out_dir / n).read_text(encoding="utf-8") != t]
        for name in stale:
            print(f"out of date: {out_dir / name}", file=sys.stderr)
        return 1 if stale else 0
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        write_atomic(out_dir / name, text)
        print(f"wrote {out_dir / name}")
    return 0
