"""The plugin's gRPC servers against the embedded kubelet, over real unix sockets."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest

from deviceplugin.dpapi.allocator import MpsNotReady
from deviceplugin.dpapi.answers import GrantLike
from deviceplugin.dpapi.feed import DeviceFeed
from deviceplugin.dpapi.registry import PluginSet
from deviceplugin.dpapi.server import DevicePluginService
from deviceplugin.health.board import HealthBoard
from deviceplugin.model import FaultDomain, GpuUuid, Mode, SliceId
from deviceplugin.simulate.kubelet import KubeletSimulator, is_extended_resource_name
from tests.planfixtures import RESOURCES, small_plan

TS = RESOURCES[Mode.TIME_SLICING]
SM = RESOURCES[Mode.SM_SHARING]


class Shape:
    def __init__(self, ids: Sequence[str]) -> None:
        self.envs = {"IDS": ",".join(ids)}
        self.mounts: list[tuple[str, str, bool]] = []
        self.device_specs: list[tuple[str, str, str]] = []
        self.annotations: dict[str, str] = {}
        self.driver_devices: list[str] = []


class Grant:
    def __init__(self, ids: Sequence[str]) -> None:
        self.shape = Shape(ids)
        self.own_device: str | None = None


class EchoBackend:
    """Stands in for the allocator: the gRPC layer's own behaviour is under test here."""

    def preferred(
        self, resource: str, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str]:
        chosen = list(must_include)
        chosen += [d for d in available if d not in chosen][: size - len(chosen)]
        return chosen

    def allocate(self, resource: str, device_ids: Sequence[str]) -> GrantLike:
        return Grant(device_ids)

    def wait_mps(self, gpu: GpuUuid, timeout: float) -> bool:
        return True


class Rig:
    def __init__(self, tmp: Path) -> None:
        self.dir = tmp / "device-plugins"
        self.kubelet = KubeletSimulator(self.dir)
        self.plan = small_plan(Mode.TIME_SLICING, Mode.SM_SHARING)
        self.board = HealthBoard()
        self.feed = DeviceFeed(lambda: self.plan, self.board, lambda r: set[SliceId]())

    def plugins(self, instance: str = "a") -> PluginSet:
        return PluginSet(
            self.dir,
            instance,
            lambda r: DevicePluginService(r, self.feed, EchoBackend()),
        )

    async def until(self, predicate: object, timeout: float = 10.0) -> None:
        ok = await asyncio.to_thread(self.kubelet.wait_for, predicate, timeout)  # type: ignore[arg-type]
        assert ok, "condition not reached"


@pytest.fixture
def rig(short_tmp: Path) -> Rig:
    r = Rig(short_tmp)
    r.kubelet.start()
    yield r  # type: ignore[misc]
    r.kubelet.stop()


def test_resource_name_rules() -> None:
    assert is_extended_resource_name("nvidia.com/gpu-fraction.sm-sharing")
    for bad in ("gpu", "kubernetes.io/gpu", "foo.kubernetes.io/x", "requests.a/b", "Nv.com/x"):
        assert not is_extended_resource_name(bad)


def test_register_lists_devices_and_serves(rig: Rig) -> None:
    async def scenario() -> None:
        plugins = rig.plugins()
        await plugins.start([TS, SM])
        await rig.until(lambda: rig.kubelet.resources() == sorted([TS, SM]))
        assert len(rig.kubelet.devices(TS)) == 4
        ids, health, numa = rig.kubelet.devices(SM)[0]
        assert ids.endswith("::0") and health == "Healthy" and numa == (1,)
        ep = rig.kubelet.endpoint(TS)
        assert ep is not None
        assert ep.options.get_preferred_allocation_available and not ep.options.pre_start_required
        resp = await asyncio.to_thread(rig.kubelet.allocate, TS, 2)
        assert resp.envs["IDS"].count("::") == 2
        await plugins.stop()
        assert not [p for p in rig.dir.iterdir() if p.name.startswith("gfp-")]

    asyncio.run(scenario())


def test_health_change_is_one_full_update(rig: Rig) -> None:
    async def scenario() -> None:
        plugins = rig.plugins()
        await plugins.start([TS, SM])
        await rig.until(lambda: len(rig.kubelet.resources()) == 2)
        sm_gpu = rig.plan.gpus[1].uuid
        rig.board.set(sm_gpu, FaultDomain.MPS_SERVER, "mps-state=FAULT")
        await rig.until(lambda: rig.kubelet.healthy(SM) == [])
        ep_sm, ep_ts = rig.kubelet.endpoint(SM), rig.kubelet.endpoint(TS)
        assert ep_sm is not None and ep_ts is not None
        assert len(ep_sm.updates) == 2  # the first list, then one update for all four slices
        assert len(ep_ts.updates) == 1  # another resource's fault sends nothing here
        rig.board.clear(sm_gpu, FaultDomain.MPS_SERVER)
        await rig.until(lambda: len(rig.kubelet.healthy(SM)) == 4)
        await plugins.stop()

    asyncio.run(scenario())


