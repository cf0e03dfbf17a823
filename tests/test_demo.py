"""`make demo` runs `gpu-fraction-plugin demo`: the allocation table and the fault story."""

from __future__ import annotations

import json
import subprocess
import sys


def test_demo_tells_the_whole_story_and_exits_0() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "deviceplugin", "demo", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout)
    assert data["exit"] == 0
    rows = {(r["pod"], r["container"]): r for r in data["allocations"]}
    ts = rows[("fraction-time-slicing", "app")]
    assert (ts["mode"], ts["request"], ts["limit"]) == ("time-slicing", "4096Mi", "4096Mi")
    assert ts["enforcement"] == "cuda-memory-limits" and ts["delivery"] == "cdi-edit"
    sm = rows[("fraction-sm-sharing", "app")]
    assert sm["mode"] == "sm-sharing" and sm["enforcement"] == "mps-pinned-limit"
    ceiling = rows[("fraction-with-ceiling", "app")]
    assert ceiling["declared_ceiling"] == "16Gi" and ceiling["limit"] == ceiling["request"]
    init, app = (
        rows[("fraction-init-container", "warmup")],
        rows[("fraction-init-container", "app")],
    )
    assert init["gpu"] == app["gpu"] != "-"
    assert rows[("whole-gpu", "app")]["outcome"].startswith("pending")
    story = [e["what"] for e in data["events"]]
    assert any("Xid 79" in s for s in story)
    assert any(
        "0/139 healthy; nvidia.com/gpu-fraction.sm-sharing still 139/139" in s for s in story
    )
    assert any("restarted and probed" in s for s in story)
    assert story[-1].startswith("after the 2 s quiet period")
    assert data["log"][-1] == "plugin stopped on SIGTERM, exit 0"


def test_demo_leaves_no_process_behind() -> None:
    before = _daemons()
    subprocess.run(
        [sys.executable, "-m", "deviceplugin", "demo", "--json"],
        capture_output=True,
        timeout=120,
        check=True,
    )
    assert _daemons() - before == set()


def _daemons() -> set[int]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return {
        int(line.split()[0])
        for line in out.splitlines()[1:]
        if "gf-demo-" in line and "nvidia-cuda-mps-control" in line
    }
