"""What an answer names exists (DESIGN 3b): under `cdi` a GPU is advertised only while the
driver's CDI device for it resolves in `cdi.specDirs`, rechecked when they change; the
memory-limit hook counts only when `nvidia-ctk hook apply-cuda-memory-limits --help` works."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deviceplugin.cdi import specs as cdi_specs
from deviceplugin.cdi.registry import DriverDeviceWatch, driver_devices
from deviceplugin.config.settings import parse
from deviceplugin.inventory.gpus import probe_memory_limits_hook
from deviceplugin.model import Enforcement
from deviceplugin.plan import build_plan, cuda_limit_failures, missing_driver_devices, skip_gpus
from deviceplugin.report import format_inventory_table, inventory_report
from deviceplugin.simulate.cdi import DRIVER_KIND, write_driver_cdi_spec
from deviceplugin.simulate.ctk import write_nvidia_ctk
from deviceplugin.simulate.node import simulated_node_facts
from deviceplugin.simulate.specs import SpecError, load_spec, parse_spec
from tests.conftest import MakePlugin
from tests.test_plan import inventory

TS = "nvidia.com/gpu-fraction"


def test_a_gpu_whose_driver_device_does_not_resolve_is_skipped(tmp_path: Path) -> None:
    inv = inventory("h200x2")
    config = parse({"version": "v1", "cdi": {"specDirs": [str(tmp_path)]}})
    plan = build_plan(inv, config)
    known = {f"{DRIVER_KIND}={inv.gpus[1].uuid}", f"{DRIVER_KIND}=0"}  # by index: not enough
    missing = missing_driver_devices(plan, config, known)
    assert list(missing) == [inv.gpus[0].uuid]
    assert missing[inv.gpus[0].uuid].startswith("no-driver-cdi-device: ")
    assert str(tmp_path) in missing[inv.gpus[0].uuid]
    served = skip_gpus(plan, missing)
    assert [gp.advertised for gp in served.gpus] == [False, True]
    report = inventory_report(inv, served)
    assert "no-driver-cdi-device" in format_inventory_table(report).splitlines()[2]
    envvar = parse(
        {"version": "v1", "deviceListStrategy": ["envvar"], "enforcement": "best-effort"}
    )
    assert missing_driver_devices(build_plan(inv, envvar), envvar, set()) == {}


def test_the_driver_spec_lands_where_the_spec_dirs_point(tmp_path: Path) -> None:
    spec = load_spec("h200x2")
    write_driver_cdi_spec(spec, tmp_path / "etc-cdi")
    dirs = [tmp_path / "etc-cdi", tmp_path / "absent"]
    assert driver_devices(dirs, DRIVER_KIND) >= {f"{DRIVER_KIND}={g.uuid}" for g in spec.gpus}
    assert driver_devices(dirs, "other.com/gpu") == frozenset()


def test_the_simulated_nvidia_ctk_is_as_strict_as_the_toolkit(tmp_path: Path) -> None:
    new = load_spec("h200x2")
    old = dataclasses.replace(new, toolkit_version="1.19.0")
    assert probe_memory_limits_hook(str(write_nvidia_ctk(new, tmp_path / "new")))
    assert not probe_memory_limits_hook(str(write_nvidia_ctk(old, tmp_path / "old")))
    assert not probe_memory_limits_hook(str(tmp_path / "missing"))
    assert simulated_node_facts(new, tmp_path / "a").memory_limits_hook
    assert not simulated_node_facts(old, tmp_path / "b").memory_limits_hook
    ldcache = subprocess.run([str(tmp_path / "old"), "hook", "update-ldcache"], check=False)
    assert ldcache.returncode == 0  # the hooks every toolkit has still run


def test_toolkit_version_in_a_spec() -> None:
    base = {"driverVersion": "615.43.02", "gpus": [{"name": "NVIDIA H200", "memoryMiB": 143771}]}
    assert parse_spec(base, "t").memory_limits_hook
    assert not parse_spec({**base, "toolkitVersion": "1.18.2"}, "t").memory_limits_hook
    with pytest.raises(SpecError, match="toolkitVersion"):
        parse_spec({**base, "toolkitVersion": "new"}, "t")


@pytest.mark.parametrize("enforcement", ["required", "best-effort"])
def test_an_old_toolkit_fails_the_hook_condition(enforcement: str) -> None:
    inv = inventory("h200x2", memory_limits_hook=False)
    config = parse({"version": "v1", "enforcement": enforcement})
    failures = cuda_limit_failures(inv.node, config, True)
    assert len(failures) == 1 and failures[0].startswith("hook-unsupported: ")
    gp = build_plan(inv, config).gpus[0]
    if enforcement == "required":
        assert gp.skipped is not None and "hook-unsupported" in gp.skipped
    else:
        assert gp.advertised and gp.enforcement == (Enforcement.NONE,)
    report = inventory_report(inv, None, cuda_limits_unmet=failures)
    assert report["node"]["memoryLimitsHook"] is False
    assert "hook-unsupported" in format_inventory_table(report)


def test_inventory_shows_both(tmp_path: Path) -> None:
    spec = tmp_path / "old-toolkit.yaml"
    spec.write_text(
        "driverVersion: '615.43.02'\ntoolkitVersion: '1.19.0'\n"
        "gpus: [{name: NVIDIA H200, memoryMiB: 143771}]\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "deviceplugin", "inventory", "--simulate", str(spec), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report = json.loads(done.stdout)
    assert report["node"]["memoryLimitsHook"] is False
    assert any("hook-unsupported" in u for u in report["node"]["cudaMemoryLimitsUnmet"])
    assert report["gpus"][0]["skipped"] and "hook-unsupported" in report["gpus"][0]["skipped"]


def test_the_watch_sees_the_driver_spec_go_and_come_back(tmp_path: Path) -> None:
    import threading

    spec = load_spec("h200x2")
    path = write_driver_cdi_spec(spec, tmp_path / "cdi")
    dirs = [tmp_path / "cdi"]
    seen: list[frozenset[str]] = []
    changed = threading.Event()

    def on_change(devices: frozenset[str]) -> None:
        seen.append(devices)
        changed.set()

    watch = DriverDeviceWatch(
        dirs, DRIVER_KIND, driver_devices(dirs, DRIVER_KIND), on_change, interval=0.05
    )
    watch.start()
    try:
        for n in range(5):  # what Allocates write: ours, atomically (temp file + rename)
            cdi_specs.write_spec(tmp_path / "cdi", cdi_specs.build_spec(f"x{n}", {"A": "1"}))
        for n in range(5):  # and what DRA prepares write: one spec per claim
            claim = cdi_specs.build_spec(f"u{n}-gpu-0-0", {"A": "1"}, kind=cdi_specs.CLAIM_KIND)
            cdi_specs.write_spec(
                tmp_path / "cdi", claim, cdi_specs.claim_spec_path(tmp_path / "cdi", f"u{n}")
            )
        path.unlink()
        assert changed.wait(10) and seen[-1] == frozenset()
        assert watch.scans <= 2  # the driver spec's removal, not our ten specs
        changed.clear()
        write_driver_cdi_spec(spec, tmp_path / "cdi")
        assert changed.wait(10) and f"{DRIVER_KIND}={spec.gpus[0].uuid}" in seen[-1]
    finally:
        watch.stop()


def test_the_watch_sees_a_spec_directory_made_after_it_started(tmp_path: Path) -> None:
    spec = load_spec("h200x2")
    dirs = [tmp_path / "etc-cdi"]  # not there yet: the toolkit writes it late after a boot
    seen: list[frozenset[str]] = []
    watch = DriverDeviceWatch(dirs, DRIVER_KIND, frozenset(), seen.append, interval=0.05)
    watch.start()
    try:
        time.sleep(0.2)
        assert watch.scans == 0  # nothing changed, nothing parsed
        write_driver_cdi_spec(spec, dirs[0])
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.02)
        assert seen and f"{DRIVER_KIND}={spec.gpus[0].uuid}" in seen[-1]
        shutil.rmtree(dirs[0])
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert seen[-1] == frozenset()
    finally:
        watch.stop()


def test_the_plugin_stops_and_resumes_advertising_with_the_driver_spec(
    make_plugin: MakePlugin, short_tmp: Path
) -> None:
    etc_cdi = short_tmp / "etc-cdi"
    # devRoot holds no /dev/nvidia*: the plugin's own `cdi generate` fails too, so a GPU
    # without the toolkit's device has no driver device at all.
    plugin = make_plugin(
        f"version: v1\ncdi:\n  specDirs: [{etc_cdi}, {short_tmp / 'cdi'}]\n"
        f"  devRoot: {short_tmp / 'no-dev'}\n",
        preset="h200x2",
    )
    plugin.start()
    plugin.wait_registered(1)
    everything = len(plugin.kubelet.devices(TS))
    assert everything > 0
    driver_spec = etc_cdi / "nvidia.yaml"  # the simulated node put it where specDirs point
    body = driver_spec.read_bytes()
    lines = body.decode().splitlines()
    # The toolkit regenerates its spec without GPU 0 (e.g. it fell off the bus at boot).
    gpu0 = load_spec("h200x2").gpus[0].uuid
    without = [line for line in lines if gpu0 not in line]
    driver_spec.unlink()
    assert plugin.kubelet.wait_for(lambda: plugin.kubelet.devices(TS) == [], 30), plugin.log
    (etc_cdi / "nvidia.yaml").write_text("\n".join(without) + "\n")
    half = lambda: 0 < len(plugin.kubelet.devices(TS)) < everything  # noqa: E731
    assert plugin.kubelet.wait_for(half, 30), plugin.log.read_text()[-2000:]
    assert all(gpu0 not in d for d, _, _ in plugin.kubelet.devices(TS))
    driver_spec.write_bytes(body)
    assert plugin.kubelet.wait_for(lambda: len(plugin.kubelet.devices(TS)) == everything, 30)
    assert "no-driver-cdi-device" in plugin.log.read_text()
    # A reload naming another spec directory: the plugin reads and watches that one now.
    other = short_tmp / "other-cdi"
    other.mkdir()
    plugin.config.write_text(
        f"version: v1\ncdi:\n  specDirs: [{other}]\n  devRoot: {short_tmp / 'no-dev'}\n"
    )
    assert plugin.kubelet.wait_for(lambda: plugin.kubelet.devices(TS) == [], 30)
    (other / "nvidia.yaml").write_bytes(body)
    assert plugin.kubelet.wait_for(lambda: len(plugin.kubelet.devices(TS)) == everything, 30)
