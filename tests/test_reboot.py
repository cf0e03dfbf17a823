"""Answers survive a reboot (DESIGN 3b): the kubelet replays checkpointed Allocate answers
without calling Allocate, `/var/run/cdi` is a tmpfs and the MPS root is emptied. The real
plugin process and the kubelet simulator: allocations in every mode, then the node
"reboots" (plugin process group and MPS daemons killed, CDI dir and MPS root emptied, a
fresh kubelet); at the first Register every earlier answer must resolve again and the
sm-sharing GPU's daemon must serve a client wired from that answer alone."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.cdi.registry import Resolved, UnresolvableDevice, resolve
from deviceplugin.ledger.record import read_records
from deviceplugin.simulate.cdi import binary_paths, library_paths
from deviceplugin.simulate.kubelet import KubeletSimulator
from deviceplugin.simulate.specs import load_spec
from tests.conftest import MakePlugin
from tests.fakes.podresources import Assigned, FakePodResources
from tests.plugin_proc import reboot

ROOT = Path(__file__).resolve().parent.parent
TS = "nvidia.com/gpu-fraction"
SM = "nvidia.com/gpu-fraction.sm-sharing"
EX = "nvidia.com/gpu"
CONFIG = """\
version: v1
gpus:
  - {match: {index: 0}, mode: time-slicing}
  - {match: {index: 1}, mode: sm-sharing}
  - {match: {index: 2}, mode: exclusive}
  - {match: {index: 3}, mode: exclusive}
"""

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces need root")


def mps_client(resolved: Resolved) -> subprocess.CompletedProcess[str]:
    """The simulated MPS client as a container started from `resolved` alone would run."""
    import tempfile

    from deviceplugin.simulate import pod

    argv = [sys.executable, "-m", "deviceplugin.simulate.mps_client"]
    # Less the driver's files the toolkit's spec mounts: the simulated driver has them only in
    # the runtime suites' namespaces (tests/e2e), and the client needs only the MPS mounts.
    spec = load_spec("mixed")
    driver = {*library_paths(spec), *binary_paths(spec)}
    mounts = [(m["hostPath"], m["containerPath"]) for m in resolved.mounts]
    assert driver <= {host for host, _ in mounts}, mounts  # what a real node's runtime binds
    mounts = [(host, ctr) for host, ctr in mounts if host not in driver]
    view = pod.PodView(dict(resolved.env), mounts)
    env = {**pod.container_env(view), "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory(dir="/tmp") as stage:
        return subprocess.run(
            pod.container_argv(view, argv, Path(stage)),
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )


@needs_root
def test_every_answer_resolves_again_before_the_first_register(make_plugin: MakePlugin) -> None:
    plugin = make_plugin(CONFIG, preset="mixed")
    pods = FakePodResources(plugin.root / "pr.sock").start()
    try:
        plugin.start()
        plugin.wait_registered(3)
        assert plugin.kubelet.wait_for(lambda: bool(plugin.kubelet.healthy(SM)), 30)
        answers: dict[str, Any] = {}
        listed: list[Assigned] = []
        for n, (resource, count) in enumerate(((TS, 2), (SM, 1), (EX, 1))):
            answers[resource] = plugin.kubelet.allocate(resource, count)
            ids = tuple(plugin.kubelet.last_allocated)
            listed.append(Assigned("ns", f"pod-{n}", "c", resource, ids))
        pods.set(*listed)
        calls = pods.calls
        assert plugin.kubelet.wait_for(lambda: pods.calls >= calls + 2, 30)  # owners learned
        # Replays name what the plugin answered, in the order the runtime was given it.
        names = {r: [d.name for d in a.cdi_devices] for r, a in answers.items()}
        assert all(names.values()), names
        before = {r: resolve([plugin.cdi], n) for r, n in names.items()}
        served = mps_client(before[SM])
        assert served.returncode == 0, served.stderr  # the check can pass on a live node
        gpus = sorted({a.annotations["gpu-fraction.dev/gpu"] for a in answers.values()})

        reboot(plugin, gpus)
        pods.set()  # the kubelet is still restoring its pods: it lists none yet
        with pytest.raises(UnresolvableDevice):
            resolve([plugin.cdi], names[TS])  # the tmpfs is empty now

        seen: dict[str, Any] = {}
        lock = threading.Lock()

        def at_first_register(resource: str) -> None:
            with lock:
                if seen:
                    return
                seen["resource"] = resource
                for r, n in names.items():
                    try:
                        seen[r] = resolve([plugin.cdi], n)
                    except UnresolvableDevice as err:
                        seen[r] = str(err)
                if isinstance(seen[SM], Resolved):
                    seen["client"] = mps_client(seen[SM])

        plugin.kubelet = KubeletSimulator(plugin.kubelet_dir)
        plugin.kubelet.before_register = at_first_register
        plugin.start()
        plugin.wait_registered(3, timeout=60)
        for resource in answers:
            assert seen[resource] == before[resource], (resource, seen[resource])
        client = seen["client"]
        assert client.returncode == 0, (client.returncode, client.stderr)
        # Lists taken while the kubelet restores its pods remove nothing (the first minute).
        calls = pods.calls
        assert plugin.kubelet.wait_for(lambda: pods.calls >= calls + 2, 30)
        assert {r.resource for r in read_records(plugin.state)} == set(answers)
        assert all(resolve([plugin.cdi], n) == before[r] for r, n in names.items())
    finally:
        pods.stop()
