"""Byte sizes: reading what a person writes, printing what the planner found."""

from __future__ import annotations

import pytest

from memfit.units import format_bytes, parse_bytes

MiB = 1 << 20
GiB = 1 << 30


@pytest.mark.parametrize(
    "text, expected",
    [
        ("24GiB", 24 * (1 << 30)),
        ("24 gib", 24 * (1 << 30)),
        ("80GB", 80 * 10**9),
        ("1.5 TiB", 3 * (1 << 39)),
        ("1.1GB", 1_100_000_000),
        ("512", 512),
        ("512B", 512),
        ("  7 kb ", 7000),
        ("2MiB", 2 * MiB),
        ("0.5KiB", 512),
        (".5 MiB", MiB // 2),
        (4096, 4096),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "cannot read"),
        ("GiB", "cannot read"),
        ("-5GiB", "cannot read"),
        ("12 gigs", "unknown unit"),
        ("1.5", "whole number"),
        ("0.3KiB", "whole number"),
        (-3, "negative"),
        (True, "not a byte count"),
        (2.5, "not a string"),
    ],
)
def test_parse_bytes_errors(text, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_bytes(text)
    assert "24GiB" in str(info.value)  # shows valid examples


@pytest.mark.parametrize(
    "nbytes, expected",
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1258291, "1.2 MiB"),
        (int(23.5 * (1 << 30)), "23.5 GiB"),
        ((1 << 20) - 1, "1.0 MiB"),  # would round to 1024.0 KiB
        (-2 * MiB, "-2.0 MiB"),
        (3 << 40, "3.0 TiB"),
    ],
)
def test_format_bytes(nbytes, expected):
    assert format_bytes(nbytes) == expected


def test_format_parse_round_trip_for_round_sizes():
    for n in (512, 2 * MiB, 24 << 30):
        text = format_bytes(n).replace(" ", "")
        assert parse_bytes(text) == n
