"""``memfit ui``: start the page's server, print its address, serve until Ctrl-C."""

from __future__ import annotations

import ipaddress
import socket
import threading
from pathlib import Path

import typer

from memfit.errors import UserError, cli_errors

DEFAULT_PORT = 7860
DEFAULT_HOST = "127.0.0.1"


class ServeError(UserError):
    """An address the page cannot be served on."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def open_socket(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: any free port), or a :class:`ServeError` that
    says why not and what to use instead."""
    if not 0 <= port <= 65535:
        raise ServeError(
            f"--port: {port} is not a port number; use 1 to 65535 (e.g. --port {DEFAULT_PORT}), or 0 for any free port."
        )
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise ServeError(
            f"--host: {host!r} is not an address of this machine ({err.strerror}); use e.g. --host {DEFAULT_HOST}."
        ) from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        if err.errno in (98, 48):  # EADDRINUSE on Linux, macOS
            raise ServeError(
                f"--port: {port} is in use on {host}; choose another (e.g. --port {port + 1}), or --port 0 for any free port."
            ) from None
        raise ServeError(
            f"--host {host} --port {port}: cannot listen there ({err.strerror}); use e.g. --host {DEFAULT_HOST}."
        ) from None
    sock.listen(128)
    return sock


def page_url(sock: socket.socket, host: str) -> str:
    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/"


@cli_errors
def ui_command(
    port: int = typer.Option(DEFAULT_PORT, "--port", help="Port to serve the page on (0: any free port)."),
    host: str = typer.Option(
        DEFAULT_HOST,
        "--host",
        help="Address to listen on. The default keeps the page to this machine; "
        "another address makes it reachable from the network, with no password.",
    ),
    open_browser: bool = typer.Option(False, "--open", help="Open the page in the default web browser."),
    run: Path | None = typer.Option(
        None, "--run", help="A run folder (memfit train's output_dir) to show against its plan."
    ),
) -> None:
    """Plan, fit and compare on a local web page: the planner behind a browser form.

    The page answers from the same API as `memfit plan` and `memfit fit` (its /api/plan and
    /api/fit return their --json output). Exit code 2: a bad --port, --host or --run."""
    from memfit.ui.runs import check_run_folder

    run_dir = check_run_folder(run) if run is not None else None  # a bad folder: one line, before the server starts
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise ServeError(
            f"memfit ui needs {err.name}, which is not installed: pip install starlette uvicorn."
        ) from None
    sock = open_socket(host, port)
    url = page_url(sock, host)
    if not is_loopback(host):
        typer.secho(
            f"warning: memfit ui listens on {host}: anyone who can reach this machine on port {sock.getsockname()[1]} "
            f"can use the page and make the server plan (no password, no TLS). Use --host {DEFAULT_HOST} to keep "
            "it to this machine.",
            fg="yellow",
            bold=True,
            err=True,
        )
    _serve(sock, url, run_dir, open_browser)


def _serve(sock: socket.socket, url: str, run_dir: Path | None, open_browser: bool) -> None:
    """Serve the page on ``sock`` until SIGTERM or Ctrl-C, from a scratch folder of the server's own."""
    import os
    import signal
    import tempfile
    from multiprocessing import util as multiprocessing_util

    from memfit.ui.app import create_app
    from memfit.ui.scratch import adopt, make_scratch
    from memfit.ui.service import PlannerService

    # What the server writes to the temporary folder goes into its scratch folder, removed at the
    # end, or by the next start if this process is killed; multiprocessing's folder (the worker
    # server's socket, whose path must stay short) beside it, named in it.
    scratch = make_scratch()
    _remove_at_exit(scratch)
    adopt(scratch, multiprocessing_util.get_temp_dir())
    tempfile.tempdir = str(scratch)
    # The page names models, never paths; an empty working folder makes sure that a name which also
    # reads as a relative path (a Hub id's org/name) can never reach the files beside the user.
    empty = scratch / "cwd"
    empty.mkdir()
    os.chdir(empty)
    # A plan's two sampled depths are simulated side by side, in two processes kept for the server's life.
    service = PlannerService(depth_workers=2)
    service.warm()
    app = create_app(service, run_dir=run_dir)
    print(f"memfit ui: {url}  (Ctrl-C to stop)", flush=True)
    if open_browser:
        import webbrowser

        webbrowser.open(url)
    # uvicorn stops gracefully on SIGTERM, then raises it again with the handler it found: this
    # one, which ends the command through the finally below, so that the workers end too.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        _stopping_server(app, service).run(sockets=[sock])
    finally:
        service.close()  # the planner's worker processes end with the server


def _stopping_server(app, service):
    """A uvicorn server of ``app`` that, on the first SIGTERM or Ctrl-C, says it is stopping and
    stops ``service`` at once (searches cancelled, workers ended), so that the requests it waits
    for end now rather than when their searches would have."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first:  # in a thread: a signal handler should not print or wait for processes
                threading.Thread(target=_stop, args=(service, sig), name="memfit-ui-stop", daemon=True).start()

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    return Server(config)


def _stop(service, sig: int) -> None:
    import signal
    import sys

    name = signal.Signals(sig).name
    print(f"memfit ui: stopping ({name})", file=sys.stderr, flush=True)
    searches = service.stop()
    if searches:
        print(f"memfit ui: {searches} search{'es' if searches > 1 else ''} cancelled", file=sys.stderr, flush=True)


def _remove_at_exit(folder: Path) -> None:
    """Remove ``folder`` when this process exits, with multiprocessing's exit handlers (after its
    own folder, at priority -100: this one runs last)."""
    import shutil
    from multiprocessing.util import Finalize

    Finalize(None, shutil.rmtree, args=(str(folder),), kwargs={"ignore_errors": True}, exitpriority=-200)


def _exit_on_signal(signum: int, frame) -> None:
    raise SystemExit(128 + signum)
