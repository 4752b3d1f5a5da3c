"""The Rich consoles memfit writes to: laid out for a terminal, whole lines anywhere else.

On a terminal, Rich wraps text and lays tables out for the terminal's width, and memfit's tables are
made to read at 80 columns there. Written to a pipe or a file (``memfit plan | grep``, ``> plan.txt``,
a CI log), a line wrapped at 80 columns is a line cut in two for ``grep`` and scripts: there,
:func:`make_console` gives the console a width no line of memfit's reaches, so that tables take
their natural width and every line its full length. ``COLUMNS`` in the environment still sets the
width, as it does for Rich.

:class:`StatusLine` is the one status line a long command shows on a terminal while it works
(``memfit fit``'s search, ``memfit plan``'s model and simulation), gone once the work is done.

At the bottom of the package: it imports nothing of memfit, and Rich only when a console is made.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

#: The width of a console that is not a terminal: wider than any line memfit writes, so none wraps.
UNWRAPPED_WIDTH = 10_000


def make_console(*, stderr: bool = False, **options: Any):
    """A Rich ``Console`` on stdout (or ``stderr``): the terminal's width on a terminal (or
    ``COLUMNS``, or ``width=`` when given), :data:`UNWRAPPED_WIDTH` elsewhere. ``options`` are
    Rich's (``quiet``, ``record``...).

    Whether the stream is a terminal is decided now: make the console when the command runs, not
    at import (a test runner or a shell may swap the stream in between)."""
    from rich.console import Console

    console = Console(stderr=stderr, **options)
    if console.is_terminal or "width" in options or os.environ.get("COLUMNS", "").strip().isdigit():
        return console
    return Console(stderr=stderr, width=UNWRAPPED_WIDTH, **options)


def start_timer(delay_s: float, callback: Callable[[], None]) -> Any:
    """Call ``callback`` in ``delay_s`` seconds, from a thread of its own (which never keeps the
    process alive); returns what ``cancel()`` stops."""
    timer = threading.Timer(delay_s, callback)
    timer.daemon = True
    timer.start()
    return timer


class StatusLine:
    """One status line on a terminal: Rich's status (a spinner and ``text``), transient, so that
    nothing of it is left once :meth:`close` is called and the command prints its result.

    It appears only once the work has taken ``delay_s`` seconds (a quick command prints nothing but
    its result), from a timer: ``timer(delay_s, show)`` (default :func:`start_timer`; a test passes
    its own and calls ``show`` itself, with no waiting). Where ``console`` is not a terminal (a
    pipe, a log file) it shows nothing at all. :meth:`update` changes the text, shown or not yet.
    """

    def __init__(
        self,
        console: Any,
        text: str,
        *,
        delay_s: float = 0.0,
        timer: Callable[[float, Callable[[], None]], Any] = start_timer,
    ) -> None:
        self.console = console
        self.text = text
        self._status: Any = None
        self._timer: Any = None
        self._closed = False
        self._lock = threading.Lock()  # the timer's thread shows it, the command's updates and closes it
        if not console.is_terminal:
            return
        if delay_s <= 0:
            self.show()
        else:
            self._timer = timer(delay_s, self.show)

    @property
    def shown(self) -> bool:
        """Whether the line is on the terminal now."""
        return self._status is not None

    def show(self) -> None:
        """Put the line on the terminal (the timer calls this once the delay has passed)."""
        with self._lock:
            if self._closed or self._status is not None:
                return
            self._status = self.console.status(self.text)
            self._status.start()

    def update(self, text: str) -> None:
        """Say ``text`` from now on."""
        with self._lock:
            self.text = text
            if self._status is not None:
                self._status.update(text)

    def close(self) -> None:
        """Take the line away (and never show it, if it was not yet)."""
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
            if self._status is not None:
                self._status.stop()
                self._status = None

    def __enter__(self) -> StatusLine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
