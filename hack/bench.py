"""Benchmarks of DESIGN section 7 against the real plugin process: `make bench`.

Starts `python -m deviceplugin run --simulate h200x8` (256Mi slices) with the kubelet
simulator, measures call latency against a bare grpcio echo, fault-to-ListAndWatch latency,
kubelet restarts and list size; the same node on DRA (NodePrepareResources for 1 and 8
claims against an echo, Xid to taint in the stand-in API server); then idles an `h200x2`
plugin. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HACK = Path(__file__).resolve().parent
if str(HACK) not in sys.path:
    sys.path.insert(0, str(HACK))  # so `benchlib.*` imports work when run as a script

from benchlib import dra, measure, mps, report, stats  # noqa: E402
from benchlib.plugin import Plugin, fs_type  # noqa: E402

BIG_CONFIG = "version: v1\nsliceSize: 256Mi\nhealth: {quietPeriod: 0s}\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        "command": " ".join(["python hack/bench.py", *args.measured_argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": report.machine(),
        "config": {"preset": args.preset, "file": BIG_CONFIG, "idle_preset": "h200x2"},
    }
    started = time.monotonic()
    # State and sockets on disk (short paths: unix sockets), CDI specs on a tmpfs: a node's
    # /var/lib and /var/run.
    root = Path(tempfile.mkdtemp(prefix="gfb-", dir=args.root))
    shm = Path("/dev/shm")
    on_tmpfs = fs_type(shm) == "tmpfs"
    cdi_root = Path(tempfile.mkdtemp(prefix="gfb-cdi-", dir=shm)) if on_tmpfs else root
    results["config"].update(state_fs=fs_type(root), cdi_fs=fs_type(cdi_root))
    try:
        plugin = Plugin(root / "big", args.preset, BIG_CONFIG, cdi_root / "big")
        try:
            plugin.start()
            results["startup"] = measure.startup(plugin, 1)
            resource = sorted(results["startup"]["devices"])[0]
            # Each ratio `--repeats` times (each run interleaved with its echo), and the Xid
            # figure as often: a verdict is the median's, a single run moves by +-0.4.
            calls = [
                measure.calls(plugin, resource, args.calls, args.new_allocations, root, run)
                for run in range(args.repeats)
            ]
            results["calls"] = calls[0]
            results["calls_runs"] = measure.call_spreads(calls)
            faults = [
                measure.faults(plugin, resource, args.fault_cycles) for _ in range(args.repeats)
            ]
            results["fault"] = faults[0]
            results["fault_runs"] = stats.spread([f["to_unhealthy"]["p99_ms"] for f in faults])
            results["fault_inject_runs"] = stats.spread(
                [f["inject_to_unhealthy"]["p99_ms"] for f in faults]
            )
            results["kubelet_restart"] = measure.restarts(plugin, args.restarts)
        finally:
            plugin.close()
        results["dra"] = dra.measure(
            root, cdi_root / "dra", args.preset, args.dra_calls, args.fault_cycles, args.repeats
        )
        results["mps"] = mps.measure(root, cdi_root / "mps", args.preset, args.mps_kills)
        idle = Plugin(root / "idle", "h200x2", None)  # default config
        try:
            idle.start()
            results["idle"] = measure.idle(idle, args.idle_seconds)
        finally:
            idle.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(cdi_root, ignore_errors=True)
    results["targets"] = report.targets(results)
    results["wall_s"] = round(time.monotonic() - started, 1)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--preset", default="h200x8")
    parser.add_argument("--calls", type=int, default=2000, help="calls of each kind")
    parser.add_argument(
        "--new-allocations", type=int, default=200, help="Allocate calls on distinct slices"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="runs of every ratio and of the Xid figure"
    )
    parser.add_argument("--fault-cycles", type=int, default=30)
    parser.add_argument(
        "--dra-calls",
        type=int,
        default=200,
        help="NodePrepareResources calls of 1 claim, and as many of 8",
    )
    parser.add_argument("--mps-kills", type=int, default=20, help="MPS daemons killed on each API")
    parser.add_argument("--restarts", type=int, default=20)
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    parser.add_argument(
        "--root",
        type=Path,
        default=Path("/var/tmp") if Path("/var/tmp").is_dir() else Path(tempfile.gettempdir()),
        help="disk-backed directory for the state dirs, not a tmpfs (default /var/tmp)",
    )
    parser.add_argument("--json-out", type=Path, default=Path("bench-results/bench.json"))
    args = parser.parse_args(argv)
    # the arguments that shape the figures (the output path is a local detail)
    given = list(sys.argv[1:] if argv is None else argv)
    args.measured_argv = [
        a for i, a in enumerate(given)
        if not a.startswith("--json-out") and (i == 0 or given[i - 1] != "--json-out")
    ]  # fmt: skip
    # SIGTERM unwinds like Ctrl-C, so the plugin processes and temp dirs are cleaned up
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = run(args)
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(results, indent=2) + "\n")
    m = results["machine"]
    print(report.table(results))
    print(f"\n{m['cpus']} CPUs, {m['cpu_model']}; {results['wall_s']} s; JSON: {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
