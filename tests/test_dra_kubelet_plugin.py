"""DraKubeletPlugin against the package's DRA kubelet simulator, over real unix sockets:
registration (GetInfo, versions, the verdict), prepare/unprepare through v1 and v1beta1, socket
hygiene, and re-registration after a kubelet restart."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from deviceplugin._pb import pluginregistration_v1_pb2 as reg
from deviceplugin._pb import pluginregistration_v1_pb2_grpc as reg_grpc
from deviceplugin.dra.plugin import DRIVER, DraKubeletPlugin, registration_socket
from deviceplugin.dra.prepare import ClaimRef
from deviceplugin.simulate.dra_kubelet import (
    SUPPORTED_SERVICES,
    DraKubeletSimulator,
    KubeletError,
    container_cdi_ids,
    resolve_cdi,
)
from tests.test_dra_prepare import Rig as PrepRig
from tests.test_dra_prepare import claim, result


class Rig:
    def __init__(self, tmp: Path, supported: tuple[str, ...] | None = None) -> None:
        self.prep = PrepRig(tmp)
        self.plugins_dir = tmp / "plugins"
        self.registry_dir = tmp / "registry"
        self.kubelet = DraKubeletSimulator(self.registry_dir, supported or SUPPORTED_SERVICES)
        self.verdicts: list[tuple[bool, str]] = []
        self.plugin = self.make_plugin()

    def make_plugin(self) -> DraKubeletPlugin:
        return DraKubeletPlugin(
            plugins_dir=self.plugins_dir,
            registry_dir=self.registry_dir,
            driver=DRIVER,
            preparer=self.prep.preparer,
            on_registration=lambda ok, error: self.verdicts.append((ok, error)),
        )

    async def until(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        ok = await asyncio.to_thread(self.kubelet.wait_for, predicate, timeout)
        assert ok, "condition not reached"

    async def registered(self, after: int = 0) -> None:
        await asyncio.to_thread(self.kubelet.wait_registered, DRIVER, after)
        await wait_until(lambda: self.plugin.registered)

    def add(self, obj: dict[str, Any]) -> tuple[str, str, str]:
        ref = self.prep.claims.add(obj)
        return (ref.namespace, ref.name, ref.uid)


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


@pytest.fixture
def rig(short_tmp: Path) -> Iterator[Rig]:
    r = Rig(short_tmp)
    r.kubelet.start()
    yield r
    r.kubelet.stop()


def run(rig: Rig, scenario: Callable[[], Awaitable[None]]) -> None:
    async def wrapped() -> None:
        try:
            await scenario()
        finally:
            await rig.plugin.stop()

    asyncio.run(wrapped())


def test_registers_with_the_kubelets_expected_info(rig: Rig) -> None:
    async def scenario() -> None:
        await rig.plugin.start()
        await rig.registered()
        info = rig.kubelet.info[DRIVER]
        assert info.type == "DRAPlugin" and info.name == "gpu-fraction.dev"
        assert info.endpoint == str(rig.plugins_dir / "gpu-fraction.dev" / "dra.sock")
        assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
        plugin = rig.kubelet.plugin(DRIVER)
        assert plugin is not None and plugin.service == "v1.DRAPlugin"
        assert rig.verdicts == [(True, "")]
        assert (rig.registry_dir / "gpu-fraction.dev-reg.sock").is_socket()

    run(rig, scenario)


def test_get_info_answers_fast(rig: Rig) -> None:
    async def scenario() -> None:
        await rig.plugin.start()
        path = rig.registry_dir / "gpu-fraction.dev-reg.sock"
        async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
            stub = reg_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
            info = await stub.GetInfo(reg.InfoRequest(), timeout=1.0)
        assert info.name == DRIVER

    run(rig, scenario)


def test_an_old_kubelet_takes_v1beta1(short_tmp: Path) -> None:
    rig = Rig(short_tmp, supported=("v1beta1.DRAPlugin",))
    rig.kubelet.start()

    async def scenario() -> None:
        await rig.plugin.start()
        await rig.registered()
        plugin = rig.kubelet.plugin(DRIVER)
        assert plugin is not None and plugin.service == "v1beta1.DRAPlugin"
        ref = rig.add(claim("u1", result("gpu-0", "2Gi", share="s-1")))
        answer = (await asyncio.to_thread(rig.kubelet.prepare, DRIVER, [ref]))["u1"]
        assert answer.error == "" and answer.devices[0].device_name == "gpu-0"
        assert not hasattr(answer.devices[0], "share_id")

    try:
        run(rig, scenario)
    finally:
        rig.kubelet.stop()


def test_a_refusal_is_reflected(short_tmp: Path) -> None:
    rig = Rig(short_tmp, supported=("v1alpha4.Node",))
    rig.kubelet.start()

    async def scenario() -> None:
        await rig.plugin.start()
        await wait_until(lambda: bool(rig.verdicts))
        ok, error = rig.verdicts[0]
        assert not ok and "none of services supported by the plugin" in error
        assert not rig.plugin.registered
        with pytest.raises(KubeletError, match="not registered"):
            rig.kubelet.prepare(DRIVER, [("default", "c", "u1")])

    try:
        run(rig, scenario)
    finally:
        rig.kubelet.stop()


def test_prepare_and_unprepare_over_v1_and_v1beta1(rig: Rig) -> None:
    async def scenario() -> None:
        await rig.plugin.start()
        await rig.registered()
        a = rig.add(claim("u1", result("gpu-0", "2Gi", share="s-1")))
        b = rig.add(claim("u2", result("gpu-0", driver="gpu.nvidia.com")))
        out = await asyncio.to_thread(rig.kubelet.prepare, DRIVER, [a, b])
        (dev,) = out["u1"].devices
        assert out["u1"].error == ""
        assert list(dev.request_names) == ["gpu"] and dev.pool_name == "node-a"
        assert dev.HasField("share_id") and dev.share_id == "s-1"
        assert list(dev.cdi_device_ids)[1] == "gpu-fraction.dev/claim=u1-gpu-0-0"
        assert "no device of driver gpu-fraction.dev" in out["u2"].error
        assert not out["u2"].devices
        # the same claim through the old service answers the same devices, without share_id
        again = await asyncio.to_thread(rig.kubelet.prepare, DRIVER, [a], "v1beta1.DRAPlugin")
        assert list(again["u1"].devices[0].cdi_device_ids) == list(dev.cdi_device_ids)
        exclusive = rig.add(claim("u3", result("gpu-2", memory=None, share=None)))
        (ex,) = (await asyncio.to_thread(rig.kubelet.prepare, DRIVER, [exclusive]))["u3"].devices
        assert not ex.HasField("share_id")
        gone = await asyncio.to_thread(rig.kubelet.unprepare, DRIVER, [a, ("default", "x", "u9")])
        assert gone["u1"].error == "" and gone["u9"].error == ""
        assert not (rig.prep.cdi_dir / "gpu-fraction.dev-claim_u1.json").exists()
        empty = await asyncio.to_thread(rig.kubelet.prepare, DRIVER, [])
        assert empty == {}

    run(rig, scenario)


def test_stale_sockets_are_replaced_and_own_removed_on_stop(rig: Rig) -> None:
    async def scenario() -> None:
        for path in (
            rig.plugins_dir / DRIVER / "dra.sock",
            rig.registry_dir / f"{DRIVER}-reg.sock",
        ):
            path.parent.mkdir(parents=True, exist_ok=True)
            stale = socket.socket(socket.AF_UNIX)
            stale.bind(str(path))
            stale.close()  # a socket file nobody listens on, like after a crash
        await rig.plugin.start()
        await rig.registered()
        await rig.plugin.stop()
        await rig.plugin.stop()  # idempotent
        assert not (rig.plugins_dir / DRIVER / "dra.sock").exists()
        assert not (rig.registry_dir / f"{DRIVER}-reg.sock").exists()
        await rig.until(lambda: rig.kubelet.plugin(DRIVER) is None)

    run(rig, scenario)


def test_kubelet_restart_gets_the_registration_socket_back(rig: Rig) -> None:
    async def scenario() -> None:
        await rig.plugin.start()
        await rig.registered()
        for n in range(1, 4):
            await asyncio.to_thread(rig.kubelet.restart)  # registry dir emptied and re-created
            await rig.registered(after=n)
        assert rig.verdicts[-1] == (True, "")
        assert (False, "registration socket removed") in rig.verdicts
        ref = rig.add(claim("u1", result("gpu-0", "1Gi")))
        out = await asyncio.to_thread(rig.kubelet.prepare, DRIVER, [ref])
        assert out["u1"].error == ""

    run(rig, scenario)


def test_socket_files_are_private(rig: Rig) -> None:
    async def scenario() -> None:
        await rig.plugin.start()
        for path in (rig.plugin.dra_socket, rig.plugin.registration_socket):
            assert os.stat(path).st_mode & 0o077 == 0

    run(rig, scenario)


def _driver_spec(rig: Rig) -> None:
    """The toolkit's spec for the rig's GPUs (kind nvidia.com/gpu, one device per UUID)."""
    devices = [
        {"name": gp.uuid, "containerEdits": {"deviceNodes": [{"path": f"/dev/nvidia{n}"}]}}
        for n, gp in enumerate(rig.prep.plan.gpus)
    ]
    spec = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": devices}
    rig.prep.cdi_dir.mkdir(parents=True, exist_ok=True)
    (rig.prep.cdi_dir / "nvidia.yaml").write_text(yaml.safe_dump(spec))


def test_answers_resolve_in_the_runtime_and_never_collide(rig: Rig) -> None:
    async def scenario() -> None:
        _driver_spec(rig)
        await rig.plugin.start()
        await rig.registered()
        refs = [rig.add(claim(f"u{n}", result("gpu-1", "1Gi", share=f"s{n}"))) for n in (1, 2)]
        out = await asyncio.to_thread(rig.kubelet.prepare, DRIVER, refs)
        envs = []
        for uid in ("u1", "u2"):
            ids = list(out[uid].devices[0].cdi_device_ids)
            edits = resolve_cdi(ids, [rig.prep.cdi_dir])
            envs.append([e for edit in edits for e in edit.get("env", [])])
        gpu = rig.prep.plan.gpus[1].uuid
        pipe = f"CUDA_MPS_PIPE_DIRECTORY={rig.prep.tmp / 'mps' / gpu / 'pipe'}"
        assert all(pipe in env for env in envs)
        await asyncio.to_thread(rig.kubelet.unprepare, DRIVER, refs[:1])
        with pytest.raises(KubeletError, match="unresolvable CDI devices"):
            resolve_cdi(list(out["u1"].devices[0].cdi_device_ids), [rig.prep.cdi_dir])

    run(rig, scenario)


def test_a_container_naming_the_request_of_a_first_available_claim_gets_its_devices(
    rig: Rig,
) -> None:
    """The allocation names `gpu/small` (the subrequest the scheduler chose); the container
    names `gpu`, as a pod can only: it must get the claim's CDI devices."""

    async def scenario() -> None:
        await rig.plugin.start()
        await rig.registered()
        ref = rig.add(claim("u1", result("gpu-0", "2Gi", request="gpu/small", share="s1")))
        out = await asyncio.to_thread(rig.kubelet.prepare, DRIVER, [ref])
        assert out["u1"].error == ""
        ids = list(out["u1"].devices[0].cdi_device_ids)
        assert container_cdi_ids(out, [("u1", "gpu")]) == ids
        assert container_cdi_ids(out, [("u1", "")]) == ids  # the whole claim
        assert container_cdi_ids(out, [("u1", "other")]) == []

    run(rig, scenario)


