"""Allocate answers consumed by podman with runc, as a CRI runtime applies them: every mode
under every `deviceListStrategy`. Inside the container: the env as getenv() sees it (caps in
MiB, MPS variables, NVIDIA_VISIBLE_DEVICES), the MPS pipe dir at the daemon's own path and
the daemon's /dev/shm, only its own GPU's device nodes, the memory-limit hook's argv and OCI
state, and the pod's own env against the plugin's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from deviceplugin.cdi import specs as cdi_specs
from deviceplugin.ledger.record import read_records
from deviceplugin.model import Delivery
from deviceplugin.mps import layout
from tests.e2e.conftest import E2E
from tests.e2e.nodes import (
    MODES,
    STRATEGIES,
    VISIBLE,
    DpNode,
    assert_container,
    assert_started,
    config,
    expected_caps,
)
from tests.e2e.runtime import OLDEST_ENGINE_CDI, cdi_args, run_args, version

pytestmark = pytest.mark.e2e


class Nodes:
    """One plugin process per strategy, started on first use, stopped at module end."""

    def __init__(self, e2e: E2E) -> None:
        self.e2e = e2e
        self.started: dict[str, DpNode] = {}

    def __call__(self, strategy: str) -> DpNode:
        if strategy not in self.started:
            plugin = self.e2e.plugin(strategy, config(strategy, str(self.e2e.ctk)))
            node = DpNode(self.e2e, strategy, plugin)
            self.started[strategy] = node
            node.start()
        node = self.started[strategy]
        self.e2e.ns.bind_cdi(node.plugin.cdi)  # this node's specs are what podman reads
        return node


@pytest.fixture(scope="module")
def nodes(e2e: E2E) -> Iterator[Nodes]:
    made = Nodes(e2e)
    try:
        yield made
    finally:
        for node in made.started.values():
            node.plugin.cleanup()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_container_gets_what_the_answer_says(nodes: Nodes, strategy: str, mode: str) -> None:
    node = nodes(strategy)
    answer = node.answer(mode)
    gpu = node.gpu(answer)
    ran = node.e2e.podman.run(run_args(answer))
    assert_container(
        node.e2e,
        ran,
        strategy=strategy,
        mode=mode,
        gpu=gpu,
        mps_root=node.plugin.mps_root,
        caps=expected_caps(mode),
    )


# connect(2) to a unix socket, as an MPS client does to its daemon's `control` (busybox nc
# has no unix sockets); built static so the busybox image runs it.
UCONNECT = r"""
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
int main(int argc, char **argv) {
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    strncpy(addr.sun_path, argv[1], sizeof addr.sun_path - 1);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        perror("connect");
        return 1;
    }
    puts("connected");
    close(fd);
    return 0;
}
"""


@pytest.fixture(scope="module")
def uconnect(e2e: E2E) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc not installed: cannot build the socket client")
    source, binary = e2e.scratch / "uconnect.c", e2e.scratch / "uconnect"
    source.write_text(UCONNECT)
    subprocess.run([gcc, "-static", "-O2", "-o", str(binary), str(source)], check=True)
    return binary


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_root_container_reaches_the_daemon_but_cannot_write_the_pipe_dir(
    nodes: Nodes, strategy: str, uconnect: Path
) -> None:
    """Issue 33: the agent and the daemon read the pipe dir (the pid file); a container gets
    it read-only, which still lets a client connect to the daemon's socket."""
    node = nodes(strategy)
    answer = node.answer("sm-sharing")
    pipe = layout.pipe_dir(node.plugin.mps_root, node.gpu(answer).uuid)
    before = sorted(os.listdir(pipe))
    pid_file = pipe / layout.PID_FILE
    attempts = [
        f"touch {pipe}/planted",
        f"busybox ln -s /dev/zero {pipe}/planted-link",
        f"busybox mkfifo {pipe}/planted-fifo",
        f"mkdir {pipe}/planted-dir",
        f"busybox rm -f {pid_file}",
        f"echo 1 > {pid_file}",
    ]
    script = "".join(f'if {a} 2>/dev/null; then echo "WROTE: {a}"; fi\n' for a in attempts)
    script += f"echo uid=$(busybox id -u)\n/uconnect {pipe}/{layout.CONTROL_SOCKET}\n"
    ran = node.e2e.podman.run(
        [*run_args(answer), "-v", f"{uconnect}:/uconnect:ro"], command=["sh", "-c", script]
    )
    assert ran.rc == 0, (ran.stdout, ran.stderr[-2000:])
    assert "uid=0" in ran.stdout  # root in the container: only the mount stops it
    assert "WROTE" not in ran.stdout, ran.stdout
    assert "connected" in ran.stdout
    assert sorted(os.listdir(pipe)) == before
    assert layout.read_pid(node.plugin.mps_root, node.gpu(answer).uuid) is not None


POD_OVERRIDES = {
    "NVIDIA_GPU_MEMORY_LIMIT": "999999",
    "NVIDIA_GPU_MEMORY_REQUEST": "999999",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=999999M",
    "CUDA_MPS_PIPE_DIRECTORY": "/tmp/elsewhere",
}


