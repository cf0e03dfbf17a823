"""Resource counters of a process read from /proc, for the soak and fault suites.

A leak shows as a count that grows with the number of iterations; each soak takes a
`Sample` after warm-up and one at the end, and `check` bounds the difference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    fds: int
    threads: int
    rss_kib: int


def sample(pid: int) -> Sample:
    """Open fds, threads and resident memory of `pid` now."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    threads = rss = 0
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key == "Threads":
                threads = int(value)
            elif key == "VmRSS":
                rss = int(value.split()[0])
    return Sample(fds, threads, rss)


def report(name: str, count: int, before: Sample, after: Sample, seconds: float) -> str:
    return (
        f"soak {name}: count={count} fds={before.fds}->{after.fds} "
        f"threads={before.threads}->{after.threads} "
        f"rss_mib={before.rss_kib / 1024:.1f}->{after.rss_kib / 1024:.1f} seconds={seconds:.0f}"
    )


def check(
    before: Sample, after: Sample, fd_slack: int = 4, thread_slack: int = 2, rss_mib: int = 40
) -> None:
    """No leaked fds or threads (a little slack for pools that grow on demand), RSS bounded."""
    assert after.fds <= before.fds + fd_slack, (before, after)
    assert after.threads <= before.threads + thread_slack, (before, after)
    assert after.rss_kib - before.rss_kib <= rss_mib * 1024, (before, after)
