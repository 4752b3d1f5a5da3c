"""write_atomic: a reader sees the old file or the new one, never a partial one."""

import os
import stat

import pytest

from memfit import files
from memfit.files import write_atomic


def test_writes_text_and_bytes(tmp_path):
    path = tmp_path / "a.txt"
    write_atomic(path, "hello\n")
    assert path.read_text() == "hello\n"
    write_atomic(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind
    mode = stat.S_IMODE(path.stat().st_mode)
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask  # not the owner-only mode of a temporary file


def test_failure_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "config.yaml"
    path.write_text("old\n")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, "new\n")
    assert path.read_text() == "old\n"
    assert list(tmp_path.iterdir()) == [path]
