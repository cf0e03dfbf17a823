"""A GPU Operator node under podman with runc: the toolkit container wrote only the
management spec, the driver lives under /run/nvidia/driver, and the plugin generates its own
per-GPU driver devices. Containers started from its Allocate and NodePrepareResources
answers get their GPU's device node and the driver's libraries from the driver root, and are
checked like every other container under `cdi`."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from deviceplugin.cdi import generated
from deviceplugin.simulate.apiserver import FakeApiServer
from deviceplugin.simulate.ctk import spec_document
from deviceplugin.simulate.specs import LAYOUT_GPU_OPERATOR, OPERATOR_DRIVER_ROOT
from tests.e2e.conftest import E2E
from tests.e2e.nodes import MODES, DpNode, assert_container, config, expected_caps
from tests.e2e.runtime import cdi_args, run_args
from tests.e2e.test_dra_runtime import CLAIMS
from tests.test_dra_prepare_process import NODE, Node, result

pytestmark = pytest.mark.e2e


def operator_spec(e2e: E2E) -> str:
    """The suite's node (same GPUs and UUIDs) as a GPU Operator node, as a spec file."""
    spec = dataclasses.replace(e2e.spec, layout=LAYOUT_GPU_OPERATOR)
    path = e2e.scratch / "operator-node.yaml"
    path.write_text(yaml.safe_dump(spec_document(spec)))
    return str(path)


def operator_config(e2e: E2E, api: str = "device-plugin") -> str:
    return config("cdi", str(e2e.ctk), api=api, driver_root=OPERATOR_DRIVER_ROOT)


@pytest.fixture(scope="module")
def dp(e2e: E2E) -> Iterator[DpNode]:
    plugin = e2e.plugin("operator-dp", operator_config(e2e), preset=operator_spec(e2e))
    node = DpNode(e2e, "cdi", plugin)
    try:
        node.start()
        yield node
    finally:
        plugin.cleanup()


@pytest.mark.parametrize("mode", list(MODES))
def test_operator_container_gets_its_gpu_from_allocate(e2e: E2E, dp: DpNode, mode: str) -> None:
    e2e.ns.bind_cdi(dp.plugin.cdi)
    answer = dp.answer(mode)
    gpu = dp.gpu(answer)
    assert answer.cdi_devices[0].name == f"{generated.KIND}={gpu.uuid}"
    assert not (dp.plugin.cdi / "nvidia.yaml").exists()  # no toolkit per-GPU spec here
    ran = e2e.podman.run(run_args(answer))
    assert_container(
        e2e,
        ran,
        strategy="cdi",
        mode=mode,
        gpu=gpu,
        mps_root=dp.plugin.mps_root,
        caps=expected_caps(mode),
        driver_root=OPERATOR_DRIVER_ROOT,
    )


@pytest.fixture(scope="module")
def dra(e2e: E2E) -> Iterator[Node]:
    api = FakeApiServer().start()
    api.add_node(NODE)
    plugin = e2e.plugin("operator-dra", operator_config(e2e, "dra"), preset=operator_spec(e2e))
    plugin.dra_kubelet.start()
    try:
        node = Node(api, plugin, api.write_kubeconfig(plugin.root / "kubeconfig"))
        node.start()
        yield node
    finally:
        plugin.cleanup()
        api.stop()


@pytest.mark.parametrize("mode", list(CLAIMS))
def test_operator_container_gets_its_gpu_from_prepare(e2e: E2E, dra: Node, mode: str) -> None:
    e2e.ns.bind_cdi(dra.plugin.cdi)
    device, memory, mib = CLAIMS[mode]
    share = None if memory is None else f"share-{mode}"
    ref = dra.claim(f"claim-{mode}", result(device, memory, share))
    answer: Any = dra.prepare(ref)[ref[2]]
    assert answer.error == "", answer.error
    ids = [i for d in answer.devices for i in d.cdi_device_ids]
    kind, _, uuid = ids[0].partition("=")
    assert kind == generated.KIND
    gpu = e2e.spec.gpu(uuid)
    ran = e2e.podman.run(cdi_args(ids))
    assert_container(
        e2e,
        ran,
        strategy="cdi",
        mode=mode,
        gpu=gpu,
        mps_root=dra.plugin.mps_root,
        caps=expected_caps(mode, mib),
        driver_root=OPERATOR_DRIVER_ROOT,
    )
