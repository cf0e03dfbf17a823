"""Device taints for DRA GPUs: the cause per fault domain, the taint itself, the publisher
writing and removing it over real HTTP against the in-test API server (strict 1.36/1.37
validation), a storm of health flips coalesced to at most 5 republishes a second that ends
in the final state, 64 devices per slice with taints, and taints the API server drops.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from deviceplugin.dra import slices
from deviceplugin.dra.publisher import SlicePublisher, Taints
from deviceplugin.dra.taints import (
    TAINT_KEY,
    cause_class,
    device_cause,
    gpu_cause_value,
    taint,
    time_added,
)
from deviceplugin.health.board import Fault, HealthBoard
from deviceplugin.kube.client import Api
from deviceplugin.model import FaultDomain, GpuUuid, Mode, ServingApi
from deviceplugin.plan import SlicePlan
from deviceplugin.plumbing.updates import Pacer
from deviceplugin.simulate.apiserver import FakeApiServer
from deviceplugin.simulate.dra_apiserver import Invalid, validate_slice
from tests.planfixtures import gpu_plan
from tests.test_dra_publisher import FAST, NODE, wait_until


def fault(domain: FaultDomain, cause: str, since: float = 1_700_000_000.0) -> Fault:
    return Fault(domain, cause, since)


# ---- the cause of one device ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("cause", "value"),
    [
        ("xid=79 class=reboot", "xid-79"),
        ("unknown-device xid=48 class=reset", "xid-48"),
        ("gpu-lost", "gpu-lost"),
        ("gpu-lost error=gpu-is-lost", "gpu-lost"),
        ("gpu-unavailable class=reboot", "gpu-lost"),
        ("double-bit-ecc class=reset", "double-bit-ecc"),
        ("recovery-action=RESET class=reset", "recovery-action-reset"),
    ],
)
def test_gpu_causes_become_label_values(cause: str, value: str) -> None:
    assert gpu_cause_value(cause) == value


def test_the_most_severe_domain_names_the_cause() -> None:
    faults = {
        FaultDomain.MPS_SERVER: fault(FaultDomain.MPS_SERVER, "xid=31 class=application"),
        FaultDomain.MPS_DAEMON: fault(FaultDomain.MPS_DAEMON, "daemon-dead pid=7"),
    }
    got = device_cause(Mode.SM_SHARING, faults)
    assert got is not None and got.value == "mps-down"
    faults[FaultDomain.MONITOR] = fault(FaultDomain.MONITOR, "monitor-failed event-set")
    got = device_cause(Mode.SM_SHARING, faults)
    assert got is not None and got.value == "unmonitored"
    faults[FaultDomain.GPU] = fault(FaultDomain.GPU, "xid=79 class=reboot", since=5.0)
    got = device_cause(Mode.SM_SHARING, faults)
    assert got is not None and (got.value, got.since) == ("xid-79", 5.0)


@pytest.mark.parametrize("mode", [Mode.TIME_SLICING, Mode.EXCLUSIVE])
def test_mps_faults_leave_other_modes_healthy(mode: Mode) -> None:
    faults = {
        FaultDomain.MPS_SERVER: fault(FaultDomain.MPS_SERVER, "mps-state=FAULT"),
        FaultDomain.MPS_DAEMON: fault(FaultDomain.MPS_DAEMON, "daemon-dead"),
        FaultDomain.CLIENT_LIMIT: fault(FaultDomain.CLIENT_LIMIT, "max-clients"),
    }
    assert device_cause(mode, faults) is None
    sm = device_cause(Mode.SM_SHARING, {FaultDomain.MPS_SERVER: faults[FaultDomain.MPS_SERVER]})
    assert sm is not None and sm.value == "mps-fault"
    # a client limit is capacity, never a taint
    limit = {FaultDomain.CLIENT_LIMIT: faults[FaultDomain.CLIENT_LIMIT]}
    assert device_cause(Mode.SM_SHARING, limit) is None


def test_the_taint_carries_key_value_effect_and_the_time_the_fault_began() -> None:
    cause = device_cause(
        Mode.EXCLUSIVE, {FaultDomain.GPU: fault(FaultDomain.GPU, "xid=79 class=reboot", 0.0)}
    )
    assert cause is not None
    assert taint(cause, "NoExecute") == {
        "key": TAINT_KEY,
        "value": "xid-79",
        "effect": "NoExecute",
        "timeAdded": "1970-01-01T00:00:00Z",
    }
    assert time_added(1_700_000_000.9) == "2023-11-14T22:13:20Z"


@pytest.mark.parametrize(
    ("value", "cls"),
    [("xid-79", "xid"), ("xid-13", "xid"), ("gpu-lost", "gpu-lost"), ("mps-fault", "mps-fault"),
     ("mps-down", "mps-down"), ("unmonitored", "unmonitored"), ("double-bit-ecc", "gpu-other")],
)  # fmt: skip
def test_cause_classes_are_bounded(value: str, cls: str) -> None:
    assert cause_class(value) == cls


def test_a_tainted_device_passes_the_api_servers_validation() -> None:
    plan = dra_plan(Mode.TIME_SLICING, Mode.SM_SHARING)
    board = HealthBoard()
    board.set(plan.gpus[1].uuid, FaultDomain.GPU, "gpu-lost at-register")
    owner = slices.Owner(NODE, "uid-1")
    (body,) = slices.build(
        plan, owner=owner, generation=1, driver_version="615.43.02", taints=taints_of(plan, board)
    )
    validate_slice(body)  # the 1.36 and 1.37 schemas, strict, and the server's own checks
    assert "taints" not in body["spec"]["devices"][0]
    assert body["spec"]["devices"][1]["taints"][0]["value"] == "gpu-lost"
    body["spec"]["devices"][1]["taints"][0]["effect"] = "Evict"
    with pytest.raises(Invalid, match="effect"):
        validate_slice(body)
    body["spec"]["devices"][1]["taints"][0].update(effect="NoSchedule", value="xid=79")
    with pytest.raises(Invalid, match="label value"):
        validate_slice(body)


# ---- the pacer --------------------------------------------------------------------------------


def test_the_pacer_spaces_sends_to_five_a_second() -> None:
    now = [100.0]
    pacer = Pacer(5, clock=lambda: now[0])
    assert pacer.delay() == 0.0  # nothing sent yet
    pacer.sent()
    assert pacer.delay() == pytest.approx(0.2)
    now[0] += 0.15
    assert pacer.delay() == pytest.approx(0.05)
    now[0] += 0.1
    assert pacer.delay() == 0.0


# ---- through the publisher and the API server ----------------------------------------------


def dra_plan(*modes: Mode) -> SlicePlan:
    gpus = [replace(gpu_plan(i, m), api=ServingApi.DRA) for i, m in enumerate(modes)]
    return SlicePlan(tuple(gpus), ())


def taints_of(plan: SlicePlan, board: HealthBoard, effect: str = "NoSchedule") -> Taints:
    out = {}
    for gp in plan.dra_gpus:
        cause = device_cause(gp.mode, board.faults(gp.uuid))
        if cause is not None:
            out[slices.device_name(gp)] = [taint(cause, effect)]
    return out


def device_taints(fake: FakeApiServer) -> dict[str, list[str]]:
    return {
        d["name"]: [t["value"] for t in d.get("taints") or []]
        for s in fake.dra.slices_of(NODE)
        for d in s["spec"]["devices"]
    }


class Watched:
    """A publisher fed by a health board, as the front-end wires it."""

    def __init__(self, api: Api, plan: SlicePlan, **kwargs: Any) -> None:
        self.plan = plan
        self.board = HealthBoard()
        self.republishes: list[float] = []
        self.dropped: list[list[str]] = []
        self.pub = SlicePublisher(
            api, NODE, lambda: self.plan, "615.43.02", settings=FAST,
            taints=lambda: taints_of(self.plan, self.board),
            on_republish=lambda: self.republishes.append(time.monotonic()),
            on_dropped=self.dropped.append, **kwargs,
        )  # fmt: skip
        self.board.subscribe(self.pub.republish)

    def uuid(self, index: int) -> GpuUuid:
        return self.plan.gpus[index].uuid


@pytest.fixture
def watched(api: Api) -> Iterator[Watched]:
    made = Watched(api, dra_plan(Mode.TIME_SLICING, Mode.SM_SHARING, Mode.EXCLUSIVE))
    made.pub.start()
    wait_until(lambda: made.pub.status.published)
    yield made
    made.pub.stop()


def test_a_fault_taints_its_device_and_recovery_removes_it(
    fake: FakeApiServer, watched: Watched
) -> None:
    (before,) = {s["spec"]["pool"]["generation"] for s in fake.dra.slices_of(NODE)}
    watched.board.set(watched.uuid(1), FaultDomain.GPU, "xid=79 class=reboot")
    wait_until(lambda: device_taints(fake)["gpu-1"] == ["xid-79"])
    assert device_taints(fake) == {"gpu-0": [], "gpu-1": ["xid-79"], "gpu-2": []}
    (tainted,) = fake.dra.slices_of(NODE)
    assert tainted["spec"]["pool"]["generation"] > before
    wait_until(lambda: watched.pub.status.taints == (("gpu-1", "xid-79"),))
    watched.board.clear(watched.uuid(1), FaultDomain.GPU)
    wait_until(lambda: device_taints(fake)["gpu-1"] == [])
    (healed,) = fake.dra.slices_of(NODE)
    assert healed["spec"]["pool"]["generation"] > tainted["spec"]["pool"]["generation"]
    wait_until(lambda: watched.pub.status.taints == ())


def test_a_storm_of_flips_costs_at_most_five_republishes_a_second_and_ends_in_the_final_state(
    fake: FakeApiServer, watched: Watched
) -> None:
    gpu = watched.uuid(0)
    start = len(watched.republishes)
    began = time.monotonic()
    for i in range(1000):  # ~1.5 s of flips, each one a board change
        if i % 2 == 0:
            watched.board.set(gpu, FaultDomain.GPU, f"xid={48 + i % 4} class=reset")
        else:
            watched.board.clear(gpu, FaultDomain.GPU)
        time.sleep(0.0015)
    watched.board.set(gpu, FaultDomain.GPU, "xid=79 class=reboot")  # the final state
    storm = time.monotonic() - began
    wait_until(lambda: device_taints(fake)["gpu-0"] == ["xid-79"])
    time.sleep(0.5)  # nothing more comes after the final state is published
    times = watched.republishes[start:]
    assert device_taints(fake)["gpu-0"] == ["xid-79"]
    assert 2 <= len(times) <= 5 * (storm + 1.5), (len(times), storm)
    for i, t in enumerate(times):  # any one second holds at most 5
        assert sum(1 for u in times[i:] if u - t < 1.0) <= 5, times


def test_with_taints_a_slice_holds_at_most_64_devices(api: Api, fake: FakeApiServer) -> None:
    plan = dra_plan(*([Mode.TIME_SLICING] * 130))
    plan = SlicePlan(tuple(replace(gp, gpu=replace(gp.gpu, index=i)) for i, gp in
                           enumerate(plan.gpus)), ())  # fmt: skip
    board = HealthBoard()
    pub = SlicePublisher(api, NODE, lambda: plan, "615.43.02", settings=FAST,
                         taints=lambda: taints_of(plan, board))  # fmt: skip
    pub.reconcile()
    assert [len(s["spec"]["devices"]) for s in fake.dra.slices_of(NODE)] == [128, 2]
    board.set(plan.gpus[129].uuid, FaultDomain.MONITOR, "monitor-failed")
    pub.reconcile()
    listed = fake.dra.slices_of(NODE)
    assert [len(s["spec"]["devices"]) for s in listed] == [64, 64, 2]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in listed} == {3}
    assert len({s["spec"]["pool"]["generation"] for s in listed}) == 1
    assert listed[2]["spec"]["devices"][1]["taints"][0]["value"] == "unmonitored"


def test_dropped_taints_are_reported_once_and_not_sent_again(api: Api, fake: FakeApiServer) -> None:
    fake.dra.drop_taints = True
    w = Watched(api, dra_plan(Mode.TIME_SLICING, Mode.EXCLUSIVE))
    w.pub.start()
    try:
        wait_until(lambda: w.pub.status.published)
        w.board.set(w.uuid(0), FaultDomain.GPU, "gpu-lost")
        wait_until(lambda: w.dropped)
        wait_until(lambda: w.pub.status.published and not w.pub.status.device_taints)
        status = w.pub.status
        assert any(p.endswith("devices[gpu-0].taints") for p in status.dropped), status.dropped
        assert status.multi_allocation is True  # consumable capacity was kept
        assert status.taints == ()
        writes = status.writes
        # more health changes: nothing dropped again, nothing reported again, no churn
        w.board.set(w.uuid(1), FaultDomain.GPU, "xid=79 class=reboot")
        passes = w.pub.reconciles
        wait_until(lambda: w.pub.reconciles > passes)
        assert len(w.dropped) == 1
        assert w.pub.status.writes == writes
        (slc,) = fake.dra.slices_of(NODE)
        assert slc["spec"]["devices"][0]["allowMultipleAllocations"] is True
    finally:
        w.pub.stop()


def test_board_flips_from_another_thread_never_block(watched: Watched) -> None:
    # Board listeners run under the health monitor's lock: republish() only wakes the thread.
    done = threading.Event()

    def flip() -> None:
        for _ in range(200):
            watched.board.set(watched.uuid(2), FaultDomain.MONITOR, "monitor-failed")
            watched.board.clear(watched.uuid(2), FaultDomain.MONITOR)
        done.set()

    began = time.monotonic()
    threading.Thread(target=flip).start()
    assert done.wait(5.0)
    assert time.monotonic() - began < 1.0
