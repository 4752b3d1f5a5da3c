"""Ending a process without Python's teardown of the modules it imported.

Once a command is done, Python tears down every module it imported before the process ends; with
torch and transformers imported that takes over a second (on the 2-core benchmark machine,
`memfit fit llama-3.1-8b --gpu rtx-4090 --json` ended 1.3 s after its last output, none of it in
exit handlers; 0.06 s with :func:`end_process`). Nothing memfit keeps needs that teardown: files
are written and closed by then, and what must run at exit is registered with :mod:`atexit`
(temporary folders, multiprocessing's clean-up, logging's flush), which still runs. So a finished
command ends with :func:`os._exit` after the exit handlers, and so does the search's worker server
(which only forks workers), whose teardown a command piped to another waits for too.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def end_process(code: int | str | None = 0) -> NoReturn:
    """End this process with ``code`` as ``sys.exit(code)`` would, the exit handlers run, without
    the teardown of its modules. Falls back to ``sys.exit`` where that teardown is cheap (torch not
    imported) or where another thread still runs (Python waits for it at exit)."""
    if "torch" not in sys.modules or any(
        t is not threading.main_thread() and not t.daemon and t.is_alive() for t in threading.enumerate()
    ):
        sys.exit(code)
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): the message on stderr, status 1
        print(code, file=sys.stderr)
        status = 1
    _flush()
    atexit._run_exitfuncs()
    _flush()
    os._exit(status)


def skip_teardown_at_exit() -> None:
    """Make this process end without the teardown of its modules once it starts to exit: for a
    helper process (the search's worker server) that holds nothing to clean up. The handlers
    registered before this call do not run."""
    atexit.register(_end_now)


def _end_now() -> None:
    _flush()
    os._exit(0)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed, or replaced by something without flush
            pass
