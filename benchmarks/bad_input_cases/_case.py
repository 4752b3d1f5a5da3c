"""One case of benchmarks/bad_inputs.py."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Case:
    """A command line as typed (``{d}``: the inputs folder, ``{u}``: a folder nobody may write in),
    the exit code the documentation gives it, and environment variables set for it."""

    line: str
    code: int
    env: dict = field(default_factory=dict)
    fast: bool = False  # in the subset the test suite runs
    says: tuple[str, ...] = ()  # texts stderr must hold (``{d}`` is the inputs folder), case-sensitive
    keeps: tuple[str, ...] = ()  # files and folders under ``{d}`` that must not change (paths relative to it)
    #: The program run with the line's arguments (default: ``python -m memfit``); ``{python}`` is this
    #: interpreter, ``{bench}`` the benchmarks folder, ``{d}`` the inputs folder.
    prefix: tuple[str, ...] = ()

    @property
    def command(self) -> str:
        return self.line.split()[0] if self.line.strip() else "(none)"