def test_twenty_kubelet_restarts_reregister_without_leaks(rig: Rig) -> None:
    async def scenario() -> None:
        plugins = rig.plugins()
        await plugins.start([TS, SM])
        await rig.until(lambda: len(rig.kubelet.resources()) == 2)
        threads_before = 0
        for n in range(20):
            await asyncio.to_thread(rig.kubelet.restart)
            await rig.until(lambda: len(rig.kubelet.resources()) == 2)
            assert (rig.dir / "kubelet.sock").exists(), n
            if n == 4:  # pools have warmed up; from here on, restarts must not add threads
                threads_before = threading.active_count()
        # one socket per resource, fresh each time; no worker left behind per restart
        socks = sorted(p.name for p in rig.dir.iterdir() if p.name.startswith("gfp-"))
        assert len(socks) == 2
        generations = [int(s.rsplit("-", 1)[1].removesuffix(".sock")) for s in socks]
        assert all(21 <= g <= 41 for g in generations), generations
        leaked = threading.active_count() - threads_before
        assert leaked <= 1, [t.name for t in threading.enumerate()]
        await plugins.stop()

    asyncio.run(scenario())


def test_refused_registration_is_retried(rig: Rig) -> None:
    rig.kubelet.refuse_next = 2

    async def scenario() -> None:
        plugins = rig.plugins()
        await plugins.start([TS])
        # the kubelet records a registration before the plugin's Register call returns
        await rig.until(lambda: rig.kubelet.resources() == [TS] and plugins.all_registered())
        assert len(rig.kubelet.registrations) == 1
        await plugins.stop()

    asyncio.run(scenario())


def test_ready_means_every_planned_resource_registered_including_none(rig: Rig) -> None:
    rig.kubelet.refuse_next = 1

    async def scenario() -> None:
        plugins = rig.plugins()
        assert not plugins.all_registered()  # before the first sync nothing is known
        await plugins.start([TS])
        assert not plugins.all_registered()  # the refused Register waits for its retry
        # the kubelet records the resource while its Register call is still returning
        await rig.until(lambda: rig.kubelet.resources() == [TS] and plugins.all_registered())
        await plugins.sync([])  # a plan that serves nothing: ready, not stalled
        assert plugins.all_registered() and plugins.resources == []
        await plugins.stop()

    asyncio.run(scenario())


def test_a_stream_the_kubelet_closes_is_registered_again(rig: Rig) -> None:
    async def scenario() -> None:
        first = rig.plugins("one")
        await first.start([TS])
        await rig.until(lambda: rig.kubelet.resources() == [TS])
        ep = rig.kubelet.endpoint(TS)
        assert ep is not None
        ep.stream.cancel()  # the kubelet drops our client (and with it every device)
        await rig.until(
            lambda: rig.kubelet.endpoint(TS) is not ep and len(rig.kubelet.healthy(TS)) == 4
        )
        again = rig.kubelet.endpoint(TS)
        assert again is not None and again.socket == ep.socket  # the same server, registered anew
        await first.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize("reregister", [True, False], ids=["registers-again", "without-the-fix"])
def test_rolling_update_old_instance_leaving_keeps_the_new_one_served(
    rig: Rig, reregister: bool
) -> None:
    """Kubelet 1.36: when the old pod's stream ends after the new pod registered, the kubelet
    disconnects the new pod's client; the new instance must register again."""

    async def scenario() -> None:
        old, new = rig.plugins("one"), rig.plugins("two")
        if not reregister:
            new.reregister_after = 3600.0
        await old.start([TS])
        await rig.until(lambda: len(rig.kubelet.healthy(TS)) == 4)
        await new.start([TS])
        await rig.until(lambda: "-two-" in str(getattr(rig.kubelet.endpoint(TS), "socket", "")))
        await old.stop()  # the old pod goes; the kubelet drops the newest client
        await rig.until(lambda: rig.kubelet.disconnects != [])
        assert "-two-" in rig.kubelet.disconnects[-1][2]
        served = await asyncio.to_thread(
            rig.kubelet.wait_for, lambda: len(rig.kubelet.healthy(TS)) == 4, 5.0
        )
        assert served is reregister
        # the old instance's socket is gone, the new one still answers on its own
        ep = rig.kubelet.endpoint(TS)
        if reregister:
            assert ep is not None and "-two-" in ep.socket.name
        await new.stop()

    asyncio.run(scenario())