def test_the_runtime_refuses_a_device_two_spec_files_define(tmp_path: Path) -> None:
    spec = {
        "cdiVersion": "0.3.0",
        "kind": "x.dev/a",
        "devices": [{"name": "d", "containerEdits": {}}],
    }
    for name in ("one.json", "two.yaml"):
        (tmp_path / name).write_text(yaml.safe_dump(spec))
    with pytest.raises(KubeletError, match="more than one spec file"):
        resolve_cdi(["x.dev/a=d"], [tmp_path])
    later = tmp_path / "later"
    later.mkdir()
    (later / "one.json").write_text(yaml.safe_dump(spec))
    (tmp_path / "two.yaml").unlink()
    assert resolve_cdi(["x.dev/a=d"], [tmp_path, later]) == [{}, {}]


def test_concurrent_prepares_are_serialised_per_gpu(rig: Rig) -> None:
    """Pods' claims racing for most of one GPU: exactly one gets it, whatever the order; their
    GETs hold no lock and overlap (the upstream helper reads claims before serialising)."""

    async def scenario() -> None:
        await rig.plugin.start()
        await rig.registered()
        big = f"{rig.prep.usable(0) // (1 << 30) - 1}Gi"
        refs = [rig.add(claim(f"u{n}", result("gpu-0", big, share=f"s{n}"))) for n in range(4)]
        inside, most = 0, 0
        lock = threading.Lock()
        read = rig.prep.claims.get_many

        def slow_get(keys: Any) -> Any:
            nonlocal inside, most
            with lock:
                inside += 1
                most = max(most, inside)
            time.sleep(0.2)  # an API round trip: time for a racing call to slip in
            with lock:
                inside -= 1
            return read(keys)

        rig.prep.claims.get_many = slow_get  # type: ignore[method-assign]
        calls = [asyncio.to_thread(rig.kubelet.prepare, DRIVER, [ref]) for ref in refs]
        answers = [out[ref[2]] for out, ref in zip(await asyncio.gather(*calls), refs, strict=True)]
        assert most > 1
        assert sorted(a.error == "" for a in answers) == [False, False, False, True]
        assert all("beyond its capacity" in a.error for a in answers if a.error)

    run(rig, scenario)


