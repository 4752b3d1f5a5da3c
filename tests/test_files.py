"""write_atomic: a reader sees the old file or the new one, never a partial one; an output is never an input."""

import os
import stat

import pytest

from memfit import files
from memfit.errors import PathError, path_error_message
from memfit.files import check_not_an_input, same_path, write_atomic


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


def test_a_failed_write_names_the_file_never_its_temporary_name(tmp_path):
    path = tmp_path / "missing" / "out.json"
    with pytest.raises(OSError) as err:
        write_atomic(path, "{}")
    assert err.value.filename == str(path)
    assert path_error_message(err.value) == f"cannot use {str(path)!r}: it does not exist; check the path."


def test_a_full_disk_while_writing_names_the_file(tmp_path, monkeypatch):
    import errno

    path = tmp_path / "out.jsonl"
    with pytest.raises(OSError) as err:
        with files.atomic_file(path) as handle:
            handle.write("a line\n")
            raise OSError(errno.ENOSPC, "No space left on device")  # as a write to the open file says it
    assert err.value.filename == str(path) and list(tmp_path.iterdir()) == []


def test_an_output_is_never_one_of_the_inputs(tmp_path, monkeypatch):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("mine\n")
    (tmp_path / "link.jsonl").symlink_to(prompts)
    os.link(prompts, tmp_path / "hard.jsonl")
    monkeypatch.chdir(tmp_path)
    for out in (
        prompts,
        tmp_path / "link.jsonl",
        tmp_path / "hard.jsonl",
        "p.jsonl",
        tmp_path / "x" / ".." / "p.jsonl",
    ):
        assert same_path(out, prompts), out
        with pytest.raises(
            PathError,
            match=r"--out .* is the --prompts file.*which this command reads: memfit never writes "
            r"over its inputs, --overwrite or not \(it replaces only what memfit wrote\)",
        ):
            check_not_an_input(out, "--out", {"--prompts file": prompts}, overwrite=True)
    check_not_an_input(tmp_path / "other.jsonl", "--out", {"--prompts file": prompts, "--adapter": None})
    assert not same_path(tmp_path / "new.jsonl", prompts) and same_path(tmp_path / "new.jsonl", "new.jsonl")
