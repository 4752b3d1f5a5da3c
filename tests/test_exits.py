"""A finished command ends as sys.exit would end it, its exit handlers run, without the teardown."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from memfit.exits import end_process


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


def test_end_process_keeps_the_status_the_output_and_the_exit_handlers(tmp_path):
    marker = tmp_path / "handler-ran"
    done = _run(f"""
        import atexit, sys, torch
        from memfit.exits import end_process
        atexit.register(lambda: open({str(marker)!r}, "w").write("yes"))
        sys.stdout.write("unflushed output")
        end_process(3)
        print("never")
    """)
    assert done.returncode == 3
    assert done.stdout == "unflushed output"
    assert marker.read_text() == "yes"


@pytest.mark.parametrize(("code", "status", "stderr"), [(None, 0, ""), ("a message", 1, "a message\n")])
def test_end_process_reads_the_code_as_sys_exit_does(code, status, stderr):
    done = _run(f"""
        import torch
        from memfit.exits import end_process
        end_process({code!r})
    """)
    assert (done.returncode, done.stderr) == (status, stderr)


def test_a_thread_still_running_is_waited_for(tmp_path):
    marker = tmp_path / "thread-done"
    done = _run(f"""
        import threading, time, torch
        from memfit.exits import end_process
        def late():
            time.sleep(0.3)
            open({str(marker)!r}, "w").write("done")
        threading.Thread(target=late).start()
        end_process(0)
    """)
    assert done.returncode == 0
    assert marker.read_text() == "done"


def test_without_torch_it_is_sys_exit(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    with pytest.raises(SystemExit) as exited:
        end_process(4)
    assert exited.value.code == 4


def test_a_process_told_to_skip_the_teardown_still_ends_with_its_output():
    done = _run("""
        import sys, torch
        from memfit.exits import skip_teardown_at_exit
        skip_teardown_at_exit()
        sys.stdout.write("said")
    """)
    assert (done.returncode, done.stdout) == (0, "said")
