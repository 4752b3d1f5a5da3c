"""The server's scratch folder: a new start removes what a killed server left, and nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from memfit.ui.scratch import adopt, make_scratch, remove_stale


def ended_pid() -> int:
    """The id of a process that has ended."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    return int(done.stdout)


def test_a_start_removes_the_folders_of_servers_that_are_gone_and_nothing_else(tmp_path):
    gone = tmp_path / f"memfit-ui-{ended_pid()}-abcd_123"
    (gone / "cwd").mkdir(parents=True)
    theirs = tmp_path / "pymp-k2j4h5g6"  # multiprocessing's folder of the server that is gone
    theirs.mkdir()
    adopt(gone, theirs)
    alive = tmp_path / f"memfit-ui-{os.getpid()}-abcdefgh"  # this process's: running
    alive.mkdir()
    other_pymp = tmp_path / "pymp-zzzzzzzz"  # nobody named it: not memfit's to remove
    other_pymp.mkdir()
    not_ours = [
        tmp_path / f"memfit-ui-{ended_pid()}-short",
        tmp_path / "memfit-ui-abcdefgh",
        tmp_path / "memfit-ui-configs-x1y2z3w4",
    ]
    for folder in not_ours:
        folder.mkdir()
    link = tmp_path / f"memfit-ui-{ended_pid()}-linklink"  # a link is never followed nor removed
    link.symlink_to(alive)

    removed = remove_stale(tmp_path)

    assert sorted(removed) == sorted([gone, theirs])
    assert not gone.exists() and not theirs.exists()
    assert alive.is_dir() and other_pymp.is_dir() and link.is_symlink() and all(f.is_dir() for f in not_ours)


def test_a_reused_process_id_does_not_keep_a_folder(tmp_path):
    # The id is another process's now, one that started after the folder was last changed.
    later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        folder = tmp_path / f"memfit-ui-{later.pid}-abcdefgh"
        folder.mkdir()
        an_hour_ago = time.time() - 3600
        os.utime(folder, (an_hour_ago, an_hour_ago))
        assert remove_stale(tmp_path) == [folder]
    finally:
        later.kill()
        later.wait()


def test_a_new_folder_is_named_by_its_process(tmp_path):
    folder = make_scratch(tmp_path)
    assert folder.parent == tmp_path and folder.name.startswith(f"memfit-ui-{os.getpid()}-")
    assert remove_stale(tmp_path) == [] and folder.is_dir()