def test_prestart_answers_though_not_required(rig: Rig) -> None:
    from deviceplugin._pb import deviceplugin_v1beta1_pb2 as pb

    async def scenario() -> None:
        plugins = rig.plugins()
        await plugins.start([TS])
        await rig.until(lambda: rig.kubelet.resources() == [TS])
        ep = rig.kubelet.endpoint(TS)
        assert ep is not None and not ep.options.pre_start_required
        request = pb.PreStartContainerRequest(devices_ids=[rig.kubelet.devices(TS)[0][0]])
        answer = await asyncio.to_thread(ep.stub.PreStartContainer, request, timeout=5)
        assert answer == pb.PreStartContainerResponse()
        await plugins.stop()

    asyncio.run(scenario())


def test_a_storm_is_coalesced_and_ends_in_the_final_state(rig: Rig) -> None:
    async def scenario() -> None:
        plugins = rig.plugins()
        await plugins.start([TS, SM])
        await rig.until(lambda: len(rig.kubelet.resources()) == 2)
        ts_gpu = rig.plan.gpus[0].uuid
        started = asyncio.get_running_loop().time()
        for n in range(1000):  # 1,000 fault flips within about a second
            if n % 2 == 0:
                rig.board.set(ts_gpu, FaultDomain.GPU, f"xid={n}")
            else:
                rig.board.clear(ts_gpu, FaultDomain.GPU)
            if n % 50 == 0:
                await asyncio.sleep(0.05)
        rig.board.set(ts_gpu, FaultDomain.GPU, "xid=79 class=reboot")  # the final state
        elapsed = asyncio.get_running_loop().time() - started
        await rig.until(lambda: rig.kubelet.healthy(TS) == [])
        await asyncio.sleep(0.5)  # anything still queued would arrive now
        ep = rig.kubelet.endpoint(TS)
        assert ep is not None
        updates = ep.updates[1:]  # after the first full list
        assert [h for _, h, _ in updates[-1].devices] == ["Unhealthy"] * 4
        # at most 5 a second (+1 for the window the storm started in)
        assert len(updates) <= 5 * (elapsed + 0.5) + 1, (len(updates), elapsed)
        gaps = [b.at - a.at for a, b in itertools.pairwise(updates)]
        assert all(g >= 0.15 for g in gaps), gaps  # 200 ms apart, less scheduling jitter
        sm_ep = rig.kubelet.endpoint(SM)
        assert sm_ep is not None and len(sm_ep.updates) == 1  # the other resource saw nothing
        await plugins.stop()

    asyncio.run(scenario())


class StartingMpsBackend(EchoBackend):
    """The GPU's MPS daemon is still starting on the first call."""

    def __init__(self, comes_up: bool) -> None:
        self.comes_up = comes_up
        self.calls = 0
        self.waited: list[float] = []

    def allocate(self, resource: str, device_ids: Sequence[str]) -> GrantLike:
        self.calls += 1
        if self.calls == 1 or not self.comes_up:
            raise MpsNotReady(GpuUuid("GPU-starting"))
        return Grant(device_ids)

    def wait_mps(self, gpu: GpuUuid, timeout: float) -> bool:
        self.waited.append(timeout)
        return self.comes_up


@pytest.mark.parametrize("comes_up", [True, False])
def test_allocate_waits_for_a_starting_mps_daemon(rig: Rig, comes_up: bool) -> None:
    backend = StartingMpsBackend(comes_up)

    async def scenario() -> None:
        plugins = PluginSet(rig.dir, "mps", lambda r: DevicePluginService(r, rig.feed, backend))
        await plugins.start([SM])
        await rig.until(lambda: rig.kubelet.resources() == [SM])
        if comes_up:
            resp = await asyncio.to_thread(rig.kubelet.allocate, SM, 1)
            assert resp.envs["IDS"].endswith("::0") and backend.calls == 2
        else:
            with pytest.raises(grpc.RpcError) as refused:
                await asyncio.to_thread(rig.kubelet.allocate, SM, 1)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            assert "not ready" in refused.value.details()
        assert len(backend.waited) == 1 and backend.waited[0] > 0
        await plugins.stop()

    asyncio.run(scenario())


def test_a_missed_inotify_event_is_caught_by_the_audit(rig: Rig) -> None:
    async def scenario() -> None:
        plugins = rig.plugins()
        plugins.audit_interval = 0.2
        await plugins.start([TS])
        await rig.until(lambda: rig.kubelet.resources() == [TS])
        assert plugins._watch is not None
        plugins._watch.stop()  # inotify gone blind (e.g. the directory was re-mounted)
        first = len(rig.kubelet.registrations)
        await asyncio.to_thread(rig.kubelet.restart)
        await rig.until(
            lambda: len(rig.kubelet.registrations) > first and rig.kubelet.resources() == [TS]
        )
        await plugins.stop()

    asyncio.run(scenario())
