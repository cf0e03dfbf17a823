"""The benchmark's table: each figure beside its DESIGN section 7 target, and the machine.

`targets()` derives the pass/fail rows from the results JSON; `table()` renders them and the
informational rows as a Markdown table, which is also what the terminal shows.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

MIB = 2**20


def machine() -> dict[str, Any]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import grpc

    return {
        "cpus": os.cpu_count(),
        "loadavg_1m_at_start": os.getloadavg()[0],  # other work on a shared box skews figures
        "cpu_model": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
    }


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Each verdict from the median of the repeated runs (`*_runs`), never from one run."""
    f, k, s, i = r["fault"], r["kubelet_restart"], r["startup"], r["idle"]
    runs, xid = r["calls_runs"], r["fault_runs"]["median"]
    injected = r["fault_inject_runs"]["median"]
    largest = max([*s["list_bytes"].values(), f["largest_unhealthy_list_bytes"]])
    d, m = r["dra"], r["mps"]
    rows = [
        ("Allocate (reuse) p99 / echo p99", runs["allocate_reuse"]["median"], "<= 1.5", 1.5),
        ("Allocate (new) p99 / echo p99", runs["allocate_new"]["median"], "<= 1.5", 1.5),
        # DESIGN 7: within 1.5x a bare call; the bare call of a preferred request carries the
        # same 200 KB (the small echo's ratio is in the extra rows)
        (
            "GetPreferredAllocation p99 / same-payload sink p99",
            runs["preferred_payload_matched"]["median"],
            "<= 1.5",
            1.5,
        ),
        # DESIGN 7: fault injection to the kubelet's update, the harness's hops included
        ("Xid 79 inject call to ListAndWatch p99 (ms)", injected, "<= 100", 100.0),
        # our own goal: nothing but our queueing stands between the NVML event and the stream
        ("Xid 79 in NVML to ListAndWatch p99 (ms), the goal", xid, "<= 20", 20.0),
        ("Kubelet restart to registered p99 (ms)", k["to_registered"]["p99_ms"], "<= 1000", 1000.0),
        ("Largest ListAndWatch message (bytes)", largest, "< 1048576", MIB - 1),
        ("Idle CPU, plugin + children (% of a core)", i["cpu_percent"], "< 1", 0.999999),
        ("Idle RSS, plugin (MB)", i["rss_mb"], "< 80", 79.999999),
        # a GET per claim on the reply path (concurrent for 8): 2x (echo + those GETs)
        (
            "NodePrepareResources (1 claim) p99 / (echo + claim GET) p99",
            d["prepare_1_runs"]["median"],
            "<= 2",
            2.0,
        ),
        (
            "NodePrepareResources (8 claims) p99 / (echo + 8 concurrent claim GETs) p99",
            d["prepare_8_runs"]["median"],
            "<= 2",
            2.0,
        ),
        (
            "Xid 79 to taint in the API server p99 (ms)",
            d["taint"]["to_taint"]["p99_ms"],
            "<= 500",
            500.0,
        ),
        # an MPS daemon's death, seen through its pidfd whatever mps.probeInterval (5 s) is
        (
            "MPS daemon kill to ListAndWatch Unhealthy p99 (ms)",
            m["kill_to_unhealthy"]["p99_ms"],
            "<= 200",
            200.0,
        ),
        (
            "MPS daemon kill to taint in the API server p99 (ms)",
            m["kill_to_taint"]["p99_ms"],
            "<= 200",
            200.0,
        ),
    ]
    return [{"name": n, "value": v, "target": t, "met": v <= lim} for n, v, t, lim in rows]


def _with_sync(d: dict[str, Any], kind: str) -> float:
    """Prepare p99 against its echo, its claim GETs and the one durable write a prepare
    needs (DESIGN 10: the answer is on disk before it leaves)."""
    floor = (
        float(d[kind]["echo"]["p99_ms"])
        + float(d[kind].get("claim_gets", {}).get("p99_ms", 0.0))
        + float(d["durable_append"]["p99_ms"])
    )
    return round(float(d[kind]["prepare"]["p99_ms"]) / floor, 3)


def _spread(s: dict[str, Any]) -> str:
    return f"{s['median']} ({s['min']} to {s['max']}; " + ", ".join(map(str, s["runs"])) + ")"


def _row(label: str, s: dict[str, Any]) -> str:
    return f"| {label} | {s['p50_ms']:.2f} / {s['p99_ms']:.2f} | {s['count']} |"


