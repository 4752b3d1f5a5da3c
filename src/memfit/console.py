"""The Rich consoles memfit writes to: laid out for a terminal, whole lines anywhere else.

On a terminal, Rich wraps text and lays tables out for the terminal's width, and memfit's tables are
made to read at 80 columns there. Written to a pipe or a file (``memfit plan | grep``, ``> plan.txt``,
a CI log), a line wrapped at 80 columns is a line cut in two for ``grep`` and scripts: there,
:func:`make_console` gives the console a width no line of memfit's reaches, so that tables take
their natural width and every line its full length. ``COLUMNS`` in the environment still sets the
width, as it does for Rich.

At the bottom of the package: it imports nothing of memfit, and Rich only when a console is made.
"""

from __future__ import annotations

import os
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
