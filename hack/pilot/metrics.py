"""Figures the report shows, computed from raw simulation results.

Latency percentiles are nearest-rank over completed requests, split by whether the request
arrived inside the stress window; utilisation is time-averaged over the provisioned GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pilot.sim import ScenarioResult, ServiceResult


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class ServiceFigures:
    name: str
    request_mib: int
    limit_mib: int
    offered: int  # requests that arrived
    served: int
    errors: int
    error_kinds: dict[str, int]
    alloc_failures: int  # requests that met a failed allocation at least once
    contention: int  # of those: the GPU was full (the other tenant held the memory)
    ceiling: int  # of those: the service's own limit was reached
    guarantee_violations: int  # contention while still under its own reservation
    p50_steady: float
    p99_steady: float
    p50_stress: float
    p99_stress: float
    p99_all: float
    peak_mib: int
    mean_mib: float
    recovery_s: float | None


@dataclass(frozen=True)
class ScenarioFigures:
    name: str
    title: str
    gpus: int
    services: tuple[ServiceFigures, ...]
    memory_utilisation: float  # mean held / total memory of the provisioned GPUs
    busy: float  # mean fraction of time each provisioned GPU runs a kernel (nvidia-smi style)
    compute_utilisation: float  # decode throughput / what the provisioned GPUs could do
    tokens_per_s: float
    replan_at: float | None


def service_figures(res: ServiceResult, in_stress: tuple[float, float]) -> ServiceFigures:
    lo, hi = in_stress
    steady = [lat for arr, lat in res.latencies if not lo <= arr < hi]
    stress = [lat for arr, lat in res.latencies if lo <= arr < hi]
    every = [lat for _, lat in res.latencies]
    held = [mib for _, mib in res.memory]
    recovery = None
    if res.down_at is not None and res.recovered_at is not None:
        recovery = res.recovered_at - res.down_at
    errors = sum(res.errors.values())
    return ServiceFigures(
        name=res.name,
        request_mib=res.request_mib,
        limit_mib=res.limit_mib,
        offered=res.served + errors,
        served=res.served,
        errors=errors,
        error_kinds=dict(sorted(res.errors.items())),
        alloc_failures=res.alloc_failures,
        contention=res.shortages.get("contention", 0),
        ceiling=res.shortages.get("ceiling", 0),
        guarantee_violations=res.guarantee_violations,
        p50_steady=percentile(steady, 50),
        p99_steady=percentile(steady, 99),
        p50_stress=percentile(stress, 50),
        p99_stress=percentile(stress, 99),
        p99_all=percentile(every, 99),
        peak_mib=max(held, default=0),
        mean_mib=sum(held) / len(held) if held else 0.0,
        recovery_s=recovery,
    )


def union_length(intervals: Sequence[tuple[float, float]], horizon: float) -> float:
    """Total time covered by at least one interval, clipped to [0, horizon]."""
    total, end = 0.0, -math.inf
    for start, stop in sorted(intervals):
        start, stop = max(start, end, 0.0), min(stop, horizon)
        if stop > start:
            total += stop - start
        end = max(end, stop)
    return total


def scenario_figures(res: ScenarioResult) -> ScenarioFigures:
    sc = res.scenario
    tl = sc.timeline
    gpus = len(sc.gpu_usable_mib)
    busy = 0.0
    for gpu in range(gpus):
        intervals = [
            iv
            for t, s in zip(sc.tenants, res.services, strict=True)
            if t.gpu == gpu
            for iv in s.busy
        ]
        busy += union_length(intervals, tl.horizon_s)
    tokens = sum(s.tokens for s in res.services) / tl.horizon_s
    samples = len(res.services[0].memory) if res.services else 0
    held_total = sum(m for s in res.services for _, m in s.memory)
    mem_util = held_total / (samples * gpus * sc.gpu_total_mib) if samples else 0.0
    return ScenarioFigures(
        name=sc.name,
        title=sc.title,
        gpus=gpus,
        services=tuple(
            service_figures(s, (tl.stress_start_s, tl.stress_end_s)) for s in res.services
        ),
        memory_utilisation=mem_util,
        busy=busy / (gpus * tl.horizon_s),
        compute_utilisation=tokens / (gpus * sc.tenants[0].spec.model.peak_tokens_per_s),
        tokens_per_s=tokens,
        replan_at=res.replan_at,
    )


def within_budget(fig: ScenarioFigures, budgets: Sequence[float], stress: bool) -> bool:
    """Every service's p99 (stress window or steady phases) within its budget, no errors."""
    for s, budget in zip(fig.services, budgets, strict=True):
        p99 = s.p99_stress if stress else s.p99_steady
        if math.isnan(p99) or p99 > budget or s.errors:
            return False
    return True
