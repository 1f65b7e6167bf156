"""parse_size: the budget strings people write, and the ones it must refuse."""

from __future__ import annotations

import math

import pytest

from tightfit import parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ("40MB", 40_000_000),
        ("40 MB", 40_000_000),
        ("1.5GiB", 3 * 2**29),
        ("512KiB", 512 * 1024),
        ("2kb", 2000),
        ("100B", 100),
        ("100", 100),
        ("0.5MiB", 2**19),
        (".5KiB", 512),
        ("1TB", 10**12),
        ("3GB", 3 * 10**9),
        (123456, 123456),
    ],
)
def test_accepted(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["", "MB", "40XB", "40 M B", "-5MB", "1e3MB", "nan", "NaNMB", "inf", "1.2.3GB", "0x10"]
)
def test_bad_strings_name_the_value(text):
    with pytest.raises(ValueError, match="budget=.*accepted"):
        parse_size(text, "budget")


@pytest.mark.parametrize("value", [0, -1, "0", "0MB", "0.0GiB"])
def test_zero_and_negative_rejected(value):
    with pytest.raises(ValueError, match="more than 0 bytes"):
        parse_size(value)


def test_less_than_a_byte_rejected():
    with pytest.raises(ValueError, match="less than one byte"):
        parse_size("0.1B")


@pytest.mark.parametrize("value", [True, False, 1.5, math.nan, None, [40]])
def test_other_types_rejected(value):
    with pytest.raises(TypeError, match="must be an int or a str"):
        parse_size(value)
