"""NodePrepareResources answers consumed by podman with runc: a time-slicing, an sm-sharing
and an exclusive claim, prepared through the package's DRA kubelet simulator against the
in-test API server; each container gets the claim's CDI devices as `--device`, as a
CDI-enabled runtime does, and is checked like a device-plugin container under `cdi`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

from deviceplugin.cdi import specs as cdi_specs
from deviceplugin.simulate.apiserver import FakeApiServer
from tests.e2e.conftest import E2E
from tests.e2e.nodes import assert_container, config, expected_caps
from tests.e2e.runtime import OLDEST_ENGINE_CDI, cdi_args, version
from tests.test_dra_prepare_process import NODE, Node, result

pytestmark = pytest.mark.e2e
CLAIMS = {  # mode → (device, consumed memory, MiB)
    "time-slicing": ("gpu-0", "4Gi", 4096),
    "sm-sharing": ("gpu-1", "2Gi", 2048),
    "exclusive": ("gpu-2", None, None),
}


@pytest.fixture(scope="module")
def dra(e2e: E2E) -> Iterator[Node]:
    api = FakeApiServer().start()
    api.add_node(NODE)
    plugin = e2e.plugin("dra", config("cdi", str(e2e.ctk), api="dra"))
    plugin.dra_kubelet.start()
    try:
        node = Node(api, plugin, api.write_kubeconfig(plugin.root / "kubeconfig"))
        node.start()
        yield node
    finally:
        plugin.cleanup()
        api.stop()


def prepared(dra: Node, mode: str) -> tuple[str, Any]:
    """The claim's UID and the kubelet's NodePrepareResources answer for it."""
    device, memory, _ = CLAIMS[mode]
    share = None if memory is None else f"share-{mode}"
    ref = dra.claim(f"claim-{mode}", result(device, memory, share))
    answer = dra.prepare(ref)[ref[2]]
    assert answer.error == "", answer.error
    return ref[2], answer


Claims = Callable[[str], tuple[str, Any]]


@pytest.fixture(scope="module")
def claims(dra: Node) -> Claims:
    """Each mode's claim, created and prepared once, however many tests start containers
    from it (as the kubelet prepares a claim once for all of a pod's containers)."""
    done: dict[str, tuple[str, Any]] = {}

    def get(mode: str) -> tuple[str, Any]:
        if mode not in done:
            done[mode] = prepared(dra, mode)
        return done[mode]

    return get


@pytest.mark.parametrize("mode", list(CLAIMS))
def test_claim_container_gets_what_the_answer_says(
    e2e: E2E, dra: Node, claims: Claims, mode: str
) -> None:
    e2e.ns.bind_cdi(dra.plugin.cdi)
    uid, answer = claims(mode)
    ids = [i for d in answer.devices for i in d.cdi_device_ids]
    gpu = e2e.spec.gpu(ids[0].split("=", 1)[1])  # the toolkit's device names the GPU
    assert gpu.index == int(CLAIMS[mode][0].removeprefix("gpu-"))
    ran = e2e.podman.run(cdi_args(ids))
    assert_container(
        e2e,
        ran,
        strategy="cdi",
        mode=mode,
        gpu=gpu,
        mps_root=dra.plugin.mps_root,
        caps=expected_caps(mode, CLAIMS[mode][2]),
    )
    path = cdi_specs.claim_spec_path(dra.plugin.cdi, uid)
    assert path.exists() == (mode != "exclusive")  # a whole GPU needs the toolkit's alone
    if path.exists():  # what podman just loaded: the lowest version its fields need
        spec = yaml.safe_load(path.read_text())
        assert spec["cdiVersion"] == cdi_specs.required_version(spec), spec["cdiVersion"]
        assert version(spec["cdiVersion"]) <= version(OLDEST_ENGINE_CDI)


@pytest.mark.parametrize("mode", list(CLAIMS))
def test_claim_container_runs_nvidia_smi_on_its_gpu(
    e2e: E2E, dra: Node, claims: Claims, mode: str
) -> None:
    """The DRA examples' command, exec'd from the image's PATH: the claim's GPU alone."""
    e2e.ns.bind_cdi(dra.plugin.cdi)
    _, answer = claims(mode)
    ids = [i for d in answer.devices for i in d.cdi_device_ids]
    gpu = e2e.spec.gpu(ids[0].split("=", 1)[1])
    for command in (["nvidia-smi", "-L"], ["nvidia-smi"]):
        ran = e2e.podman.run(cdi_args(ids), command)
        assert ran.rc == 0, (command, ran.stderr[-2000:])
        assert ran.stdout.splitlines() == [f"GPU 0: NVIDIA stand-in (minor {gpu.minor})"]
