"""memfit's consoles: the terminal's width on a terminal, whole lines in a pipe or a file."""

from __future__ import annotations

import io

from memfit.console import UNWRAPPED_WIDTH, StatusLine, make_console


def test_a_pipe_or_a_file_gets_whole_lines(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    out = io.StringIO()
    console = make_console(file=out)
    assert not console.is_terminal and console.width == UNWRAPPED_WIDTH
    line = "word " * 60  # 300 characters
    console.print(line.strip())
    assert out.getvalue() == line.strip() + "\n"


def test_a_terminal_keeps_its_width_and_columns_or_width_win(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert make_console(file=io.StringIO(), force_terminal=True).width < UNWRAPPED_WIDTH
    assert make_console(file=io.StringIO(), width=100).width == 100
    monkeypatch.setenv("COLUMNS", "80")
    assert make_console(file=io.StringIO()).width == 80


def test_every_console_that_prints_is_made_by_make_console():
    # A Rich Console made elsewhere wraps a pipe's lines at 80 columns again; a quiet one prints nothing.
    from pathlib import Path

    import memfit

    src = Path(memfit.__file__).resolve().parent
    made_elsewhere = [
        f"{path.relative_to(src)}:{number}"
        for path in src.rglob("*.py")
        if path.name != "console.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "Console(" in line and "quiet=True" not in line
    ]
    assert made_elsewhere == []


class FakeTimer:
    """Stands for the status line's timer: records the delay and the callback; a test calls it."""

    def __init__(self) -> None:
        self.delay_s: float | None = None
        self.callback = None
        self.cancelled = False

    def __call__(self, delay_s, callback):
        self.delay_s, self.callback = delay_s, callback
        return self

    def cancel(self) -> None:
        self.cancelled = True


def test_a_status_line_waits_for_its_delay_then_goes_when_closed():
    out, timer = io.StringIO(), FakeTimer()
    line = StatusLine(
        make_console(file=out, force_terminal=True, width=100), "planning x: checking", delay_s=1.0, timer=timer
    )
    assert timer.delay_s == 1.0 and not line.shown and out.getvalue() == ""  # a quick command prints nothing
    line.update("planning x: building the model")
    timer.callback()  # a second has passed
    assert line.shown and line.text == "planning x: building the model"
    line.close()
    assert not line.shown and timer.cancelled
    shown = out.getvalue()
    assert "planning x: building the model" in shown
    assert shown.endswith("\x1b[1A\x1b[2K")  # back up a line and erase it: nothing is left for the plan to follow


def test_a_status_line_closed_before_its_delay_never_shows():
    out, timer = io.StringIO(), FakeTimer()
    line = StatusLine(make_console(file=out, force_terminal=True), "planning x", delay_s=1.0, timer=timer)
    line.close()
    timer.callback()  # the timer's thread lost the race: still nothing
    assert not line.shown and out.getvalue() == ""


def test_a_status_line_says_nothing_where_stderr_is_not_a_terminal():
    out, timer = io.StringIO(), FakeTimer()
    with StatusLine(make_console(file=out), "planning x", delay_s=1.0, timer=timer) as line:
        line.update("planning x: building")
    assert timer.callback is None and out.getvalue() == ""
