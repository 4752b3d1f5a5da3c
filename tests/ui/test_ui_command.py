"""`memfit ui`: a bad address or run folder is one line (exit 2); the page is up at once, on loopback unless told."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from typer.testing import CliRunner

from memfit.cli import app
from memfit.ui.command import is_loopback

from ui_helpers import Server

runner = CliRunner()


@pytest.mark.parametrize("args, says", [
    (["--port", "70000"], "--port: 70000 is not a port number"),
    (["--host", "no-such-host.invalid"], "--host: 'no-such-host.invalid' is not an address of this machine"),
    (["--run", "/no/such/run"], "run folder '/no/such/run' does not exist"),
])
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
