"""CPU and memory of a process tree read from /proc (Linux only).

CPU is utime+stime of the plugin, plus cutime+cstime (children it already reaped), plus the
same for each live descendant; MPS daemons run in their own session and are not descendants,
so they are counted apart by PID.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm may hold spaces and parentheses: split after the last ')'
    return text[text.rindex(")") + 2 :].split()


def cpu_seconds(pid: int, reaped: bool = True) -> float:
    """utime+stime (+cutime+cstime when `reaped`) of one process, in seconds; 0 if gone."""
    f = _stat_fields(pid)
    if f is None:
        return 0.0
    # fields after comm start at state (3rd field): utime=14, stime=15, cutime=16, cstime=17
    ticks = int(f[11]) + int(f[12])
    if reaped:
        ticks += int(f[13]) + int(f[14])
    return ticks / TICKS


def children(pid: int) -> list[int]:
    """Every live descendant of `pid`, by walking parent PIDs in /proc."""
    parent_of: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            f = _stat_fields(int(entry.name))
            if f is not None:
                parent_of[int(entry.name)] = int(f[1])
    found: list[int] = []
    frontier = [pid]
    while frontier:
        current = frontier.pop()
        kids = [p for p, pp in parent_of.items() if pp == current]
        found.extend(kids)
        frontier.extend(kids)
    return found


def tree_cpu_seconds(pid: int) -> float:
    return cpu_seconds(pid) + sum(cpu_seconds(c) for c in children(pid))


def pids_cpu_seconds(pids: Iterable[int]) -> float:
    return sum(cpu_seconds(p) for p in pids)


def rss_bytes(pid: int) -> int:
    """Resident set size from /proc/<pid>/statm; 0 if the process is gone."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (FileNotFoundError, ProcessLookupError):
        return 0


def alive(pid: int) -> bool:
    return _stat_fields(pid) is not None
