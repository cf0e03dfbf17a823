"""Command line: the sole exit point (0 clean, 1 runtime failure, 2 bad config or usage)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    raise SystemExit(2)
