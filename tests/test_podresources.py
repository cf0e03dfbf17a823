"""Pod-resources client and poller against a real gRPC server on a unix socket.

The ledger is the real one on tmp_path; CDI spec files are plain files it must delete only
after pod-resources stops listing their allocation.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deviceplugin._pb import podresources_v1_pb2 as pb
from deviceplugin.dpapi.podresources import (
    ContainerDevices,
    PodResourcesClient,
    PodResourcesError,
    PodResourcesPoller,
)
from deviceplugin.ledger.record import AllocationRecord
from deviceplugin.ledger.store import Ledger
from deviceplugin.model import Delivery, Enforcement, GpuUuid, Mode, SliceId, slice_id
from tests.fakes.podresources import Assigned, FakePodResources

TS = "nvidia.com/gpu-fraction"
GPU = GpuUuid("GPU-aaaa")


@pytest.fixture
def kubelet(short_tmp: Path) -> Iterator[FakePodResources]:
    fake = FakePodResources(short_tmp / "pr.sock").start()
    yield fake
    fake.stop()


def ids(*n: int) -> tuple[SliceId, ...]:
    return tuple(slice_id(GPU, i) for i in n)


def record(tmp: Path, *n: int, created: float = 0.0) -> AllocationRecord:
    spec = tmp / f"spec-{'-'.join(map(str, n))}.json"
    spec.write_text("{}")
    return AllocationRecord(
        device_ids=tuple(sorted(ids(*n))),
        resource=TS,
        gpus=(GPU,),
        mode=Mode.TIME_SLICING,
        request_mib=1024 * len(n),
        limit_mib=1024 * len(n),
        enforcement=(Enforcement.CUDA_MEMORY_LIMITS,),
        delivery=Delivery.CDI,
        ceiling_source=None,
        ceiling_policy=None,
        cdi_spec=str(spec),
        created=created,
    )


def test_list_maps_containers_to_devices(kubelet: FakePodResources) -> None:
    kubelet.set(
        Assigned("ns", "web", "app", TS, ids(0, 1)),
        Assigned("ns", "web", "app", "example.com/other", ("x",)),
        Assigned("ns", "job", "init", TS, ids(2)),
    )
    client = PodResourcesClient(str(kubelet.socket_path))
    try:
        got = client.list(frozenset({TS}))
    finally:
        client.close()
    assert sorted(got, key=lambda c: c.pod) == [
        ContainerDevices("ns", "job", "init", TS, frozenset(ids(2))),  # type: ignore[arg-type]
        ContainerDevices("ns", "web", "app", TS, frozenset(ids(0, 1))),  # type: ignore[arg-type]
    ]


def test_devices_listed_one_by_one_make_one_allocation(kubelet: FakePodResources) -> None:
    """The real kubelet answers `List` with an entry per device (and per NUMA node of a
    device that names several): a 4-slice Allocate comes back as 4 entries, and it is the
    union per container and resource that matches the ledger's record."""
    kubelet.set(Assigned("ns", "web", "app", TS, ids(0, 1, 2, 3)))
    client = PodResourcesClient(str(kubelet.socket_path))
    try:
        raw = client._connect().List(pb.ListPodResourcesRequest(), timeout=5)
        entries = raw.pod_resources[0].containers[0].devices
        assert [list(e.device_ids) for e in entries] == [[d] for d in ids(0, 1, 2, 3)]
        with kubelet.lock:  # a device listed under two NUMA nodes
            kubelet.pods.append(Assigned("ns", "web", "app", TS, ids(3)))
        got = client.list()
    finally:
        client.close()
    assert got == [ContainerDevices("ns", "web", "app", TS, frozenset(ids(0, 1, 2, 3)))]  # type: ignore[arg-type]


def test_list_failure_is_a_typed_error(kubelet: FakePodResources, short_tmp: Path) -> None:
    kubelet.fail = True
    client = PodResourcesClient(str(kubelet.socket_path), timeout=2.0)
    with pytest.raises(PodResourcesError):
        client.list()
    missing = PodResourcesClient(str(short_tmp / "absent.sock"), timeout=0.5)
    with pytest.raises(PodResourcesError):
        missing.list()
    client.close()
    missing.close()


def test_files_removed_only_after_pod_resources_stops_listing(
    kubelet: FakePodResources, short_tmp: Path
) -> None:
    ledger = Ledger(short_tmp / "state", startup_grace=0.0)
    web, job = record(short_tmp, 0, 1), record(short_tmp, 2)
    ledger.add(web)
    ledger.add(job)
    kubelet.set(Assigned("ns", "web", "app", TS, ids(0, 1)), Assigned("ns", "job", "c", TS, ids(2)))
    poller = PodResourcesPoller(PodResourcesClient(str(kubelet.socket_path)), ledger, {TS})
    try:
        poller.poll_once()
        assert {r.key for r in ledger.records()} == {web.key, job.key}
        assert Path(str(job.cdi_spec)).exists()
        # The kubelet cannot answer: nothing may be removed on a failed List.
        kubelet.fail = True
        poller.poll_once()
        assert len(ledger.records()) == 2
        kubelet.fail = False
        kubelet.set(Assigned("ns", "web", "app", TS, ids(0, 1)))
        poller.poll_once()
        assert [r.key for r in ledger.records()] == [web.key]
        assert not Path(str(job.cdi_spec)).exists()
        assert Path(str(web.cdi_spec)).exists()
        assert poller.holding() == {("ns", "web", "app")}
    finally:
        poller.stop()


