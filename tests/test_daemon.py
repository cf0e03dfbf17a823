"""The real plugin process on simulated GPUs, driven through the kubelet simulator."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from deviceplugin.cli import main
from deviceplugin.flags import RUN_FLAGS
from deviceplugin.plumbing.process import pid_alive
from tests.conftest import MakePlugin
from tests.plugin_proc import PluginProcess

TS, SM = "nvidia.com/gpu-fraction", "nvidia.com/gpu-fraction.sm-sharing"
SPLIT = """\
version: v1
gpus:
  - match: {index: 0}
    mode: sm-sharing
  - match: {index: 1}
    mode: time-slicing
"""


@pytest.fixture
def plugin(make_plugin: MakePlugin) -> PluginProcess:
    return make_plugin(SPLIT)


def test_run_registers_allocates_and_stops_cleanly(plugin: PluginProcess) -> None:
    plugin.start()
    plugin.wait_registered(2)
    assert sorted(plugin.kubelet.resources()) == [TS, SM]
    assert len(plugin.kubelet.devices(TS)) == 139 == len(plugin.kubelet.devices(SM))

    ts = plugin.kubelet.allocate(TS, 4)
    assert ts.annotations["gpu-fraction.dev/enforcement"] == "cuda-memory-limits"
    assert [c.name.split("=")[0] for c in ts.cdi_devices] == [
        "nvidia.com/gpu",
        "gpu-fraction.dev/gpu",
    ]
    # sm-sharing slices turn Healthy once GPU 0's MPS daemon is up and verified
    assert plugin.kubelet.wait_for(lambda: len(plugin.kubelet.healthy(SM)) == 139, 20)
    sm = plugin.kubelet.allocate(SM, 2)
    assert sm.annotations["gpu-fraction.dev/mode"] == "sm-sharing"
    assert (plugin.mps_root / sm.annotations["gpu-fraction.dev/gpu"] / "pipe").is_dir()
    with pytest.raises(grpc.RpcError) as refused:
        plugin.kubelet.allocate_ids(TS, ["GPU-nope::1"])
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT

    started = time.monotonic()
    assert plugin.terminate() == 0
    assert time.monotonic() - started < 5
    assert not [p.name for p in plugin.kubelet_dir.iterdir() if p.name.startswith("gfp-")]
    assert "stopped" in plugin.log.read_text()


def test_metrics_after_allocations(plugin: PluginProcess) -> None:
    plugin.start()
    plugin.wait_registered(2)
    for _ in range(3):
        plugin.kubelet.allocate(TS, 2)
    port = plugin.metrics_port()
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    allocated = [
        line
        for line in body.splitlines()
        if line.startswith("gpu_fraction_slices{")
        and 'state="allocated"' in line
        and f'resource="{TS}"' in line
    ]
    assert allocated and float(allocated[0].rsplit(" ", 1)[1]) == 6.0, allocated
    assert "gpu_fraction_allocate_duration_seconds_count" in body
    limits = [
        float(line.rsplit(" ", 1)[1])
        for line in body.splitlines()
        if line.startswith("gpu_fraction_allocation_memory_limit_bytes{")
    ]
    # one series per resource and GPU (no pod labels by default), the allocations summed
    assert sum(limits) == 3 * 2.0 * 1024**3 and len(limits) <= 2, limits
    assert 'pod="' not in body
    ready = urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5)
    assert ready.status == 200
    # a refusal, a fault and the MPS daemon's probes show up too
    with pytest.raises(grpc.RpcError):
        plugin.kubelet.allocate_ids(TS, ["GPU-00000000-0000-0000-0000-000000000000::0"])
    from deviceplugin.simulate.inject import inject

    inject(plugin.state, "1", "xid", 48)
    assert plugin.kubelet.wait_for(lambda: plugin.kubelet.healthy(TS) == [], 10)
    time.sleep(2.5)  # the MPS probe latency is sampled every 2 s
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in body.splitlines()
        if line.startswith("gpu_fraction_")
    }

    def value(prefix: str, *labels: str) -> float:
        found = [
            v for k, v in values.items() if k.startswith(prefix) and all(x in k for x in labels)
        ]
        assert found, (prefix, labels)
        return sum(found)

    assert value("gpu_fraction_registrations_total", TS) >= 1
    assert value("gpu_fraction_allocations_refused_total", TS, 'reason="INVALID_ARGUMENT"') == 1
    assert value("gpu_fraction_health_transitions_total", 'domain="gpu"', 'to="Unhealthy"') == 1
    assert value("gpu_fraction_slices{", TS, 'health="Unhealthy"') == 139
    assert value("gpu_fraction_mps_probe_duration_seconds_count") >= 1
    assert value("gpu_fraction_preferred_allocation_duration_seconds_count", TS) == 3
    assert plugin.terminate() == 0


def test_bad_config_exits_2_fast(short_tmp: Path) -> None:
    p = PluginProcess(short_tmp, config="version: v1\nsliceSize: 0\nmps: {maxClients: 500}\n")
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "deviceplugin", "run", *p.args()],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert time.monotonic() - started < 5
    assert "sliceSize" in result.stderr and "mps.maxClients" in result.stderr
    assert "Traceback" not in result.stderr


def test_inventory_without_driver_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inventory"]) == 1
    err = capsys.readouterr().err
    assert "no NVIDIA driver found on this node; use --simulate PRESET" in err


def test_help_lists_every_flag_with_its_variable(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in RUN_FLAGS:
        assert flag.name in text and flag.env in text
        if flag.default:
            assert flag.default in text
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for flag in RUN_FLAGS:
        assert f"`{flag.name}`" in readme and flag.env in readme


def test_flag_variables_apply_and_flags_win(plugin: PluginProcess) -> None:
    # --kubelet-dir comes from its variable only; the other flags are given
    args = [a for a in plugin.args()]
    i = args.index("--kubelet-dir")
    del args[i : i + 2]
    plugin.kubelet.start()
    env = {
        "GPU_FRACTION_KUBELET_DIR": str(plugin.kubelet_dir),
        "GPU_FRACTION_STATE_DIR": "/nonexistent/x",
    }
    import os

    proc = subprocess.Popen(
        [sys.executable, "-m", "deviceplugin", "run", *args],
        env={**os.environ, **env},
        stderr=subprocess.PIPE,
    )
    try:
        plugin.wait_registered(2)
        assert not Path("/nonexistent/x").exists()  # the --state-dir flag beat its variable
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0


def test_reload_through_configmap_symlink_swap(short_tmp: Path) -> None:
    # Kubernetes mounts a ConfigMap as <dir>/config.yaml -> ..data/config.yaml, and updates it
    # by pointing the ..data symlink at a new timestamped directory.
    cm = short_tmp / "cm"
    cm.mkdir()

    def publish(name: str, text: str) -> None:
        (cm / name).mkdir()
        (cm / name / "config.yaml").write_text(text)
        tmp = cm / "..data_tmp"
        tmp.symlink_to(name)
        tmp.rename(cm / "..data")

    publish("..v1", "version: v1\n")
    (cm / "config.yaml").symlink_to("..data/config.yaml")
    p = PluginProcess(short_tmp)
    try:
        args = [*p.args(), "--config", str(cm / "config.yaml")]
        p.kubelet.start()
        with p.log.open("ab") as log:
            p.proc = subprocess.Popen(
                [sys.executable, "-m", "deviceplugin", "run", *args], stderr=log, stdout=log
            )
        p.wait_registered(1)
        assert p.kubelet.resources() == [TS]
        publish("..v2", "version: v1\ndefaultMode: nope\n")
        deadline = time.monotonic() + 10
        while "reload rejected" not in p.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "defaultMode" in p.log.read_text()
        assert p.kubelet.resources() == [TS]  # the running config stays
        publish("..v3", "version: v1\ndefaultMode: sm-sharing\n")
        assert p.kubelet.wait_for(lambda: SM in p.kubelet.resources(), 15), p.log.read_text()
        # the retired resource said goodbye with an empty list before its server stopped
        retired = p.kubelet.endpoint(TS)
        assert retired is not None and retired.updates[-1].devices == []
        assert p.terminate() == 0
    finally:
        p.cleanup()


def _daemon_pid(plugin: PluginProcess, gpu: str) -> int:
    return int((plugin.mps_root / gpu / "pipe" / "nvidia-cuda-mps-control.pid").read_text())


def test_mps_daemon_outlives_the_plugin_and_is_adopted(plugin: PluginProcess) -> None:
    plugin.start()
    plugin.wait_registered(2)
    assert plugin.kubelet.wait_for(lambda: len(plugin.kubelet.healthy(SM)) == 139, 20)
    gpu = plugin.kubelet.allocate(SM, 1).annotations["gpu-fraction.dev/gpu"]
    pid = _daemon_pid(plugin, gpu)
    plugin.kill_group()  # what a container restart does to the plugin's processes
    assert pid_alive(pid)
    plugin.start()  # a new plugin adopts the running daemon
    assert plugin.kubelet.wait_for(
        lambda: "adopt" in plugin.log.read_text() and len(plugin.kubelet.healthy(SM)) == 139, 20
    ), plugin.log.read_text()[-2000:]
    assert _daemon_pid(plugin, gpu) == pid and pid_alive(pid)
    assert plugin.terminate() == 0
    assert pid_alive(pid)  # SIGTERM leaves the daemons running too
    stop = subprocess.run(
        [sys.executable, "-m", "deviceplugin", "mps", "stop", "--all", "--force",
         "--mps-root", str(plugin.mps_root), "--state-dir", str(plugin.state),
         "--simulate", plugin.preset],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert "compute mode DEFAULT" in stop.stdout
    deadline = time.monotonic() + 5
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(pid)


def test_health_command_reads_the_running_plugin(
    plugin: PluginProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    from deviceplugin.simulate.inject import inject

    plugin.start()
    plugin.wait_registered(2)
    inject(plugin.state, "1", "xid", 48)
    assert plugin.kubelet.wait_for(lambda: plugin.kubelet.healthy(TS) == [], 10)
    assert main(["health", "--state-dir", str(plugin.state), "--json"]) == 0
    data = capsys.readouterr().out
    assert "xid=48" in data and "gpu" in data
    assert plugin.terminate() == 0


def test_idle_plugin_does_not_spin_on_its_own_config_reads(plugin: PluginProcess) -> None:
    # The config sits beside the plugin's log (every log line is a write in that directory),
    # and reading the config raises inotify "opened" events of its own: neither may wake a loop.
    plugin.start()
    plugin.wait_registered(2)
    for _ in range(3):
        plugin.kubelet.restart()  # writes log lines next to the config
        plugin.wait_registered(2)
    assert plugin.proc is not None
    stat = Path(f"/proc/{plugin.proc.pid}/stat")

    def ticks() -> int:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    before = ticks()
    time.sleep(3)
    spent = ticks() - before
    # a busy loop burns ~300 ticks in 3 s; an idle plugin a handful (probes every second)
    assert spent < 60, spent
    assert "reloaded" not in plugin.log.read_text()
    assert plugin.terminate() == 0


@pytest.mark.parametrize(
    ("cause", "label"),
    [
        ("xid=79 class=reboot", "reboot"),
        ("xid=13 class=application", "application"),
        ("daemon-dead pid=4242", "daemon-dead"),
        ("mps-state=FAULT server=9", "mps-state"),
        ("", "unknown"),
    ],
)
def test_transition_causes_become_bounded_labels(cause: str, label: str) -> None:
    from deviceplugin.daemon.backends import cause_class

    assert cause_class(cause) == label


def test_expected_failures_are_one_line_without_traceback(short_tmp: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "deviceplugin", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    p = PluginProcess(short_tmp)
    bad_address = cli("run", *[a if a != "127.0.0.1:0" else "nonsense" for a in p.args()])
    assert bad_address.returncode == 2
    assert "metrics address 'nonsense'" in bad_address.stderr
    no_state = cli("health", "--state-dir", str(short_tmp / "none"))
    assert no_state.returncode == 1 and "is the plugin running" in no_state.stderr
    no_plugin = cli(
        "simulate", "inject", "--state-dir", str(short_tmp / "none"), "--gpu", "0", "--lost"
    )
    assert no_plugin.returncode == 1 and "no simulated plugin" in no_plugin.stderr
    bad_preset = cli("inventory", "--simulate", "h100x3")
    assert bad_preset.returncode == 2 and "not a preset" in bad_preset.stderr
    for result in (bad_address, no_state, no_plugin, bad_preset):
        assert "Traceback" not in result.stderr


def test_freeze_heap_lets_go_of_what_a_reload_made_garbage() -> None:
    import gc
    import weakref

    from deviceplugin.daemon.startup import freeze_heap

    class Node:
        me: object = None

    a = Node()
    a.me = a  # a cycle: only the collector frees it
    gone = weakref.ref(a)
    try:
        freeze_heap()
        assert gc.get_freeze_count() > 0
        del a
        gc.collect()
        assert gone() is not None  # frozen: out of the collector's sight
        freeze_heap()  # after a reload: unfrozen, collected, then frozen again
        assert gone() is None
    finally:
        gc.unfreeze()
