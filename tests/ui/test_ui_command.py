"""`memfit ui`: a bad address or run folder is one line (exit 2); the page is up at once, on loopback
unless told; its processes and folders end with it, and a stop cancels the searches it runs."""

from __future__ import annotations

import json
import signal
import socket
import tempfile
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner
from ui_helpers import GENEROUS_S, Server, start_search, wait_until_gone, wait_until_warm

from memfit.cli import app
from memfit.ui.command import is_loopback

runner = CliRunner()


@pytest.mark.parametrize(
    "args, says",
    [
        (["--port", "70000"], "--port: 70000 is not a port number"),
        (["--host", "no-such-host.invalid"], "--host: 'no-such-host.invalid' is not an address of this machine"),
        (["--run", "/no/such/run"], "run folder '/no/such/run' does not exist"),
    ],
)
def test_a_bad_option_is_one_line_and_exit_2(args, says):
    result = runner.invoke(app, ["ui", *args])
    assert result.exit_code == 2
    assert says in result.stderr and "Traceback" not in result.output


def test_a_port_in_use_says_so():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        result = runner.invoke(app, ["ui", "--port", str(taken.getsockname()[1])])
    finally:
        taken.close()
    assert result.exit_code == 2 and "is in use on 127.0.0.1; choose another" in result.stderr


def test_loopback_addresses():
    assert all(map(is_loopback, ["127.0.0.1", "localhost", "::1", "[::1]", "127.1.2.3"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.168.1.10", "example.com"]))


def test_the_server_serves_the_page_on_loopback_and_stops_on_sigterm():
    server = Server()
    try:
        assert server.url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(server.url) as page:
            assert page.status == 200 and b"memfit" in page.read()
    finally:
        err = server.stop()
    assert "anyone who can reach this machine" not in err


def test_another_address_is_served_with_a_loud_warning():
    server = Server("--host", "0.0.0.0")
    try:
        assert server.url.startswith("http://0.0.0.0:")
        port = server.url.rsplit(":", 1)[1].strip("/")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status") as status:
            assert status.status == 200
    finally:
        err = server.stop()
    assert "warning: memfit ui listens on 0.0.0.0: anyone who can reach this machine" in err
    assert "no password" in err


def test_a_server_killed_with_sigkill_leaves_no_process_and_the_next_start_removes_its_folder():
    import psutil

    with tempfile.TemporaryDirectory(prefix="mf-") as temp:  # short: a socket's path is at most 107 bytes
        server = Server(env={"TMPDIR": temp})
        try:
            wait_until_warm(server.url)  # the workers plans are simulated in: started
            with urllib.request.urlopen(server.url + "api/plan?seq_len=256") as answer:
                assert answer.status == 200
            stream, _ = start_search(server.url)  # and the search's own workers
            me = psutil.Process(server.process.pid)
            processes = me.children(recursive=True)
            scratch = Path(me.cwd()).parent
            assert len(processes) >= 5 and scratch.parent == Path(temp)  # forkserver, tracker, 2 + 2 workers
            server.process.kill()
            server.process.wait()
            stream.close()
            assert wait_until_gone(processes) == []
            assert scratch.is_dir()  # nobody left to remove it...
        finally:
            server.stop()
        again = Server(env={"TMPDIR": temp})
        try:
            assert not scratch.exists()  # ...but the next start
        finally:
            again.stop()


def test_sigterm_during_a_search_cancels_it_and_the_server_ends_saying_so():
    import psutil

    server = Server()
    try:
        wait_until_warm(server.url)
        stream, _ = start_search(server.url)
        processes = psutil.Process(server.process.pid).children(recursive=True)
        server.process.send_signal(signal.SIGTERM)
        # The search far from its end: its stream ends with the stop, not with a result.
        rest = [json.loads(line) for line in stream]
        assert rest[-1]["event"] == "error" and rest[-1]["status"] == 503, rest[-1:]
        assert "the server is stopping" in rest[-1]["error"]
        assert server.process.wait(timeout=GENEROUS_S) == 128 + signal.SIGTERM
    finally:
        err = server.stop()
    assert "memfit ui: stopping (SIGTERM)" in err and "1 search cancelled" in err
    assert wait_until_gone(processes) == []