def test_restart_rebuilds_used_slices_from_pod_resources(
    kubelet: FakePodResources, short_tmp: Path
) -> None:
    state = short_tmp / "state"
    first = Ledger(state)
    for r in (record(short_tmp, 0), record(short_tmp, 1, 2), record(short_tmp, 3)):
        first.add(r)
    # The plugin restarts; meanwhile the pod holding slice 3 went away.
    kubelet.set(Assigned("a", "p", "c", TS, ids(0)), Assigned("b", "q", "c", TS, ids(1, 2)))
    second = Ledger(state, startup_grace=0.0)
    poller = PodResourcesPoller(PodResourcesClient(str(kubelet.socket_path)), second, {TS})
    try:
        poller.poll_once()
    finally:
        poller.stop()
    assert second.used_ids(TS) == set(ids(0, 1, 2))


def test_fast_poll_while_an_allocation_is_not_listed(
    kubelet: FakePodResources, short_tmp: Path
) -> None:
    now = [1000.0]
    ledger = Ledger(short_tmp / "state", clock=lambda: now[0])
    ledger.add(record(short_tmp, 0, created=now[0]))  # fresh: inside the reconcile grace
    poller = PodResourcesPoller(
        PodResourcesClient(str(kubelet.socket_path)), ledger, {TS}, fast=0.5, slow=7.0
    )
    try:
        assert poller.poll_once() == 0.5
        kubelet.set(Assigned("ns", "p", "c", TS, ids(0)))
        assert poller.poll_once() == 7.0
        poller.add_listener(lambda listed: True)  # a listener with pending work
        assert poller.poll_once() == 0.5
    finally:
        poller.stop()


def test_background_poller_reconciles_and_stops(kubelet: FakePodResources, short_tmp: Path) -> None:
    ledger = Ledger(short_tmp / "state", startup_grace=0.0)
    gone = record(short_tmp, 5)
    ledger.add(gone)
    poller = PodResourcesPoller(
        PodResourcesClient(str(kubelet.socket_path)), ledger, {TS}, fast=0.05, slow=0.05
    )
    poller.start()
    try:
        for _ in range(200):
            if not ledger.records():
                break
            poller.wake()
            time.sleep(0.05)
        assert ledger.records() == []
        assert not Path(str(gone.cdi_spec)).exists()
    finally:
        poller.stop()
        poller.stop()  # idempotent


def test_a_finished_init_container_keeps_its_record_without_fast_polls(
    kubelet: FakePodResources, short_tmp: Path
) -> None:
    now = [1000.0]
    ledger = Ledger(short_tmp / "state", clock=lambda: now[0], startup_grace=0.0)
    init = record(short_tmp, 0, 1, created=now[0])
    app = record(short_tmp, 5, created=now[0])
    ledger.add(init)
    ledger.add(app)
    poller = PodResourcesPoller(
        PodResourcesClient(str(kubelet.socket_path)), ledger, {TS}, fast=0.5, slow=7.0
    )
    try:
        kubelet.set(
            Assigned("ns", "web", "init", TS, ids(0, 1)), Assigned("ns", "web", "app", TS, ids(5))
        )
        assert poller.poll_once() == 7.0
        now[0] += 3600.0  # the init container finished long ago; its pod runs on
        kubelet.set(Assigned("ns", "web", "app", TS, ids(5)))
        assert poller.poll_once() == 7.0
        assert [r.key for r in ledger.records()] == sorted([init.key, app.key])
        assert Path(str(init.cdi_spec)).exists()
        kubelet.set(Assigned("ns", "other", "c", TS, ()))  # the pod is gone, another has none
        poller.poll_once()
        assert ledger.records() == [] and not Path(str(init.cdi_spec)).exists()
    finally:
        poller.stop()


def test_a_restarting_kubelets_lists_drop_nothing_until_registered_and_the_grace(
    kubelet: FakePodResources, short_tmp: Path
) -> None:
    """A node reboot on the real node: the kubelet's pod-resources API answers at once, its
    device manager (and so our registration) comes a minute later, and until then, and a
    while after, its lists show none of the pods it is about to restore. Their allocations,
    and the CDI specs its replayed answers name, must stay: nothing is dropped while the
    ledger is paused (kubelet restarted, not registered yet), nor for the startup grace after
    the registration."""
    now = [1000.0]
    ledger = Ledger(short_tmp / "state", clock=lambda: now[0], startup_grace=60.0)
    kept = record(short_tmp, 0, created=now[0] - 3600.0)  # allocated before the reboot
    ledger.add(kept)
    ledger.pause_removals()  # the daemon starts (or sees a new kubelet.sock): not registered
    poller = PodResourcesPoller(PodResourcesClient(str(kubelet.socket_path)), ledger, {TS})
    try:
        now[0] += 600.0  # long past the grace from our start: the kubelet lists nothing yet
        poller.poll_once()
        assert [r.key for r in ledger.records()] == [kept.key]
        ledger.hold_removals()  # registered: the kubelet restores its pods from now on
        now[0] += 59.0
        poller.poll_once()
        assert [r.key for r in ledger.records()] == [kept.key]
        assert Path(str(kept.cdi_spec)).exists()
        now[0] += 2.0  # the grace is over and the kubelet still lists no such pod: it is gone
        poller.poll_once()
        assert ledger.records() == []
        assert not Path(str(kept.cdi_spec)).exists()
    finally:
        poller.stop()