@pytest.mark.parametrize("command", [["nvidia-smi", "-L"], ["nvidia-smi"]], ids=["-L", "bare"])
@pytest.mark.parametrize("mode", list(MODES))
def test_nvidia_smi_runs_and_lists_only_the_containers_gpu(
    nodes: Nodes, mode: str, command: list[str]
) -> None:
    """The shipped examples' command, exec'd from the image's PATH as a pod's is: the
    toolkit's spec mounts the driver's nvidia-smi, and it sees the one GPU of the answer."""
    node = nodes("cdi")
    answer = node.answer(mode)
    ran = node.e2e.podman.run(run_args(answer), command)
    assert_started(ran)
    assert ran.stdout.splitlines() == [f"GPU 0: NVIDIA stand-in (minor {node.gpu(answer).minor})"]


def test_nvidia_smi_lists_every_gpu_of_the_toolkits_all_device(nodes: Nodes) -> None:
    """What makes the test above able to fail: the stand-in lists what the container holds."""
    node = nodes("cdi")
    ran = node.e2e.podman.run(cdi_args(["nvidia.com/gpu=all"]), ["nvidia-smi", "-L"])
    assert_started(ran)
    minors = sorted(g.minor for g in node.e2e.spec.gpus)
    assert ran.stdout.splitlines() == [
        f"GPU {n}: NVIDIA stand-in (minor {m})" for n, m in enumerate(minors)
    ]


@pytest.mark.parametrize("mode", ["time-slicing", "sm-sharing"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_pod_env_loses_to_cdi_edits_and_wins_over_plain_env(
    nodes: Nodes, strategy: str, mode: str
) -> None:
    node = nodes(strategy)
    answer = node.answer(mode)
    ran = node.e2e.podman.run(run_args(answer, POD_OVERRIDES))
    assert_started(ran)
    ours = {**expected_caps(mode)}
    if mode == "sm-sharing":
        ours["CUDA_MPS_PIPE_DIRECTORY"] = str(
            layout.pipe_dir(node.plugin.mps_root, node.gpu(answer).uuid)
        )
    got = {name: ran.env.get(name) for name in ours}
    if strategy == "cdi":
        assert got == ours  # CDI edits apply after the pod's env
        return
    assert got == {name: POD_OVERRIDES[name] for name in ours}  # the kubelet appends the pod's
    # ... which the answer and the plugin's record say: delivery by plain env.
    assert answer.annotations["gpu-fraction.dev/delivery"] == Delivery.ENV.value
    gpu = node.gpu(answer).uuid
    records = [r for r in read_records(node.plugin.state) if gpu in r.gpus]
    assert records and {r.delivery for r in records} == {Delivery.ENV}


@pytest.mark.parametrize("mode", ["time-slicing", "sm-sharing"])
def test_visible_devices_do_not_depend_on_cdi_device_order(nodes: Nodes, mode: str) -> None:
    """The toolkit's device and ours, in both orders: the same env, `void` included (a value
    from our device would win in one order and have the legacy hook inject the GPU again)."""
    node = nodes("cdi")
    answer = node.answer(mode)
    names = [d.name for d in answer.cdi_devices]
    assert len(names) == 2, names
    seen = {}
    for order in (names, names[::-1]):
        ran = node.e2e.podman.run(cdi_args(order))
        assert_started(ran)
        seen[tuple(order)] = ran.stable_env()
    assert [env[VISIBLE] for env in seen.values()] == ["void", "void"], seen
    first, second = seen.values()
    assert first == second


def test_every_spec_the_plugin_writes_loads_in_the_oldest_engine(nodes: Nodes) -> None:
    node = nodes("cdi")
    for mode in MODES:
        node.answer(mode)
    specs = sorted(node.plugin.cdi.glob("*.json")) + sorted(node.plugin.cdi.glob("*.yaml"))
    ours = [p for p in specs if p.name.startswith(cdi_specs.SPEC_PREFIX)]
    assert len(ours) == 2, specs  # time-slicing and sm-sharing; whole GPUs need none
    for path in specs:
        spec = cdi_load(path)
        if path in ours:
            assert spec["cdiVersion"] == cdi_specs.required_version(spec)  # the lowest that fits
        assert version(spec["cdiVersion"]) <= version(OLDEST_ENGINE_CDI), path
        names = [f"{spec['kind']}={d['name']}" for d in spec["devices"]]
        ran = node.e2e.podman.run(cdi_args(names), ["true"])
        assert_started(ran)


def test_the_oldest_engine_refuses_a_newer_cdi_version(nodes: Nodes) -> None:
    """What makes the test above able to fail: podman 4.3 refuses a spec above 0.5.0."""
    node = nodes("cdi")
    answer = node.answer("time-slicing")
    path = next(node.plugin.cdi.glob(f"{cdi_specs.SPEC_PREFIX}*.json"))
    spec = cdi_load(path)
    spec["cdiVersion"] = "0.6.0"
    spec["devices"][0]["name"] = "e2e-newer"
    newer = node.plugin.cdi / "e2e-newer.json"
    newer.write_text(json.dumps(spec))
    try:
        ran = node.e2e.podman.run(cdi_args([f"{cdi_specs.KIND}=e2e-newer"]), ["true"])
        assert ran.rc != 0
        assert "unresolvable CDI devices" in ran.stderr, ran.stderr
        assert_started(node.e2e.podman.run(cdi_args(d.name for d in answer.cdi_devices), ["true"]))
    finally:
        newer.unlink()


def cdi_load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())  # JSON is YAML
