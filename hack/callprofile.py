"""Where a plugin call's time goes, stage by stage, hot and cold: `python hack/callprofile.py`.

`hack/bench.py` says how far each call is from its echo; this says what inside the call
costs. It runs the plugin's own Allocate path (validation to the answer's bytes) and
GetPreferredAllocation's (the request's parse to the answer's bytes) in this process, on the
bench's node (`h200x8`, 256Mi slices; the ledger on `--root`, CDI specs on /dev/shm), and
times each stage by wrapping the function that does it (about 0.3 us a stage, hot).

"cold": before each call, a write over a buffer larger than the CPU's caches and a 1 ms
sleep, as a call meets the plugin after another process ran (the bench's spacer call, the
kubelet's own work between two admissions); "hot": calls back to back.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HACK = Path(__file__).resolve().parent
ROOT = HACK.parent
for path in (HACK, ROOT):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from benchlib.stats import percentile  # noqa: E402

from deviceplugin import grant_shape  # noqa: E402
from deviceplugin._pb import deviceplugin_v1beta1_pb2 as pb  # noqa: E402
from deviceplugin.cdi import specs as cdi_specs  # noqa: E402
from deviceplugin.config.settings import parse  # noqa: E402
from deviceplugin.dpapi import allocator as allocator_module  # noqa: E402
from deviceplugin.dpapi.allocator import Allocator  # noqa: E402
from deviceplugin.dpapi.answers import AnswerCache, allocate_response  # noqa: E402
from deviceplugin.dpapi.preferred import preferred  # noqa: E402
from deviceplugin.health.board import HealthBoard  # noqa: E402
from deviceplugin.ledger.record import AllocationRecord  # noqa: E402
from deviceplugin.ledger.store import Ledger  # noqa: E402
from deviceplugin.plan import SlicePlan, build_plan  # noqa: E402
from deviceplugin.plumbing import fsutil, logs  # noqa: E402
from deviceplugin.simulate.specs import load_spec  # noqa: E402

CONFIG = {"version": "v1", "sliceSize": "256Mi", "health": {"quietPeriod": "0s"}}
RESOURCE = "nvidia.com/gpu-fraction"
Times = dict[str, list[int]]  # stage -> nanoseconds per call


@contextlib.contextmanager
def timed(owner: Any, name: str, stage: str, times: Times) -> Iterator[None]:
    """`owner.name` wrapped to add each call's duration to `times[stage]`, then restored.
    Only this thread's calls count: the ledger's own thread folds its journal with the same
    functions, off the call path."""
    real = getattr(owner, name)
    caller = threading.get_ident()

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter_ns()
        try:
            return real(*args, **kwargs)
        finally:
            if threading.get_ident() == caller:
                times.setdefault(stage, []).append(time.perf_counter_ns() - started)

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, real)


class Chill:
    """Before a cold call: evict the caches (a write per cache line over `mib`) and sleep."""

    def __init__(self, cold: bool, mib: int) -> None:
        self._buffer = bytearray(mib << 20) if cold else bytearray()
        self._round = 0

    def __call__(self) -> None:
        if not self._buffer:
            return
        self._round = (self._round + 1) & 0xFF
        self._buffer[::64] = bytes([self._round]) * len(range(0, len(self._buffer), 64))
        time.sleep(0.001)


def allocate_new(plan: SlicePlan, root: Path, cdi: Path, calls: int, chill: Chill) -> Times:
    """`calls` Allocates of a new 2-slice set each, as the kubelet's Allocate reaches it."""
    config = parse(CONFIG)
    ledger = Ledger(root / "state", startup_grace=0.0)
    alloc = Allocator(lambda: plan, lambda: config, cdi, root / "mps", ledger, HealthBoard())
    answers = AnswerCache()
    pairs = [
        list(gp.device_ids[i : i + 2])
        for gp in plan.for_resource(RESOURCE)
        for i in range(0, len(gp.device_ids) - 1, 2)
    ]
    if len(pairs) < calls:
        raise SystemExit(f"{RESOURCE} has {len(pairs)} slice pairs, fewer than {calls}")
    times: Times = {}
    # In the order shown; an indented stage is part of the unindented one above it.
    stages = [
        (Allocator, "_validate", "validate the IDs"),
        (cdi_specs, "device_name", "CDI device name"),
        (Allocator, "_shape", "shape (cached)"),
        (Allocator, "_grant", "grant (spec and record)"),
        (grant_shape.Shape, "spec_text", "  spec text"),
        (cdi_specs, "write_spec", "  write the CDI spec"),
        (fsutil, "ensure_dir", "    check the CDI dir"),
        (fsutil, "atomic_write", "    create + rename (tmpfs)"),
        (allocator_module, "AllocationRecord", "  the record"),
        (Ledger, "add", "ledger add"),
        (AllocationRecord, "journal_line", "  journal line"),
        (Ledger, "_append", "  append (ext4, no fsync)"),
        (logs, "log_soon", "log line (deferred)"),
    ]
    with contextlib.ExitStack() as stack:
        for owner, name, stage in stages:
            stack.enter_context(timed(owner, name, stage, times))
        for ids in pairs[:calls]:
            chill()
            started = time.perf_counter_ns()
            grant = alloc.allocate(RESOURCE, ids)
            answered = time.perf_counter_ns()
            allocate_response([answers.container(grant)])
            done = time.perf_counter_ns()
            times.setdefault("answer bytes", []).append(done - answered)
            times.setdefault("TOTAL", []).append(done - started)
    ledger.wait_durable()  # before the caller removes its directory
    order = [stage for _, _, stage in stages] + ["answer bytes", "TOTAL"]
    return {stage: times[stage] for stage in order if stage in times}


