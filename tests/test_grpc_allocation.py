"""Allocation over real gRPC: the plugin process on h200x8 in all three modes, per strategy."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from deviceplugin._pb import deviceplugin_v1beta1_pb2 as pb
from deviceplugin.cdi.specs import validate_spec
from tests.plugin_proc import PluginProcess

TS, SM, EX = "nvidia.com/gpu-fraction", "nvidia.com/gpu-fraction.sm-sharing", "nvidia.com/gpu"
STRATEGIES = {
    "cdi": "deviceListStrategy: [cdi]\n",
    "envvar": "deviceListStrategy: [envvar]\nenforcement: best-effort\n",
    "device-nodes": "deviceListStrategy: [envvar, device-nodes]\nenforcement: best-effort\n",
}
MODES = """\
version: v1
gpus:
  - match: {index: 0}
    mode: sm-sharing
  - match: {index: 2}
    mode: exclusive
"""


@pytest.fixture(scope="module", params=sorted(STRATEGIES))
def node(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, PluginProcess]]:
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="gf-", dir="/tmp"))
    plugin = PluginProcess(root, preset="h200x8", config=MODES + STRATEGIES[request.param])
    try:
        plugin.start()
        plugin.wait_registered(3)
        assert plugin.kubelet.wait_for(lambda: len(plugin.kubelet.healthy(SM)) == 139, 20)
        yield request.param, plugin
    finally:
        plugin.cleanup()
        shutil.rmtree(root, ignore_errors=True)


def gpu_of(device_id: str) -> str:
    return device_id.split("::")[0]


def preferred(plugin: PluginProcess, resource: str, size: int, must: list[str] = ()) -> list[str]:  # type: ignore[assignment]
    ep = plugin.kubelet.endpoint(resource)
    assert ep is not None
    available = [d for d in plugin.kubelet.healthy(resource) if d not in ep.allocated]
    req = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size
            )
        ]
    )
    return list(ep.stub.GetPreferredAllocation(req, timeout=10).container_responses[0].deviceIDs)


def test_counts_per_resource(node: tuple[str, PluginProcess]) -> None:
    _, plugin = node
    assert len(plugin.kubelet.devices(TS)) == 6 * 139
    assert len(plugin.kubelet.devices(SM)) == 139
    assert [d for d, _, _ in plugin.kubelet.devices(EX)] == [
        d.split("::")[0] for d in [plugin.kubelet.devices(EX)[0][0]]
    ]
    numa = {n for _, _, n in plugin.kubelet.devices(TS)}
    assert numa == {(0,), (1,)}  # every device carries its GPU's NUMA node


def test_preferred_packs_on_one_gpu_and_honours_must_include(
    node: tuple[str, PluginProcess],
) -> None:
    _, plugin = node
    chosen = preferred(plugin, TS, 5)
    assert len(chosen) == 5 and len({gpu_of(d) for d in chosen}) == 1
    other = next(d for d in plugin.kubelet.healthy(TS) if gpu_of(d) != gpu_of(chosen[0]))
    with_must = preferred(plugin, TS, 3, [other])
    assert other in with_must and {gpu_of(d) for d in with_must} == {gpu_of(other)}


def test_allocate_fields_per_mode(node: tuple[str, PluginProcess]) -> None:
    strategy, plugin = node
    ts = plugin.kubelet.allocate(TS, 3)
    sm = plugin.kubelet.allocate(SM, 2)
    ex = plugin.kubelet.allocate(EX, 1)
    ts_gpu, sm_gpu = ts.annotations["gpu-fraction.dev/gpu"], sm.annotations["gpu-fraction.dev/gpu"]
    assert ts.annotations["gpu-fraction.dev/request"] == "3072Mi"
    if strategy == "cdi":
        for resp, gpu in ((ts, ts_gpu), (sm, sm_gpu)):
            names = [c.name for c in resp.cdi_devices]
            assert names[0] == f"nvidia.com/gpu={gpu}" and names[1].startswith(
                "gpu-fraction.dev/gpu="
            )
            assert not resp.envs and not resp.mounts  # everything travels in the CDI edit
            spec = _spec_for(plugin, names[1].split("=", 1)[1])
            assert validate_spec(spec) == []
            env = dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])
            assert "NVIDIA_VISIBLE_DEVICES" not in env  # the driver's spec keeps it `void`
            request = resp.annotations["gpu-fraction.dev/request"].removesuffix("Mi")
            assert env["NVIDIA_GPU_MEMORY_REQUEST"] == request
        ts_spec = _spec_for(plugin, ts.cdi_devices[1].name.split("=", 1)[1])
        hooks = ts_spec["devices"][0]["containerEdits"]["hooks"]
        assert (
            hooks[0]["hookName"] == "createRuntime"
            and "apply-cuda-memory-limits" in hooks[0]["args"]
        )
        assert ts.annotations["gpu-fraction.dev/delivery"] == "cdi-edit"
    else:
        assert ts.envs["NVIDIA_VISIBLE_DEVICES"] == ts_gpu
        assert (ts.envs["NVIDIA_GPU_MEMORY_REQUEST"], ts.envs["NVIDIA_GPU_MEMORY_LIMIT"]) == (
            "3072",
            "3072",
        )
        assert ts.annotations["gpu-fraction.dev/enforcement"] == "none"  # best-effort, recorded
        assert sm.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"
        pipe = str(plugin.mps_root / sm_gpu / "pipe")
        assert sm.envs["CUDA_MPS_PIPE_DIRECTORY"] == pipe  # the daemon's own path string
        assert [(m.host_path, m.container_path) for m in sm.mounts] == [
            (pipe, pipe),
            (str(plugin.mps_root / sm_gpu / "shm"), "/dev/shm"),
        ]
        assert ts.annotations["gpu-fraction.dev/delivery"] == "plain-env"
    specs = [(d.host_path, d.container_path) for d in ts.devices]
    if strategy == "device-nodes":
        assert ("/dev/nvidiactl", "/dev/nvidiactl") in specs
        assert sum(p.startswith("/dev/nvidia") and p[11:].isdigit() for p, _ in specs) == 1
    else:
        assert specs == []
    assert "gpu-fraction.dev/request" not in ex.annotations  # a whole GPU has no caps


def _spec_for(plugin: PluginProcess, name: str) -> dict:  # type: ignore[type-arg]
    for path in plugin.cdi.glob("gpu-fraction.dev-gpu_*.json"):
        spec = json.loads(path.read_text())
        if spec["devices"][0]["name"] == name:
            return spec  # type: ignore[no-any-return]
    raise AssertionError(f"no spec names {name}")


@pytest.mark.parametrize(
    ("resource", "ids", "code"),
    [
        (TS, ["GPU-00000000-0000-0000-0000-000000000000::0"], grpc.StatusCode.INVALID_ARGUMENT),
        (TS, [], grpc.StatusCode.INVALID_ARGUMENT),
        (TS, ["not an id"], grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_refusals_keep_the_plugin_serving(
    node: tuple[str, PluginProcess], resource: str, ids: list[str], code: grpc.StatusCode
) -> None:
    _, plugin = node
    with pytest.raises(grpc.RpcError) as refused:
        plugin.kubelet.allocate_ids(resource, ids)
    assert refused.value.code() is code and refused.value.details()
    assert plugin.kubelet.allocate(TS, 1).annotations["gpu-fraction.dev/mode"] == "time-slicing"


def test_cross_resource_and_spanning_refusals(node: tuple[str, PluginProcess]) -> None:
    _, plugin = node
    sm_id = plugin.kubelet.healthy(SM)[-1]
    with pytest.raises(grpc.RpcError) as foreign:
        plugin.kubelet.allocate_ids(TS, [sm_id])
    assert foreign.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    healthy = plugin.kubelet.healthy(TS)
    a = healthy[-1]
    b = next(d for d in healthy if gpu_of(d) != gpu_of(a))
    with pytest.raises(grpc.RpcError) as spread:
        plugin.kubelet.allocate_ids(TS, [a, b])
    assert spread.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "largest request that fits on one GPU" in spread.value.details()
    assert plugin.kubelet.allocate(TS, 2).annotations["gpu-fraction.dev/mode"] == "time-slicing"