# ---- rolling updates ---------------------------------------------------------------------


def test_a_surge_rollout_never_leaves_the_driver_unregistered(short_tmp: Path) -> None:
    """A DaemonSet update with surge: the new pod starts beside the old one, the kubelet
    keeps both and calls the newest, the old one stops; the driver is never unregistered, and
    the two instances take turns over one checkpoint."""
    rig = Rig(short_tmp)
    rig.prep.lock = rig.plugins_dir / DRIVER / "serialize.lock"
    old_preparer = rig.prep.fresh()
    old = DraKubeletPlugin(
        plugins_dir=rig.plugins_dir, registry_dir=rig.registry_dir, driver=DRIVER,
        preparer=old_preparer, on_registration=lambda ok, e: None, instance="uid-old",
    )  # fmt: skip
    new_preparer = rig.prep.fresh()
    new = DraKubeletPlugin(
        plugins_dir=rig.plugins_dir, registry_dir=rig.registry_dir, driver=DRIVER,
        preparer=new_preparer, on_registration=lambda ok, e: None, instance="uid-new",
    )  # fmt: skip
    half = f"{rig.prep.usable(0) // (1 << 30) // 2 + 1}Gi"  # two of them do not fit
    rig.kubelet.start()

    async def scenario() -> None:
        await old.start()
        await asyncio.to_thread(rig.kubelet.wait_registered, DRIVER)
        u1 = rig.add(claim("u1", result("gpu-1", "1Gi", share="s1")))
        assert (await asyncio.to_thread(rig.kubelet.prepare, DRIVER, [u1]))["u1"].error == ""
        await new.start()
        await asyncio.to_thread(rig.kubelet.wait_registered, DRIVER, 1)
        assert rig.kubelet.plugin(DRIVER).endpoint == new.dra_socket  # type: ignore[union-attr]
        assert new.dra_socket.name == "dra-uid-new.sock"
        assert new.registration_socket.name == "gpu-fraction.dev-uid-new-reg.sock"
        # The kubelet may still reach the old one: what it prepares, the new one sees.
        u2 = rig.add(claim("u2", result("gpu-0", half, share="s2")))
        assert (await asyncio.to_thread(old_preparer.prepare, [ClaimRef(*u2)]))["u2"].error is None
        u3 = rig.add(claim("u3", result("gpu-0", half, share="s3")))
        refused = (await asyncio.to_thread(rig.kubelet.prepare, DRIVER, [u3]))["u3"].error
        assert "beyond its capacity" in refused
        await old.stop()  # its own sockets only
        assert new.dra_socket.is_socket() and new.registration_socket.is_socket()
        assert not old.dra_socket.exists() and not old.registration_socket.exists()
        await asyncio.sleep(0.3)  # the kubelet's watcher sees the old socket gone
        assert rig.kubelet.plugin(DRIVER).endpoint == new.dra_socket  # type: ignore[union-attr]
        # Claims the old instance prepared are undone by the new one.
        done = await asyncio.to_thread(rig.kubelet.unprepare, DRIVER, [u1, u2])
        assert all(d.error == "" for d in done.values())
        assert new_preparer.prepared() == [] and new_preparer.reloads >= 1
        assert rig.kubelet.gaps(DRIVER) == 0
        assert max(n for _, _, n in rig.kubelet.instances) == 2

    async def wrapped() -> None:
        try:
            await scenario()
        finally:
            await old.stop()
            await new.stop()

    try:
        asyncio.run(wrapped())
    finally:
        rig.kubelet.stop()


def test_an_instance_id_that_is_no_pod_uid_is_refused_at_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from deviceplugin.cli import main

    assert main(["run", "--dra-instance", "../../etc/x"]) == 2
    assert "--dra-instance" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not a pod UID"):
        registration_socket(Path("/r"), DRIVER, "A B")
    uid = "3f2a9c1e-8b7d-4e6f-9a0b-1c2d3e4f5a6b"
    assert registration_socket(Path("/r"), DRIVER, uid).name == f"{DRIVER}-{uid}-reg.sock"
