"""Kubernetes-style memory quantities: accepted spellings, refusals, and formatting."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deviceplugin.quantity import QuantityError, format_quantity, parse_quantity


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1Gi", 2**30),
        ("256Mi", 256 * 2**20),
        ("1.5Gi", 3 * 2**29),
        ("4Ki", 4096),
        ("2Ti", 2 * 2**40),
        ("1Pi", 2**50),
        ("500M", 500_000_000),
        ("1k", 1000),
        ("3G", 3_000_000_000),
        ("1T", 10**12),
        ("1073741824", 2**30),
        ("1e9", 10**9),
        ("12E3", 12_000),
        (" 8Gi ", 8 * 2**30),
        ("+1Mi", 2**20),
        ("0", 0),
        (123, 123),
    ],
)
def test_parses(text: object, expected: int) -> None:
    assert parse_quantity(text) == expected


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("-1Gi", "negative"),
        (-5, "negative"),
        ("0.5", "whole number"),
        ("1.0001k", "whole number"),
        ("1gi", "not a quantity"),
        ("Gi", "not a quantity"),
        ("1 Gi", "not a quantity"),
        ("", "not a quantity"),
        (True, "boolean"),
        (1.5, "float"),
        ([1], "list"),
        ("1e-3", "whole number"),
        ("9" * 5000, "5000 characters long, over the 64 allowed"),
        ("1" * 65, "over the 64 allowed"),
    ],
    ids=lambda v: v[:12] + "..." if isinstance(v, str) and len(v) > 12 else None,
)
def test_refuses(value: object, fragment: str) -> None:
    with pytest.raises(QuantityError, match=fragment):
        parse_quantity(value)


@pytest.mark.parametrize(
    ("size", "text"),
    [(2**30, "1Gi"), (256 * 2**20, "256Mi"), (1536 * 2**20, "1536Mi"), (1000, "1000"), (0, "0")],
)
def test_formats(size: int, text: str) -> None:
    assert format_quantity(size) == text


@given(st.integers(min_value=0, max_value=2**62))
def test_format_round_trips(size: int) -> None:
    assert parse_quantity(format_quantity(size)) == size
