"""Byte sizes: the unit constants, reading a size a person wrote, and printing one.

At the bottom of the package: any layer may use it, it imports nothing of memfit.
"""

from __future__ import annotations

import re

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)\s*$", re.IGNORECASE)
_SIZE_EXAMPLES = "e.g. '24GiB', '80 GB', '512MiB', '1.5 TiB' or '1048576'"


def parse_bytes(value: str | int) -> int:
    """Bytes in a human size: ``"24GiB"``, ``"80 GB"``, ``"512"``, ``1024``.

    KB/MB/GB/TB are decimal (1000^n), KiB/MiB/GiB/TiB binary (1024^n); units
    are case-insensitive; a bare number is bytes. The result must be a whole,
    non-negative number of bytes.
    """
    if isinstance(value, bool):
        raise ValueError(f"size {value!r} is not a byte count; use {_SIZE_EXAMPLES}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size {value!r} is negative; use {_SIZE_EXAMPLES}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"size {value!r} is not a string or an integer; use {_SIZE_EXAMPLES}")
    match = _SIZE_RE.match(value)
    if match is None:
        raise ValueError(f"cannot read size {value!r}; use {_SIZE_EXAMPLES}")
    number, unit = match.groups()
    multiplier = _UNITS.get(unit.lower())
    if multiplier is None:
        raise ValueError(
            f"unknown unit {unit!r} in size {value!r}; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB ({_SIZE_EXAMPLES})"
        )
    whole, _, frac = number.partition(".")
    # exact arithmetic: 1.1 GB must be 1,100,000,000 B, not a float artefact
    numerator = int(whole or "0") * 10 ** len(frac) + int(frac or "0")
    total, remainder = divmod(numerator * multiplier, 10 ** len(frac))
    if remainder:
        raise ValueError(f"size {value!r} is not a whole number of bytes; use {_SIZE_EXAMPLES}")
    return total


_FORMAT_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(nbytes: int) -> str:
    """Short binary-unit form: ``512 B``, ``1.2 MiB``, ``23.5 GiB``."""
    sign = "-" if nbytes < 0 else ""
    n = abs(nbytes)
    if n < 1024:
        return f"{sign}{n} B"
    value = float(n)
    for i, unit in enumerate(_FORMAT_UNITS):
        value /= 1024
        # move up a unit when rounding would print 1024.0
        if round(value, 1) < 1024 or i == len(_FORMAT_UNITS) - 1:
            return f"{sign}{value:.1f} {unit}"
    raise AssertionError("unreachable")
