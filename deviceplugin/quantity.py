"""Memory quantities written the Kubernetes way: `1Gi`, `256Mi`, `500M`, `1e9`, `1073741824`.

Config sizes and pod ceiling annotations use this one parser, so both accept the same
spellings; results are whole, non-negative byte counts (a fraction of a byte is refused).
Text longer than MAX_LENGTH is refused before it is parsed: pod annotations and claim
results are written by others, and Python refuses to turn more than 4,300 digits into an int
with a ValueError that is not ours.
"""

from __future__ import annotations

import functools
import re
from fractions import Fraction

BINARY_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
DECIMAL_SUFFIXES = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}

# Kubernetes writes no quantity this long (the largest, 2^63-1 bytes, has 19 digits); the
# limit leaves room for spellings such as `0.000…1Ei` without letting a megabyte in.
MAX_LENGTH = 64

_QUANTITY = re.compile(
    r"^(?P<sign>[+-]?)(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?:(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)|[eE](?P<exp>[+-]?[0-9]+))?$"
)


class QuantityError(ValueError):
    """A value that is not a non-negative whole number of bytes."""


def parse_quantity(value: object) -> int:
    """Bytes in `value` (a quantity string or a plain integer); raises QuantityError."""
    if isinstance(value, bool):
        raise QuantityError("must be a quantity such as 1Gi or 512Mi, not a boolean")
    if isinstance(value, int):
        if value < 0:
            raise QuantityError("must not be negative")
        return value
    if not isinstance(value, str):
        raise QuantityError(f"must be a quantity such as 1Gi or 512Mi, not {type(value).__name__}")
    if len(value) > MAX_LENGTH:
        raise QuantityError(f"is {len(value)} characters long, over the {MAX_LENGTH} allowed")
    return _parse_text(value)


@functools.lru_cache(maxsize=256)  # each claim's consumed capacity: a few spellings, over and over
def _parse_text(value: str) -> int:
    match = _QUANTITY.match(value.strip())
    if match is None:
        raise QuantityError(f"{value!r} is not a quantity (examples: 1Gi, 512Mi, 500M, 1e9)")
    if match["sign"] == "-":
        raise QuantityError("must not be negative")
    # Fraction keeps "1.5Gi" exact; floats would round.
    amount = Fraction(match["number"])
    if match["suffix"]:
        amount *= BINARY_SUFFIXES.get(match["suffix"]) or DECIMAL_SUFFIXES[match["suffix"]]
    elif match["exp"]:
        exponent = int(match["exp"])
        if exponent > 30:
            raise QuantityError("exponent too large")
        amount *= Fraction(10) ** exponent
    if amount.denominator != 1:
        raise QuantityError(f"{value!r} is not a whole number of bytes")
    return int(amount)


def format_quantity(size: int) -> str:
    """The shortest exact binary spelling: 1073741824 → `1Gi`, 268435456 → `256Mi`."""
    if size < 0:
        raise QuantityError("must not be negative")
    for suffix, factor in sorted(BINARY_SUFFIXES.items(), key=lambda kv: -kv[1]):
        if size >= factor and size % factor == 0:
            return f"{size // factor}{suffix}"
    return str(size)
