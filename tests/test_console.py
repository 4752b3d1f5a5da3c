"""memfit's consoles: the terminal's width on a terminal, whole lines in a pipe or a file."""

from __future__ import annotations

import io

from memfit.console import UNWRAPPED_WIDTH, make_console


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
        for path in src.rglob("*.py") if path.name != "console.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "Console(" in line and "quiet=True" not in line
    ]
    assert made_elsewhere == []