def table(r: dict[str, Any]) -> str:
    c, f, k, s, i = r["calls"], r["fault"], r["kubelet_restart"], r["startup"], r["idle"]
    latencies = [
        (f"bare grpcio echo (Allocate-sized, {c['allocate_request_bytes']} B)", c["echo"]),
        (f"bare grpcio sink ({c['preferred_request_bytes']} B, preferred-sized)",
         c["echo_preferred_payload"]),
        ("GetPreferredAllocation (2 of all slices)", c["preferred"]),
        ("Allocate, one of 20 granted 2-slice sets again", c["allocate_reuse"]),
        (f"Allocate, new 2-slice set (ledger grows to {c['ledger_records_after']})",
         c["allocate_new"]),
        ("Allocate, one of 20 sets again, back to back (not after a spacer)",
         c["allocate_reuse_back_to_back"]),
        ("spacer echo right after a plugin call (what replies defer)",
         c["echo_after_plugin_call"]),
        (f"Xid {f['xid']} in the fake NVML to Unhealthy update", f["to_unhealthy"]),
        (f"Xid {f['xid']} inject call to Unhealthy update (the harness's file and inotify too)",
         f["inject_to_unhealthy"]),
        ("recover inject to Healthy update (probe 1 s, quietPeriod 0s)",
         f["recover_to_healthy"]),
        ("kubelet restart to re-registered", k["to_registered"]),
        ("new kubelet.sock to re-registered", k["new_socket_to_registered"]),
        ("kubelet restart to first full list", k["to_first_list"]),
        ("DRA: bare grpcio echo of a 1-claim prepare request", r["dra"]["prepare_1"]["echo"]),
        ("DRA: the claim GET a 1-claim prepare needs, bare", r["dra"]["prepare_1"]["claim_gets"]),
        ("DRA: NodePrepareResources, 1 claim", r["dra"]["prepare_1"]["prepare"]),
        ("DRA: NodeUnprepareResources, 1 claim", r["dra"]["prepare_1"]["unprepare"]),
        ("DRA: prepare answer to claim status record in the API server, 1 claim",
         r["dra"]["prepare_1"]["answer_to_status_record"]),
        ("DRA: bare append + fdatasync on the state dir's disk", r["dra"]["durable_append"]),
        ("DRA: bare grpcio echo of an 8-claim prepare request", r["dra"]["prepare_8"]["echo"]),
        ("DRA: the 8 concurrent claim GETs an 8-claim prepare needs, bare",
         r["dra"]["prepare_8"]["claim_gets"]),
        ("DRA: NodePrepareResources, 8 claims", r["dra"]["prepare_8"]["prepare"]),
        ("DRA: NodeUnprepareResources, 8 claims", r["dra"]["prepare_8"]["unprepare"]),
        (f"DRA: Xid {r['dra']['taint']['xid']} inject to taint in the API server",
         r["dra"]["taint"]["to_taint"]),
        ("DRA: recover inject to taint removed (quietPeriod 0s)",
         r["dra"]["taint"]["recover_to_untainted"]),
        ("MPS daemon SIGKILL to Unhealthy update (probeInterval 5s)",
         r["mps"]["kill_to_unhealthy"]),
        ("MPS daemon SIGKILL to taint in the API server (probeInterval 5s)",
         r["mps"]["kill_to_taint"]),
    ]  # fmt: skip
    lines = ["| Measure | p50 / p99 (ms) | n |", "|---|---|---|"]
    lines += [_row(label, summary) for label, summary in latencies]
    runs, d = r["calls_runs"], r["dra"]
    repeated = [
        ("Allocate (reuse) p99 / echo p99", runs["allocate_reuse"]),
        ("Allocate (new) p99 / echo p99", runs["allocate_new"]),
        ("GetPreferredAllocation p99 / same-payload sink p99",
         runs["preferred_payload_matched"]),
        ("GetPreferredAllocation p99 / small echo p99", runs["preferred"]),
        ("NodePrepareResources (1 claim) p99 / (echo + claim GET) p99", d["prepare_1_runs"]),
        ("NodePrepareResources (8 claims) p99 / (echo + 8 claim GETs) p99",
         d["prepare_8_runs"]),
        ("Xid 79 in NVML to ListAndWatch p99 (ms)", r["fault_runs"]),
        ("Xid 79 inject call to ListAndWatch p99 (ms)", r["fault_inject_runs"]),
    ]  # fmt: skip
    lines += ["", f"| Over {len(runs['allocate_new']['runs'])} runs | median (range; each run) |",
              "|---|---|"]  # fmt: skip
    lines += [f"| {label} | {_spread(s)} |" for label, s in repeated]
    lines += ["", "| Figure | Value | Target | Met |", "|---|---|---|---|"]
    for t in targets(r):
        met = "yes" if t["met"] else "NO"
        lines.append(f"| {t['name']} | {t['value']} | {t['target']} | {met} |")
    extra: list[tuple[str, object]] = [
        (f"devices advertised, {resource}", n) for resource, n in s["devices"].items()
    ]
    extra += [
        ("process start to first full list (s)", s["first_full_list_s"]),
        ("GetPreferredAllocation p99 / small echo p99", c["ratio_p99"]["preferred"]),
        ("DRA: NodePrepareResources p99 / (echo + claim GETs + one fdatasync) p99, 1 / 8 claims",
         f"{_with_sync(r['dra'], 'prepare_1')} / {_with_sync(r['dra'], 'prepare_8')}"),
        ("idle RSS peak, plugin (MB)", i["rss_peak_mb"]),
        ("DRA: claim GETs per prepare call (1 claim / 8 claims)",
         f"{r['dra']['prepare_1']['claim_gets_per_prepare']} / "
         f"{r['dra']['prepare_8']['claim_gets_per_prepare']}"),
        ("idle MPS daemons (own session) / their CPU %",
         f"{i['mps_daemons']} / {i['mps_cpu_percent']}"),
    ]  # fmt: skip
    lines += [f"| {label} | {value} | | |" for label, value in extra]
    return "\n".join(lines)
