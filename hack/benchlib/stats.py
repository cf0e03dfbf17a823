"""Latency summaries: percentiles by linear interpolation, in milliseconds.

Kept tiny and dependency-free so the report's numbers are easy to audit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of `values`, interpolating between ranks."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary_ms(seconds: Sequence[float]) -> dict[str, Any]:
    """count, p50, p99, mean and max of durations given in seconds, as milliseconds."""
    ms = [s * 1000.0 for s in seconds]
    return {
        "count": len(ms),
        "p50_ms": round(percentile(ms, 50), 4),
        "p99_ms": round(percentile(ms, 99), 4),
        "mean_ms": round(sum(ms) / len(ms), 4),
        "max_ms": round(max(ms), 4),
    }


def spread(values: Sequence[float]) -> dict[str, Any]:
    """The median of repeated runs' figures (what a verdict uses), their range and each run."""
    if not values:
        raise ValueError("spread of no values")
    return {
        "median": round(percentile(values, 50), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "runs": [round(v, 3) for v in values],
    }
