"""What every file dropped on the page is checked against: its size and the name it is kept under,
and the error that says what is wrong with it. A module of its own so that the readers of dropped
files (:mod:`memfit.ui.uploads`, :mod:`memfit.ui.tool_configs`, :mod:`memfit.ui.runs`) and the
page's parameters (:mod:`memfit.ui.params`) share them without importing each other.
"""

from __future__ import annotations

from pathlib import PurePath

from memfit.errors import UserError, shown

#: The largest file the page takes (a config.json is a few KiB; a run's memory.jsonl a few hundred).
MAX_UPLOAD_BYTES = 1 << 20
#: The longest file name a dropped file may have (NAME_MAX on Linux and macOS).
MAX_FILE_NAME_CHARS = 255
#: What the name a dropped config is kept under starts with (twelve hex digits of its content follow).
UPLOAD_PREFIX = "upload-"


class UploadError(UserError, ValueError):
    """A dropped file the page cannot use; the message names the file and the fix."""


def is_upload_name(model: str) -> bool:
    """Whether ``model`` names a dropped config (``upload-`` and twelve hex digits)."""
    digits = model[len(UPLOAD_PREFIX) :]
    return model.startswith(UPLOAD_PREFIX) and len(digits) == 12 and all(c in "0123456789abcdef" for c in digits)


def file_name(name: str) -> str:
    """The file name of a dropped file as the page sent it (its last part: a name, never a path),
    refused when no file can be named so (too long, a NUL character)."""
    base = PurePath(name).name
    if len(base) > MAX_FILE_NAME_CHARS or "\x00" in base:
        raise UploadError(
            f"file name {shown(base)} is not a file's name (at most {MAX_FILE_NAME_CHARS} characters, no NUL); "
            "drop the file as it is named on your disk."
        )
    return base


def check_size(data: bytes, filename: str) -> None:
    """Refuse a file over :data:`MAX_UPLOAD_BYTES` (the body is read no further than that)."""
    if len(data) > MAX_UPLOAD_BYTES:
        raise UploadError(
            f"{filename}: more than {MAX_UPLOAD_BYTES // 2**20} MiB; the page takes files up to that size."
        )


def decode_text(data: bytes, filename: str, what: str) -> str:
    """``data`` as UTF-8 text, or an :class:`UploadError` naming the byte and what to drop (``what``)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UploadError(f"{filename}: not UTF-8 text (byte {err.start}); drop {what}.") from None
