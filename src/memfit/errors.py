"""What a user did wrong, and the one place where every command turns it into a message and an exit code.

Every error memfit raises for a problem with its input (a bad knob, a missing file, a folder it
may not write, a run that does not fit) is a :class:`UserError`: its message names the field or
path, the value and the fix, and its ``exit_code`` says how the command ends. The command-line
functions are wrapped in :func:`cli_errors`, which prints such an error as ``error: <message>`` on
stderr and exits with its code; an ``OSError`` about a path (permission, read-only disk, a file
where a folder is expected, no space) becomes one such line too. Anything else is a bug in memfit
and keeps its traceback.

Exit codes, the same for every command:

====  =====================================================================
0     done
1     ``memfit doctor`` found at least one error-level problem in the run
2     bad input: an option, a config field, a file or folder (nothing started)
3     does not fit: a plan over its GPU or budget, a ``fit`` that finds
      nothing, a preflight refusal, a run that ran out of memory
130   stopped by SIGINT (Ctrl-C), 143 by SIGTERM (128 + the signal number)
====  =====================================================================

At the bottom of the package: it imports only memfit.console, and that, Rich and Typer
only inside :func:`cli_errors`'s handler.
"""

from __future__ import annotations

import errno
import functools
import re
from collections.abc import Callable
from typing import Any

#: Exit code of a bad input (option, config field, file or folder).
EXIT_BAD_INPUT = 2
#: Exit code of a run, plan or search that does not fit its memory.
EXIT_DOES_NOT_FIT = 3


class UserError(Exception):
    """A problem with what the user gave, not with memfit: shown as one line (or a short list),
    never with a traceback. ``exit_code`` is how the command ends (:data:`EXIT_BAD_INPUT` unless a
    subclass says otherwise)."""

    exit_code: int = EXIT_BAD_INPUT

    def explain(self, console: Any) -> None:
        """Print what comes before the ``error:`` line (a plan, a table); nothing by default."""


#: A value a message shows is cut past this many characters: a 10,000-character model name or
#: option value leaves the message one readable line, with the field and the fix.
LONG_VALUE_CHARS = 256
#: How much of a cut value is shown.
SHOWN_VALUE_CHARS = 80

# A quoted value (as repr() writes it) or any run of text without a space, longer than LONG_VALUE_CHARS.
# A quoted value starts and ends with what it holds, never a space: the text between the closing
# quote of one short value and the opening quote of the next (`'cosin' is not ... Did you mean '`)
# is the message, not a value.
_LONG = f"{{{LONG_VALUE_CHARS},}}"  # the pattern's "LONG_VALUE_CHARS or more"
_LONG_VALUE = re.compile(rf"'(?=\S)[^'\n]{_LONG}(?<=\S)'|\"(?=\S)[^\"\n]{_LONG}(?<=\S)\"|\S{_LONG}")


def shown(value: Any) -> str:
    """``repr(value)`` for a message, cut as :func:`clip_long_values` cuts a value when it is long
    (whatever it holds: spaces at its ends too)."""
    text = repr(value)
    if len(text) <= LONG_VALUE_CHARS:
        return text
    return _clipped_text(text)


def shown_name(name: str) -> str:
    """A name as a message writes it: bare when it is one short word (``--method: lorra``), else as
    :func:`shown` writes it (quoted, and cut when long)."""
    return name if name and len(name) <= SHOWN_VALUE_CHARS and not any(c.isspace() for c in name) else shown(name)


def clip_long_values(message: str) -> str:
    """``message`` with each value longer than :data:`LONG_VALUE_CHARS` cut to its first
    :data:`SHOWN_VALUE_CHARS` characters and its length: ``'aaaa…' (10,000 characters)``."""
    return _LONG_VALUE.sub(_clipped, message)


def _clipped(match: re.Match) -> str:
    return _clipped_text(match.group())


def _clipped_text(text: str) -> str:
    quote = text[0] if text[0] in "'\"" and text[-1] == text[0] and len(text) > 1 else ""
    inner = text[1:-1] if quote else text
    return f"{quote}{inner[:SHOWN_VALUE_CHARS]}…{quote} ({len(inner):,} characters)"


def listed(heading: str, problems: list[str]) -> str:
    """``heading: problem`` for one problem; the heading and an indented list for several."""
    if len(problems) == 1:
        return f"{heading}: {problems[0]}"
    return f"{heading}:\n" + "\n".join(f"  - {p}" for p in problems)


class PathError(UserError):
    """A path the user gave cannot be used: the message names it and says what to do."""


#: ``OSError`` numbers that say something about a path (and so about the user's choice of path or
#: the state of their disk), never about memfit's code.
_PATH_ERRNOS = {
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "the file system is read-only",
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EISDIR: "it is a folder, not a file",
    errno.ENOTDIR: "a part of it is a file, not a folder",
    errno.EEXIST: "it already exists",
    errno.ENOENT: "it does not exist",
    errno.ENAMETOOLONG: "the name is too long",
    errno.ELOOP: "too many symbolic links",
}

_PATH_FIXES = {
    errno.EACCES: "choose a path you may write to, or change its permissions",
    errno.EPERM: "choose a path you may write to, or change its permissions",
    errno.EROFS: "choose a path on a writable disk",
    errno.ENOSPC: "free some space or choose another disk",
    errno.EDQUOT: "free some space or choose another disk",
    errno.EISDIR: "pass a file path",
    errno.ENOTDIR: "pass a path whose parents are folders",
    errno.EEXIST: "choose another path",
    errno.ENOENT: "check the path",
    errno.ENAMETOOLONG: "choose a shorter path",
    errno.ELOOP: "check the symbolic links on the path",
}


def path_error_message(err: OSError) -> str | None:
    """One line for an ``OSError`` about a path (``cannot use '/x': permission denied; <fix>``),
    or None when the error names no path or is not about one."""
    path = err.filename
    if path is None or err.errno not in _PATH_ERRNOS:
        return None
    other = f" (and {str(err.filename2)!r})" if err.filename2 is not None else ""
    return f"cannot use {str(path)!r}{other}: {_PATH_ERRNOS[err.errno]}; {_PATH_FIXES[err.errno]}."


def cli_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a Typer command: a :class:`UserError` (or an ``OSError`` about a path) ends the command
    with ``error: <message>`` on stderr and its exit code, with no traceback. Other exceptions pass."""

    @functools.wraps(func)
    def command(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except UserError as err:
            _exit(str(err), err.exit_code, err)
        except OSError as err:
            message = path_error_message(err)
            if message is None:
                raise  # not about a path the user chose: a bug, keep the traceback
            _exit(message, EXIT_BAD_INPUT, None)

    return command


def _exit(message: str, code: int, err: UserError | None) -> None:
    import typer
    from rich.markup import escape

    from memfit.console import make_console

    console = make_console(stderr=True)  # a plan explain() prints reads whole in a log, as on a terminal
    if err is not None:
        err.explain(console)
    console.print(f"[bold red]error:[/] {escape(clip_long_values(message))}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=code) from None