def preferred_call(plan: SlicePlan, calls: int, chill: Chill, shuffled: bool) -> Times:
    """GetPreferredAllocation of 2 slices out of every slice, as the bench asks it (the
    ListAndWatch order) or in a shuffled order (the kubelet's, from a Go map)."""
    ids = [d for gp in plan.for_resource(RESOURCE) for d in gp.device_ids]
    if shuffled:
        random.Random(1).shuffle(ids)
    request = pb.ContainerPreferredAllocationRequest(available_deviceIDs=ids, allocation_size=2)
    data = pb.PreferredAllocationRequest(container_requests=[request]).SerializeToString()
    times: Times = {}

    def add(stage: str, started: int) -> int:
        now = time.perf_counter_ns()
        times.setdefault(stage, []).append(now - started)
        return now

    for _ in range(calls):
        chill()
        t0 = time.perf_counter_ns()
        req = pb.PreferredAllocationRequest.FromString(data)
        t = add("parse (upb)", t0)
        (one,) = req.container_requests
        chosen = preferred(
            plan, RESOURCE, one.available_deviceIDs, list(one.must_include_deviceIDs), 2
        )
        t = add("choose (preferred())", t)
        answer = pb.ContainerPreferredAllocationResponse(deviceIDs=chosen)
        pb.PreferredAllocationResponse(container_responses=[answer]).SerializeToString()
        add("answer bytes", t)
        add("TOTAL", t0)
        # What `preferred()` cannot do without, apart, on a fresh parse: the IDs as Python
        # strings, and one set of them.
        chill()
        fresh = pb.PreferredAllocationRequest.FromString(data).container_requests[0]
        t = time.perf_counter_ns()
        strings = list(fresh.available_deviceIDs)
        t = add("floor: the IDs as strings", t)
        set(strings)
        add("floor: one set of them", t)
    return times


def summarize(times: Times, skip: int) -> dict[str, dict[str, float]]:
    out = {}
    for stage, ns in times.items():
        us = [n / 1000 for n in ns[skip:]] or [n / 1000 for n in ns]
        out[stage] = {
            "p50_us": round(percentile(us, 50), 1),
            "p99_us": round(percentile(us, 99), 1),
            "calls": len(us),
        }
    return out


def table(results: dict[str, Any]) -> str:
    lines = []
    for title, by_mode in results["profiles"].items():
        lines.append(f"\n{title}\n{'stage':36} {'hot p50':>9} {'cold p50':>9} {'cold p99':>9} us")
        hot, cold = by_mode["hot"], by_mode["cold"]
        for stage in cold:
            h = hot.get(stage, {}).get("p50_us", float("nan"))
            c = cold[stage]
            lines.append(f"{stage:36} {h:9.1f} {c['p50_us']:9.1f} {c['p99_us']:9.1f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = build_plan(load_spec(args.preset).inventory(), parse(CONFIG))
    profiles: dict[str, dict[str, Any]] = {}
    for mode in ("hot", "cold"):
        chill = Chill(mode == "cold", args.evict_mib)
        root = Path(tempfile.mkdtemp(prefix="gfp-", dir=args.root))
        cdi = Path(tempfile.mkdtemp(prefix="gfp-cdi-", dir=args.cdi_root))
        try:
            new = allocate_new(plan, root, cdi, args.calls, chill)
        finally:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(cdi, ignore_errors=True)
        skip = min(args.warmup, args.calls - 1)
        profiles.setdefault("Allocate, a new 2-slice set", {})[mode] = summarize(new, skip)
        for shuffled, title in (
            (False, "GetPreferredAllocation, 2 of all slices (the bench's order)"),
            (True, "GetPreferredAllocation, 2 of all slices (shuffled: the kubelet's order)"),
        ):
            times = preferred_call(plan, args.calls, chill, shuffled)
            profiles.setdefault(title, {})[mode] = summarize(times, skip)
    return {
        "command": " ".join(["python hack/callprofile.py", *args.measured_argv]),
        "preset": args.preset,
        "devices": sum(len(gp.device_ids) for gp in plan.for_resource(RESOURCE)),
        "profiles": profiles,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--preset", default="h200x8")
    parser.add_argument("--calls", type=int, default=300, help="calls of each kind and mode")
    parser.add_argument("--warmup", type=int, default=20, help="first calls left out")
    parser.add_argument("--evict-mib", type=int, default=64, help="cold: bytes written, MiB")
    parser.add_argument("--root", type=Path, default=Path("/var/tmp"))
    parser.add_argument("--cdi-root", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error("--calls must be at least 1")
    given = list(sys.argv[1:] if argv is None else argv)
    args.measured_argv = [
        a for i, a in enumerate(given)
        if not a.startswith("--json-out") and (i == 0 or given[i - 1] != "--json-out")
    ]  # fmt: skip
    results = run(args)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
