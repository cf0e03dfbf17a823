"""The per-value checks of the config parser, and the list of problems they fill.

Each check takes a decoded YAML value and returns it typed, or raises ValueError with the
message; `Problems` collects those by field path and reports unknown keys. The checks know no
config dataclass, so `settings.py` assembles its sections from them and they stay small.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from deviceplugin.config.schema import (
    API_CHOICES,
    MODE_CHOICES,
    PINNED_LARGEST_SHARE,
    STRATEGY_CHOICES,
    Key,
)
from deviceplugin.model import MIB, Mode, ResourceName, ServingApi
from deviceplugin.quantity import QuantityError, parse_quantity

T = TypeVar("T")
Check = Callable[[object], T]  # returns the value or raises ValueError with the message


class Problems:
    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, path: str, message: str) -> None:
        self.items.append(f"{path}: {message}" if path else message)

    def mapping(self, value: object, path: str, keys: tuple[Key, ...]) -> dict[str, Any] | None:
        """`value` as a mapping with only known keys (unknown ones are reported, then dropped)."""
        if value is None:  # an empty section, or an empty file (then `version` is missing)
            return {}
        if not isinstance(value, Mapping):
            self.add(path, "must be a mapping" if path else "the config must be a YAML mapping")
            return None
        known = {k.name for k in keys}
        out: dict[str, Any] = {}
        for key, item in value.items():
            sub = f"{path}.{key}" if path else str(key)
            if not isinstance(key, str) or key not in known:
                self.add(sub, f"unknown key (known: {', '.join(sorted(known))})")
                continue
            out[key] = item
        return out

    def get(self, mapping: Mapping[str, Any], key: str, default: T, check: Check[T]) -> T:
        return self.check(mapping, key, default, check, prefix="")

    def check(
        self, mapping: Mapping[str, Any], key: str, default: T, check: Check[T], prefix: str
    ) -> T:
        if key not in mapping:
            return default
        try:
            return check(mapping[key])
        except ValueError as e:
            self.add(f"{prefix}{key}", str(e))
            return default


def slice_size(value: object) -> int:
    size = quantity(value)
    if size <= 0:
        raise ValueError("must be greater than zero")
    if size % MIB:
        raise ValueError("must be a whole number of MiB (caps are passed in MiB)")
    return size


def reserved(value: object) -> int:
    return quantity(value)


def quantity(value: object) -> int:
    try:
        return parse_quantity(value)
    except QuantityError as e:
        raise ValueError(str(e)) from None


def pinned_default(value: object) -> int | None:
    """`mps.defaultPinnedMemoryLimit`: None for `largest-share`, else bytes (whole MiB)."""
    if value == PINNED_LARGEST_SHARE:
        return None
    try:
        size = quantity(value)
    except ValueError as e:
        raise ValueError(f"must be {PINNED_LARGEST_SHARE} or a quantity: {e}") from None
    if size < MIB:
        raise ValueError("must be at least 1Mi (the daemon takes the limit in MiB)")
    return size


def mode(value: object) -> Mode:
    if not isinstance(value, str) or value not in MODE_CHOICES:
        raise ValueError(f"must be one of {', '.join(MODE_CHOICES)}")
    return Mode(value)


def api(value: object) -> ServingApi:
    if not isinstance(value, str) or value not in API_CHOICES:
        raise ValueError(f"must be one of {', '.join(API_CHOICES)}")
    return ServingApi(value)


def choice(choices: tuple[str, ...]) -> Check[str]:
    def check(value: object) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value

    return check


def strategies(value: object) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise ValueError(f"must be a non-empty list of {', '.join(STRATEGY_CHOICES)}")
    bad = [repr(i) for i in items if not isinstance(i, str) or i not in STRATEGY_CHOICES]
    if bad:
        raise ValueError(f"{', '.join(bad)} not one of {', '.join(STRATEGY_CHOICES)}")
    if len(set(items)) != len(items):
        raise ValueError("lists a strategy twice")
    return tuple(str(i) for i in items)


def integer(lo: int, hi: int) -> Check[int]:
    def check(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"must be an integer from {lo} to {hi}")
        if not lo <= value <= hi:
            raise ValueError(f"must be from {lo} to {hi}, not {value}")
        return value

    return check


def boolean(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


def string(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError("must be a non-empty string")
    return value


def abs_path(value: object) -> str:
    text = string(value)
    if not text.startswith("/"):
        raise ValueError("must be an absolute path")
    return text


def abs_paths(value: object) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise ValueError("must be a non-empty list of absolute paths")
    return tuple(abs_path(i) for i in items)


_CDI_KIND = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]*[A-Za-z0-9]/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def cdi_kind(value: object) -> str:
    text = string(value)
    if not _CDI_KIND.fullmatch(text):
        raise ValueError("must be a CDI kind such as nvidia.com/gpu")
    return text


_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def resource_name(value: object) -> ResourceName:
    text = string(value)
    domain, sep, name = text.partition("/")
    ok = (
        sep == "/"
        and len(domain) <= 253
        and bool(_DNS_SUBDOMAIN.fullmatch(domain))
        and 0 < len(name) <= 63
        and bool(_QUALIFIED_NAME.fullmatch(name))
    )
    if not ok:
        raise ValueError(f"{text!r} is not an extended resource name like vendor.com/name")
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        raise ValueError("the kubernetes.io domain is reserved")
    return ResourceName(text)


def duration(value: object) -> float:
    if isinstance(value, bool):
        raise ValueError("must be a duration such as 30s")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _parse_duration(value)
    else:
        raise ValueError("must be a duration such as 30s")
    if seconds < 0:
        raise ValueError("must not be negative")
    return seconds


_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def _parse_duration(text: str) -> float:
    text = text.strip()
    pos, total = 0, 0.0
    while pos < len(text):
        m = _DURATION_PART.match(text, pos)
        if m is None:
            raise ValueError(f"{text!r} is not a duration (examples: 500ms, 30s, 2m, 1h30m)")
        total += float(m[1]) * _UNITS[m[2]]
        pos = m.end()
    if pos == 0:
        raise ValueError("must be a duration such as 30s")
    return total


def xid_list(value: object) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError("must be a list of integers")
    bad = [repr(v) for v in value if isinstance(v, bool) or not isinstance(v, int) or v < 0]
    if bad:
        raise ValueError(f"{', '.join(bad)} not a non-negative integer")
    return tuple(int(v) for v in value)


def active_threads(value: object) -> int | None:
    if value == "proportional":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100:
        raise ValueError("must be an integer from 1 to 100, or proportional")
    return value


def positive_quantity(value: object) -> int:
    size = quantity(value)
    if size <= 0:
        raise ValueError("must be greater than zero")
    return size


def positive_duration(value: object) -> float:
    seconds = duration(value)
    if seconds <= 0:
        raise ValueError("must be greater than zero")
    return seconds
