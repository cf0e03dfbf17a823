"""hack/bench.py with tiny counts: the JSON has every figure, each a positive number.

A smoke test of the benchmark's plumbing against the real plugin process; it asserts no
timing threshold (the figures are the benchmark's output, not a test's verdict).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "hack"))

import bench

SUMMARY_KEYS = {"count", "p50_ms", "p99_ms", "mean_ms", "max_ms"}


def _positive_summary(summary: dict[str, Any], count: int) -> None:
    assert set(summary) == SUMMARY_KEYS
    assert summary["count"] == count
    for key in SUMMARY_KEYS - {"count"}:
        assert isinstance(summary[key], float) and summary[key] > 0, (key, summary)
    assert summary["p50_ms"] <= summary["p99_ms"] <= summary["max_ms"]


def _spread(s: dict[str, Any], runs: int) -> None:
    assert len(s["runs"]) == runs and all(v > 0 for v in s["runs"])
    assert s["min"] <= s["median"] <= s["max"]
    assert s["min"] == min(s["runs"]) and s["max"] == max(s["runs"])


def test_bench_tiny_run_writes_every_figure(short_tmp: Path, capsys: Any) -> None:
    out = short_tmp / "bench.json"
    argv = [
        "--calls",
        "24",
        "--new-allocations",
        "8",
        "--fault-cycles",
        "2",
        "--restarts",
        "2",
        "--idle-seconds",
        "2",
        "--dra-calls",
        "24",
        "--repeats",
        "2",
        "--mps-kills",
        "2",
    ]
    assert bench.main([*argv, "--json-out", str(out)]) == 0
    r = json.loads(out.read_text())

    devices = r["startup"]["devices"]
    assert list(devices) == ["nvidia.com/gpu-fraction"]
    # h200x8 at 256Mi slices: several thousand devices in one resource
    assert devices["nvidia.com/gpu-fraction"] > 4000
    assert r["startup"]["list_bytes"]["nvidia.com/gpu-fraction"] > 0
    assert r["startup"]["first_full_list_s"] > 0

    calls = r["calls"]
    for kind in ("echo", "echo_preferred_payload", "preferred", "allocate_reuse"):
        _positive_summary(calls[kind], 24)
    _positive_summary(calls["allocate_new"], 8)
    _positive_summary(calls["allocate_reuse_back_to_back"], 24 // 4)
    # a spacer call before every counted one; those right after one of the 56 plugin calls
    # (all of them, but the last counted call if it is one)
    spill = calls["echo_after_plugin_call"]
    _positive_summary(spill, spill["count"])
    assert spill["count"] in (55, 56)
    assert calls["ledger_records_after"] == 20 + 8  # after the first run
    assert calls["preferred_request_bytes"] > calls["allocate_request_bytes"] > 0
    for q in ("ratio_p50", "ratio_p99"):
        assert set(calls[q]) == {"preferred", "allocate_new", "allocate_reuse"}
        assert all(v > 0 for v in calls[q].values())

    # every ratio and the Xid figure twice (--repeats): the verdicts take the median
    for name in ("preferred", "allocate_new", "allocate_reuse", "preferred_payload_matched"):
        _spread(r["calls_runs"][name], 2)
    assert r["calls_runs"]["allocate_new"]["runs"][0] == calls["ratio_p99"]["allocate_new"]
    _spread(r["fault_runs"], 2)
    _spread(r["fault_inject_runs"], 2)
    # the second run took 8 new sets after the first run's: the ledger holds both
    assert r["fault"]["xid"] == 79 and r["fault"]["cycles"] == 2
    _positive_summary(r["fault"]["to_unhealthy"], 2)
    _positive_summary(r["fault"]["inject_to_unhealthy"], 2)
    # the Xid enters NVML after the inject call starts: the event's figure is the shorter
    assert r["fault"]["to_unhealthy"]["p50_ms"] < r["fault"]["inject_to_unhealthy"]["p50_ms"]
    _positive_summary(r["fault"]["recover_to_healthy"], 2)
    assert r["fault"]["largest_unhealthy_list_bytes"] > 0

    for key in ("to_registered", "new_socket_to_registered", "to_first_list"):
        _positive_summary(r["kubelet_restart"][key], 2)

    idle = r["idle"]
    assert idle["seconds"] >= 2
    assert idle["rss_mb"] > 0 and idle["rss_peak_mb"] >= idle["rss_mb"]
    # CPU over 2 s can honestly round to zero clock ticks; it must still be a real reading
    assert idle["cpu_percent"] >= 0 and idle["mps_cpu_percent"] >= 0
    assert idle["mps_daemons"] == 0  # default config is time-slicing: no MPS

    assert [t["name"] for t in r["targets"]] == [t["name"] for t in bench.report.targets(r)]
    assert all(isinstance(t["met"], bool) for t in r["targets"])
    assert r["machine"]["cpus"] >= 1 and r["machine"]["cpu_model"]
    printed = capsys.readouterr().out
    assert "| Idle RSS, plugin (MB) |" in printed and str(out) in printed

    d = r["dra"]
    for key in ("prepare_1", "prepare_8"):  # --dra-calls of each
        assert d[key]["claims_per_call"] == int(key[-1])
        for summary in ("prepare", "unprepare", "echo", "claim_gets"):
            _positive_summary(d[key][summary], 24)
        assert d[key]["ratio_p99"] > 0
        # one GET per claim the kubelet names, counted by the stand-in API server
        assert d[key]["claim_gets_per_prepare"] == d[key]["claims_per_call"]
    for key in ("prepare_1_runs", "prepare_8_runs"):
        _spread(d[key], 2)
        assert d[key]["runs"][0] == d[key[:-5]]["ratio_p99"]
    assert d["taint"]["xid"] == 79 and d["taint"]["cycles"] == 2
    _positive_summary(d["taint"]["to_taint"], 2)
    _positive_summary(d["taint"]["recover_to_untainted"], 2)
    assert "| DRA: NodePrepareResources, 8 claims |" in printed
    assert "| Over 2 runs | median (range; each run) |" in printed

    m = r["mps"]  # one daemon of each API killed per round, --mps-kills rounds
    assert m["rounds"] == 2
    _positive_summary(m["kill_to_unhealthy"], 2)
    _positive_summary(m["kill_to_taint"], 2)


def test_profile_tiny_run_times_every_stage(short_tmp: Path, capsys: Any) -> None:
    """hack/callprofile.py with tiny counts: every stage timed in both modes, totals that hold
    their stages (no threshold: the figures are the profile's output)."""
    import callprofile

    out = short_tmp / "profile.json"
    argv = ["--calls", "6", "--warmup", "1", "--evict-mib", "1", "--root", str(short_tmp)]
    assert callprofile.main([*argv, "--json-out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["devices"] > 4000
    assert len(r["profiles"]) == 3
    for by_mode in r["profiles"].values():
        assert set(by_mode) == {"hot", "cold"}
        for stages in by_mode.values():
            assert all(s["calls"] == 5 and s["p50_us"] > 0 for s in stages.values()), stages
            parts = [v["p50_us"] for k, v in stages.items() if k[0] != " " and k != "TOTAL"]
            assert stages["TOTAL"]["p50_us"] * 1.5 >= max(parts)
    allocate = r["profiles"]["Allocate, a new 2-slice set"]["hot"]
    assert {"validate the IDs", "    create + rename (tmpfs)", "ledger add"} <= set(allocate)
    assert "Allocate, a new 2-slice set" in capsys.readouterr().out
