"""`make demo` runs `gpu-fraction-plugin demo`: both APIs side by side on one simulated node,
the allocation tables of each and the same faults seen through each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def demo() -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "deviceplugin", "demo", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def test_device_plugin_rows_show_caps_and_the_guessed_ceiling(demo: dict[str, Any]) -> None:
    assert demo["exit"] == 0
    rows = {(r["pod"], r["container"]): r for r in demo["allocations"]}
    ts = rows[("fraction-time-slicing", "app")]
    assert (ts["mode"], ts["request"], ts["limit"]) == ("time-slicing", "4096Mi", "4096Mi")
    assert ts["enforcement"] == "cuda-memory-limits" and ts["delivery"] == "cdi-edit"
    sm = rows[("fraction-sm-sharing", "app")]
    assert sm["mode"] == "sm-sharing" and "mps-pinned-limit" in sm["enforcement"].split(",")
    # two pending pods ask for 8 sm-sharing slices, one declaring 16Gi: the plugin cannot tell
    # which one an Allocate serves, so it takes the lowest, and says it guessed
    ceiling = rows[("fraction-with-ceiling", "app")]
    assert ceiling["declared_ceiling"] == "16Gi" and ceiling["limit"] == ceiling["request"]
    assert ceiling["ceiling_source"].startswith("guessed: candidates disagree")
    init, app = (
        rows[("fraction-init-container", "warmup")],
        rows[("fraction-init-container", "app")],
    )
    assert init["gpu"] == app["gpu"] != "-"
    assert rows[("whole-gpu", "app")]["mode"] == "exclusive"


def test_dra_rows_come_from_claim_status_with_exact_amounts(demo: dict[str, Any]) -> None:
    claims = {r["claim"]: r for r in demo["claims"]}
    ts = claims["dra-time-slicing-gpu"]
    assert (ts["mode"], ts["request"], ts["limit"]) == ("time-slicing", "4096Mi", "4096Mi")
    assert ts["device"].startswith("gpu-4") and ts["outcome"] == "prepared"
    told = claims["dra-with-ceiling-gpu"]
    assert (told["declared_ceiling"], told["request"], told["limit"]) == ("8Gi", "4096Mi", "8192Mi")
    assert told["ceiling_source"] == "told: the claim's config; applied"
    assert claims["dra-exclusive-gpu"]["device"].startswith("gpu-5")
    # one time-slicing GPU on DRA: two shares on distinct GPUs cannot be placed
    assert claims["dra-two-gpus-gpus"]["outcome"].startswith("pending: no time-slicing")


def test_the_same_faults_through_both_apis(demo: dict[str, Any]) -> None:
    story = [e["what"] for e in demo["events"]]
    assert any("Xid 79" in s and "GPU 1" in s and "GPU 4" in s for s in story)
    assert any("nvidia.com/gpu-fraction 0/139 healthy" in s for s in story)
    assert any("gpu-4 tainted gpu-fraction.dev/unhealthy=xid-79:NoSchedule" in s for s in story)
    assert any("untouched: gpu-3, gpu-5" in s for s in story)
    assert any("not schedulable" in s and "gpu-4 tainted" in s for s in story)
    assert any("gpu-3 tainted gpu-fraction.dev/unhealthy=mps-down" in s for s in story)
    assert any("restarted and probed" in s and "taint removed" in s for s in story)
    assert story[-1].startswith("after the 2 s quiet period") and "taint removed" in story[-1]
    assert demo["log"][-1] == "plugin stopped on SIGTERM, exit 0"


def test_demo_runs_where_only_the_runtime_dependencies_are_installed() -> None:
    # An image built with `pip install .` has no dev extra: the stand-in API server's schemas
    # (kubernetes-validate, jsonschema, referencing) must not be needed to run the demo.
    blocked = ("kubernetes_validate", "jsonschema", "referencing")
    prelude = (
        "import runpy, sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None  # import fails, find_spec says absent\n"
        "sys.argv = ['deviceplugin', 'demo', '--json']\n"
        "runpy.run_module('deviceplugin', run_name='__main__')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", prelude], capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout)
    assert data["exit"] == 0
    assert {r["outcome"] for r in data["claims"]} >= {"prepared"}


def test_demo_without_its_example_manifests_says_where_it_looked(tmp_path: Path) -> None:
    # As in an installed package: no source tree beside it, so no daemonset/examples.
    result = subprocess.run(
        [sys.executable, "-m", "deviceplugin", "demo", "--examples", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert str(tmp_path) in result.stderr and "--examples" in result.stderr
    assert result.stdout == ""


def test_demo_leaves_no_process_behind() -> None:
    before = _daemons()
    subprocess.run(
        [sys.executable, "-m", "deviceplugin", "demo", "--json"],
        capture_output=True,
        timeout=180,
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
