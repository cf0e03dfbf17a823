"""HealthMonitor through the real pynvml wrappers over the fake NVML, on a node in all three modes.

GPU 0 runs time-slicing, GPU 1 sm-sharing, GPU 2 exclusive (a Config with `gpus` rules and the
real `build_plan`). The probe thread is parked (probe_interval of an hour) and tests call
`tick()` with an injected clock, so quiet periods need no sleeping; the event thread runs for
real. Faults are injected at the C-symbol boundary only.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml
import pytest

from deviceplugin.config.settings import Config, GpuMatch, GpuRule, HealthConfig, MpsConfig
from deviceplugin.health import state as health_state
from deviceplugin.health.board import HealthBoard, device_health
from deviceplugin.health.events import backoff_delay
from deviceplugin.health.faults import Transition
from deviceplugin.health.monitor import HealthMonitor
from deviceplugin.health.xid import XidClass
from deviceplugin.inventory.gpus import read_inventory
from deviceplugin.inventory.nvml import NvmlSession
from deviceplugin.model import GIB, FaultDomain, GpuUuid, Health, Mode
from deviceplugin.mps import layout
from deviceplugin.mps.supervisor import MpsSupervisor, Timing, supervisor_server_active
from deviceplugin.plan import SlicePlan, build_plan
from deviceplugin.simulate import mps_control as fake_mps
from deviceplugin.simulate.nvml import FakeNvml
from deviceplugin.simulate.nvml_library import RECOVERY_GPU_RESET, RECOVERY_NODE_REBOOT
from deviceplugin.simulate.specs import parse_spec

TS, SM, EX = 0, 1, 2  # GPU index per mode
MODES = {TS: Mode.TIME_SLICING, SM: Mode.SM_SHARING, EX: Mode.EXCLUSIVE}
QUIET = 0.25  # dyadic, so clock sums are exact
UNKNOWN = 999  # NVML_ERROR_UNKNOWN


def spec(driver: str = "615.43.02") -> Any:
    gpus = [{"name": "NVIDIA H200", "memoryMiB": 143771, "count": 3}]
    return parse_spec({"driverVersion": driver, "gpus": gpus}, source="test")


def config(quiet: float = QUIET, **health: Any) -> Config:
    rules = tuple(GpuRule(GpuMatch(index=i), mode) for i, mode in MODES.items())
    return Config(
        gpus=rules,
        slice_size=16 * GIB,
        enforcement="best-effort",
        health=HealthConfig(quiet_period=quiet, **health),
    )


def eventually(pred: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Liveness only: generous, never a performance assertion."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@dataclass
class Clock:
    now: float = 1024.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Node:
    fake: FakeNvml
    session: NvmlSession
    plan: SlicePlan
    cfg: Config
    board: HealthBoard
    state_dir: Path
    clock: Clock = field(default_factory=Clock)
    mps_active: dict[GpuUuid, bool | None] = field(default_factory=dict)
    transitions: list[Transition] = field(default_factory=list)
    monitors: list[HealthMonitor] = field(default_factory=list)

    def uuid(self, index: int) -> GpuUuid:
        return self.fake.resolve(index)

    def start(self, **kw: Any) -> HealthMonitor:
        options: dict[str, Any] = {
            "mps_server_active": lambda gpu, since: self.mps_active.get(gpu),
            "clock": self.clock,
            "probe_interval": 3600.0,  # tests call tick()
            "on_transition": self.transitions.append,
            "wait_timeout": 0.05,
            "mps_settle": 0.0,
            "backoff_base": 0.02,
            "backoff_max": 0.1,
        }
        options.update(kw)
        monitor = HealthMonitor(
            self.session,
            lambda: self.plan,
            lambda: self.cfg,
            self.board,
            self.state_dir,
            **options,
        )
        self.monitors.append(monitor)
        monitor.start()
        return monitor

    def domains(self, index: int) -> set[FaultDomain]:
        return set(self.board.faults(self.uuid(index)))

    def health(self, index: int) -> Health:
        return device_health(MODES[index], self.domains(index), allocated=False)

    def cause(self, index: int, domain: FaultDomain) -> str | None:
        fault = self.board.faults(self.uuid(index)).get(domain)
        return fault.cause if fault is not None else None


MakeNode = Callable[..., Node]


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[MakeNode]:
    nodes: list[Node] = []
    before = pynvml.nvmlLib

    def make(driver: str = "615.43.02", quiet: float = QUIET, **health: Any) -> Node:
        sim = spec(driver)
        fake = FakeNvml(sim)
        fake.install()
        session = NvmlSession.open()
        sysfs = tmp_path / "sys"
        sim.write_sysfs(sysfs)
        cfg = config(quiet, **health)
        inventory = read_inventory(session, sysfs, "/nonexistent/nvidia-ctk", sim.node_facts())
        plan = build_plan(inventory, cfg)
        assert [p.mode for p in plan.gpus] == list(MODES.values())
        assert all(p.advertised for p in plan.gpus)
        state = tmp_path / "state"
        state.mkdir(exist_ok=True)
        node = Node(fake, session, plan, cfg, HealthBoard(), state)
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        for monitor in node.monitors:
            monitor.stop()
        node.session.shutdown()
        node.fake.uninstall()
    assert pynvml.nvmlLib is before


def wrap_symbol(fake: FakeNvml, name: str, wrapper: Callable[..., Any] | None) -> None:
    """Replace one C symbol of the fake library (None: remove it, as an old driver would)."""
    if wrapper is None:
        delattr(fake.library, name)
    else:
        setattr(fake.library, name, wrapper)
    pynvml._nvmlGetFunctionPointer_cache.clear()


def settle(monitor: HealthMonitor, xid: int, before: int = 0) -> None:
    """Wait until every event the fake queues for one Xid has been handled."""
    count = {48: 3, 79: 1, UNKNOWN: 2, 62: 2, 95: 2}.get(xid, 1)  # Xid, DBE, recovery action
    eventually(lambda: monitor.events_seen >= before + count, what=f"events of xid {xid}")


def recover(node: Node, monitor: HealthMonitor, index: int) -> None:
    """The fake GPU answers with recovery action NONE; quiet period passes; it is Healthy."""
    node.fake.recover(index)
    monitor.tick()  # quiet period starts
    assert FaultDomain.GPU in node.domains(index), "healthy before the quiet period passed"
    node.clock.advance(QUIET)
    monitor.tick()
    assert FaultDomain.GPU not in node.domains(index)


# ---- start, stop, state ------------------------------------------------------------------


def test_starts_healthy_writes_state_and_stops_idempotently(make_node: MakeNode) -> None:
    node = make_node()
    monitor = node.start()
    monitor.start()  # idempotent
    assert node.board.snapshot() == {}
    assert monitor.running
    data = health_state.read_health(node.state_dir)
    assert data["monitor"]["running"] is True
    assert {g["mode"] for g in data["gpus"].values()} == {m.value for m in MODES.values()}
    assert all(g["health"] == "Healthy" and g["faults"] == {} for g in data["gpus"].values())
    monitor.stop()
    monitor.stop()
    assert not monitor.running
    assert health_state.read_health(node.state_dir)["monitor"]["running"] is False


def test_backoff_first_retry_is_immediate_then_doubles() -> None:
    assert [backoff_delay(n, 0.5, 3.0) for n in range(1, 7)] == [0.0, 0.5, 1.0, 2.0, 3.0, 3.0]


# ---- DESIGN table: application Xid --------------------------------------------------------


@pytest.mark.parametrize("index", [TS, EX])
def test_application_xid_leaves_time_slicing_and_exclusive_healthy(
    make_node: MakeNode, index: int
) -> None:
    node = make_node()
    monitor = node.start()
    node.fake.inject_xid(index, 43)
    node.fake.inject_xid(index, 13)
    eventually(lambda: monitor.events_seen >= 2, what="both events handled")
    monitor.tick()
    assert node.board.snapshot() == {}
    assert node.transitions == []


def test_application_xid_faults_the_sm_sharing_gpu_until_its_server_is_active(
    make_node: MakeNode,
) -> None:
    node = make_node()
    uuid = node.uuid(SM)
    node.mps_active[uuid] = False  # the server sits in FAULT
    monitor = node.start()
    node.fake.inject_xid(SM, 43)
    eventually(lambda: FaultDomain.MPS_SERVER in node.domains(SM), what="mps-server fault")
    assert node.cause(SM, FaultDomain.MPS_SERVER) == "xid=43 class=application"
    assert node.health(SM) is Health.UNHEALTHY
    assert node.health(TS) is Health.HEALTHY and node.health(EX) is Health.HEALTHY
    monitor.tick()
    assert FaultDomain.MPS_SERVER in node.domains(SM)  # FAULT: stays
    node.mps_active[uuid] = None  # daemon unknown (restarting): stays
    monitor.tick()
    assert FaultDomain.MPS_SERVER in node.domains(SM)
    node.mps_active[uuid] = True
    monitor.tick()
    assert node.domains(SM) == set()
    assert node.health(SM) is Health.HEALTHY
    (fault, cleared) = node.transitions
    assert (fault.gpu, fault.domain, fault.healthy) == (uuid, FaultDomain.MPS_SERVER, False)
    assert fault.mode is Mode.SM_SHARING and fault.slices == len(node.plan.gpus[SM].device_ids)
    assert (cleared.domain, cleared.healthy, cleared.cause) == (
        FaultDomain.MPS_SERVER,
        True,
        "xid=43 class=application",
    )


def test_server_state_read_before_the_xid_settles_is_not_trusted(make_node: MakeNode) -> None:
    node = make_node()
    node.mps_active[node.uuid(SM)] = True  # a stale "ACTIVE" from before the fault
    monitor = node.start(mps_settle=2.0)
    node.fake.inject_xid(SM, 31)
    eventually(lambda: FaultDomain.MPS_SERVER in node.domains(SM), what="mps-server fault")
    monitor.tick()
    node.clock.advance(1.9)
    monitor.tick()
    assert FaultDomain.MPS_SERVER in node.domains(SM)
    node.clock.advance(0.2)
    monitor.tick()
    assert FaultDomain.MPS_SERVER not in node.domains(SM)


def test_monitor_never_clears_an_mps_cause_it_did_not_set(make_node: MakeNode) -> None:
    node = make_node()
    uuid = node.uuid(SM)
    node.mps_active[uuid] = True
    monitor = node.start()
    node.fake.inject_xid(SM, 43)
    eventually(lambda: FaultDomain.MPS_SERVER in node.domains(SM), what="mps-server fault")
    # The supervisor meanwhile reports its own cause for the same domain.
    node.board.set(uuid, FaultDomain.MPS_SERVER, "uid-conflict serving=1000 waiting=2000")
    monitor.tick()
    assert node.cause(SM, FaultDomain.MPS_SERVER) == "uid-conflict serving=1000 waiting=2000"


# ---- DESIGN table: reset / reboot Xid, GPU lost -------------------------------------------


@pytest.mark.parametrize("index", [TS, SM, EX])
@pytest.mark.parametrize("xid", [48, 62, UNKNOWN])
def test_reset_xid_takes_only_that_gpu_until_reset_and_quiet(
    make_node: MakeNode, index: int, xid: int
) -> None:
    node = make_node()
    monitor = node.start()
    node.fake.inject_xid(index, xid)
    settle(monitor, xid)
    assert node.cause(index, FaultDomain.GPU) == f"xid={xid} class=reset"
    assert node.health(index) is Health.UNHEALTHY
    assert all(node.domains(i) == set() for i in MODES if i != index)
    # Recovery action reads GPU_RESET: the GPU answers but is not recovered.
    assert node.fake.recovery_action(index) == RECOVERY_GPU_RESET
    node.clock.advance(QUIET * 10)
    monitor.tick()
    assert FaultDomain.GPU in node.domains(index)
    recover(node, monitor, index)
    assert node.board.snapshot() == {}
    assert [(t.gpu, t.healthy) for t in node.transitions] == [
        (node.uuid(index), False),
        (node.uuid(index), True),
    ]


def test_xid_79_loses_one_gpu_and_never_touches_the_others(make_node: MakeNode) -> None:
    node = make_node()
    lost = node.uuid(TS)
    seen: list[set[GpuUuid]] = []
    node.board.subscribe(lambda: seen.append(set(node.board.snapshot())))
    monitor = node.start()
    node.fake.inject_xid(TS, 79)
    eventually(lambda: FaultDomain.GPU in node.domains(TS), what="gpu fault")
    assert node.cause(TS, FaultDomain.GPU) == "xid=79 class=reboot"
    eventually(lambda: monitor.event_sets_opened == 2, what="the set rebuilt without it")
    assert lost not in monitor.registered_gpus()
    # The lost GPU makes the wait raise GpuIsLost; the set is rebuilt without it, so the
    # others still get their events: an application Xid on the sm-sharing GPU arrives.
    node.fake.inject_xid(SM, 43)
    eventually(lambda: FaultDomain.MPS_SERVER in node.domains(SM), what="events after rebuild")
    node.mps_active[node.uuid(SM)] = True
    monitor.tick()
    assert FaultDomain.GPU not in node.domains(SM) and node.domains(EX) == set()
    assert all(s <= {lost, node.uuid(SM)} for s in seen)
    assert all(node.uuid(EX) not in s for s in seen)
    # Still lost after any time: no recovery without the GPU answering.
    node.clock.advance(QUIET * 10)
    monitor.tick()
    assert FaultDomain.GPU in node.domains(TS)
    assert lost not in monitor.registered_gpus()
    recover(node, monitor, TS)
    # The returned GPU is registered again: a new Xid on it is seen.
    eventually(lambda: lost in monitor.registered_gpus(), what="events registered again")
    node.fake.inject_xid(TS, 48)
    eventually(lambda: FaultDomain.GPU in node.domains(TS), what="events for the returned gpu")
    assert all(node.uuid(EX) not in s for s in seen)


@pytest.mark.parametrize("index", [TS, SM, EX])
def test_gpu_lost_without_an_event_is_noticed_by_the_probe(make_node: MakeNode, index: int) -> None:
    node = make_node()
    monitor = node.start()
    node.fake.set_lost(index)
    monitor.tick()
    assert FaultDomain.GPU in node.domains(index)
    assert node.cause(index, FaultDomain.GPU) is not None
    assert "gpu-lost" in (node.cause(index, FaultDomain.GPU) or "")
    assert all(node.domains(i) == set() for i in MODES if i != index)
    # The event thread meets the loss too (its wait fails) and drops the GPU from its set;
    # let it finish first, or its fault lands inside the quiet period and restarts it.
    eventually(lambda: node.uuid(index) not in monitor.registered_gpus(), what="event set rebuilt")
    recover(node, monitor, index)


def test_the_xid_behind_a_loss_the_probe_saw_first_names_the_fault(make_node: MakeNode) -> None:
    """An Xid 79 loses the GPU and sends its event; when the probe notices the loss first, the
    Xid that follows is the same fault's cause (a DRA taint says `xid-79`, not `gpu-lost`)."""
    node = make_node()
    monitor = node.start()
    node.fake.set_lost(TS)
    monitor.tick()
    assert "gpu-lost" in (node.cause(TS, FaultDomain.GPU) or "")
    monitor._events._classified(node.uuid(TS), "xid=79", XidClass.REBOOT)  # its event, as handled
    assert node.cause(TS, FaultDomain.GPU) == "xid=79 class=reboot"
    # never the other way round: a later loss keeps the Xid
    monitor._faults.gpu_fault(node.uuid(TS), "gpu-lost", XidClass.REBOOT)  # as the probe does
    assert node.cause(TS, FaultDomain.GPU) == "xid=79 class=reboot"


def test_double_bit_ecc_event_alone_is_reset_class(make_node: MakeNode) -> None:
    node = make_node(reset_xids=(), ignored_xids=(48,))  # the Xid itself ignored: only DBE acts
    monitor = node.start()
    node.fake.inject_xid(EX, 48)
    eventually(lambda: FaultDomain.GPU in node.domains(EX), what="gpu fault")
    causes = {node.cause(EX, FaultDomain.GPU)}
    assert causes <= {"double-bit-ecc class=reset", "recovery-action-event"
                      " recovery-action=gpu-reset class=reset"}  # fmt: skip
    recover(node, monitor, EX)


def test_recovery_action_event_and_xid_154_follow_the_field(make_node: MakeNode) -> None:
    node = make_node()
    monitor = node.start()
    node.fake.inject_xid(SM, 154)  # recovery action still NONE: nothing to do
    eventually(lambda: monitor.events_seen >= 1, what="xid 154 handled")
    assert node.board.snapshot() == {}
    node.fake.set_recovery_action(SM, RECOVERY_NODE_REBOOT)
    eventually(lambda: FaultDomain.GPU in node.domains(SM), what="gpu fault")
    assert node.cause(SM, FaultDomain.GPU) == (
        "recovery-action-event recovery-action=node-reboot class=reboot"
    )
    recover(node, monitor, SM)


# ---- quiet period, operator clear -----------------------------------------------------------


def test_quiet_period_restarts_when_a_second_fault_arrives(make_node: MakeNode) -> None:
    node = make_node()
    monitor = node.start()
    node.fake.inject_xid(SM, 62)
    eventually(lambda: FaultDomain.GPU in node.domains(SM), what="first fault")
    node.fake.recover(SM)
    monitor.tick()  # quiet from t0
    state = monitor.state()["gpus"][node.uuid(SM)]["faults"]["gpu"]
    assert state["phase"] == "quiet" and state["quietUntil"] > state["since"]
    node.clock.advance(QUIET / 2)
    before = monitor.events_seen
    node.fake.inject_xid(SM, 62)  # second fault (Xid + recovery-action event)
    settle(monitor, 62, before)
    node.fake.recover(SM)
    monitor.tick()  # quiet starts over at t0 + QUIET/2
    node.clock.advance(QUIET * 3 / 4)  # past the first quiet period's end
    monitor.tick()
    assert FaultDomain.GPU in node.domains(SM)
    node.clock.advance(QUIET / 4)
    monitor.tick()
    assert FaultDomain.GPU not in node.domains(SM)
    # One fault and one recovery on the board, not two: the second Xid only restarted the clock.
    assert [t.healthy for t in node.transitions] == [False, True]


def test_operator_clear_where_the_recovery_field_is_unsupported(make_node: MakeNode) -> None:
    node = make_node(driver="535.104.05")  # before field 230 and its event
    uuid = node.uuid(EX)
    monitor = node.start()
    health_state.request_clear(node.state_dir, node.uuid(TS))  # no fault there: consumed, no-op
    monitor.tick()
    assert health_state.pending_clears(node.state_dir) == []
    node.fake.inject_xid(EX, 48)
    eventually(lambda: FaultDomain.GPU in node.domains(EX), what="gpu fault")
    node.fake.recover(EX)
    node.clock.advance(QUIET * 10)
    monitor.tick()
    monitor.tick()
    assert FaultDomain.GPU in node.domains(EX), "NVML cannot say it recovered"
    health_state.request_clear(node.state_dir, uuid)
    monitor.tick()  # consumes the clear; quiet period starts
    assert health_state.pending_clears(node.state_dir) == []
    assert FaultDomain.GPU in node.domains(EX)
    node.clock.advance(QUIET)
    monitor.tick()
    assert node.board.snapshot() == {}


def test_operator_clear_does_not_override_a_lost_gpu(make_node: MakeNode) -> None:
    node = make_node(driver="535.104.05")
    monitor = node.start()
    node.fake.set_lost(TS)
    monitor.tick()
    health_state.request_clear(node.state_dir, node.uuid(TS))
    monitor.tick()
    node.clock.advance(QUIET * 10)
    monitor.tick()
    assert FaultDomain.GPU in node.domains(TS)


FIELD_RECOVERY_ACTION = 230
PER_FIELD_ERRORS = [
    pynvml.NVML_ERROR_UNKNOWN,
    pynvml.NVML_ERROR_INVALID_ARGUMENT,
    pynvml.NVML_ERROR_NO_PERMISSION,
    pynvml.NVML_ERROR_GPU_IS_LOST,  # a stale per-field status while the GPU answers
]


@pytest.mark.parametrize("ret", PER_FIELD_ERRORS)
def test_a_per_field_error_reads_as_unsupported(make_node: MakeNode, ret: int) -> None:
    node = make_node()
    node.fake.set_field_error(SM, FIELD_RECOVERY_ACTION, ret)
    assert node.session.recovery_action(node.uuid(SM)) is None
    node.fake.set_field_error(SM, FIELD_RECOVERY_ACTION, None)
    assert node.session.recovery_action(node.uuid(SM)) == 0


@pytest.mark.parametrize("ret", PER_FIELD_ERRORS)
def test_a_per_field_error_never_blocks_recovery(make_node: MakeNode, ret: int) -> None:
    """Field 230 answers with its own error status (the call succeeds): the value is unknown,
    as on a driver without the field, so the fault waits for `health clear`, which works."""
    node = make_node()
    monitor = node.start()
    node.fake.inject_xid(EX, 48)
    settle(monitor, 48)
    assert FaultDomain.GPU in node.domains(EX)
    node.fake.recover(EX)
    node.fake.set_field_error(EX, FIELD_RECOVERY_ACTION, ret)
    node.clock.advance(QUIET * 10)
    monitor.tick()
    assert FaultDomain.GPU in node.domains(EX), "no value is no proof of recovery"
    health_state.request_clear(node.state_dir, node.uuid(EX))
    monitor.tick()  # the clear applies: quiet period starts
    node.clock.advance(QUIET)
    monitor.tick()
    assert FaultDomain.GPU not in node.domains(EX)
    # an Xid 154 that cannot read the field changes nothing either
    before = monitor.events_seen
    node.fake.inject_xid(EX, 154)
    eventually(lambda: monitor.events_seen > before, what="xid 154 handled")
    monitor.tick()
    assert node.board.snapshot() == {}


def test_health_clear_works_while_nvml_still_reports_a_stale_recovery_action(
    make_node: MakeNode,
) -> None:
    """The operator reset the GPU, but field 230 still says GPU_RESET: the clear is honoured
    for that value; a different action afterwards is a new fault."""
    node = make_node()
    monitor = node.start()
    node.fake.set_recovery_action(TS, RECOVERY_GPU_RESET)
    eventually(lambda: FaultDomain.GPU in node.domains(TS), what="gpu fault")
    node.clock.advance(QUIET * 10)
    monitor.tick()
    assert FaultDomain.GPU in node.domains(TS)
    health_state.request_clear(node.state_dir, node.uuid(TS))
    monitor.tick()
    node.clock.advance(QUIET)
    monitor.tick()
    monitor.tick()
    assert FaultDomain.GPU not in node.domains(TS), "the operator's clear was not honoured"
    node.fake.set_recovery_action(TS, RECOVERY_NODE_REBOOT)  # a new action: a new fault
    eventually(lambda: FaultDomain.GPU in node.domains(TS), what="new fault")
    assert "node-reboot" in (node.cause(TS, FaultDomain.GPU) or "")


def test_health_clear_survives_a_bad_clear_directory(make_node: MakeNode) -> None:
    node = make_node()
    monitor = node.start()
    node.fake.inject_xid(EX, 48)
    settle(monitor, 48)
    node.fake.recover(EX)
    monitor.tick()  # recovery action NONE: quiet period starts
    node.fake.inject_xid(EX, 48)  # a fault NVML will call recovered
    settle(monitor, 48, 3)
    clear_dir = health_state.clear_dir(node.state_dir)
    clear_dir.mkdir(exist_ok=True)
    (clear_dir / f"{node.uuid(TS)}.json").mkdir()  # junk that cannot be unlinked
    health_state.request_clear(node.state_dir, node.uuid(EX))
    assert node.uuid(EX) in health_state.pending_clears(node.state_dir)
    monitor.tick()
    assert health_state.pending_clears(node.state_dir) == [], "the junk must not block clears"


def test_request_clear_repairs_a_clear_path_that_is_not_a_directory(tmp_path: Path) -> None:
    health_state.clear_dir(tmp_path).write_text("junk")
    health_state.request_clear(tmp_path, "GPU-1234")
    assert health_state.pending_clears(tmp_path) == ["GPU-1234"]


# ---- unknown device, wait errors, fail closed ------------------------------------------------


def test_event_for_an_unknown_device_faults_every_gpu(make_node: MakeNode) -> None:
    node = make_node()
    original = node.fake.library.nvmlEventSetWait_v2
    stranger = pynvml.c_nvmlDevice_t()  # a device the session never resolved

    def wait(event_set: Any, out: Any, timeout: Any) -> int:
        ret = int(original(event_set, out, timeout))
        if ret == 0:
            out._obj.device = stranger
        return ret

    wrap_symbol(node.fake, "nvmlEventSetWait_v2", wait)
    monitor = node.start()
    node.fake.inject_xid(SM, 13)
    eventually(lambda: all(FaultDomain.GPU in node.domains(i) for i in MODES), what="all faulted")
    assert {node.cause(i, FaultDomain.GPU) for i in MODES} == {
        "unknown-device xid=13 class=application"
    }
    # Each GPU answers with recovery action NONE, so each recovers after the quiet period.
    monitor.tick()
    node.clock.advance(QUIET)
    monitor.tick()
    assert node.board.snapshot() == {}


def test_a_wait_error_with_every_gpu_answering_changes_nothing(make_node: MakeNode) -> None:
    node = make_node()
    original = node.fake.library.nvmlEventSetWait_v2
    errors = [UNKNOWN]

    def wait(event_set: Any, out: Any, timeout: Any) -> int:
        return errors.pop() if errors else int(original(event_set, out, timeout))

    wrap_symbol(node.fake, "nvmlEventSetWait_v2", wait)
    seen: list[int] = []
    node.board.subscribe(lambda: seen.append(node.board.version))
    monitor = node.start()
    eventually(lambda: monitor.event_sets_opened == 2, what="the set rebuilt after the error")
    node.fake.inject_xid(EX, 62)  # events still flow after the rebuild
    eventually(lambda: FaultDomain.GPU in node.domains(EX), what="gpu fault")
    assert len(seen) == 1
    assert node.domains(TS) == set() and node.domains(SM) == set()
    assert monitor.running


def test_repeated_unexplained_wait_errors_fail_closed_then_recover(make_node: MakeNode) -> None:
    node = make_node()
    original = node.fake.library.nvmlEventSetWait_v2
    failing = threading.Event()
    failing.set()

    def wait(event_set: Any, out: Any, timeout: Any) -> int:
        if failing.is_set():
            time.sleep(0.005)
            return UNKNOWN
        return int(original(event_set, out, timeout))

    wrap_symbol(node.fake, "nvmlEventSetWait_v2", wait)
    monitor = node.start()
    eventually(lambda: all(FaultDomain.MONITOR in node.domains(i) for i in MODES), what="closed")
    assert all(node.health(i) is Health.UNHEALTHY for i in MODES)
    assert "event-wait" in (node.cause(SM, FaultDomain.MONITOR) or "")
    failing.clear()
    eventually(lambda: node.board.snapshot() == {}, what="monitor faults cleared")
    assert monitor.running


@pytest.mark.parametrize("failure", ["error", "missing-symbol"])
def test_monitoring_that_cannot_start_fails_closed(make_node: MakeNode, failure: str) -> None:
    node = make_node()
    original = node.fake.library.nvmlEventSetCreate
    if failure == "error":
        wrap_symbol(node.fake, "nvmlEventSetCreate", lambda out: UNKNOWN)
    else:
        wrap_symbol(node.fake, "nvmlEventSetCreate", None)
    monitor = node.start()
    # Already when start() returns: no window where slices look Healthy.
    assert all(node.domains(i) == {FaultDomain.MONITOR} for i in MODES)
    assert all(node.health(i) is Health.UNHEALTHY for i in MODES)
    data = health_state.read_health(node.state_dir)
    assert all(g["health"] == "Unhealthy" for g in data["gpus"].values())
    wrap_symbol(node.fake, "nvmlEventSetCreate", original)
    eventually(lambda: node.board.snapshot() == {}, what="monitor running again")
    node.fake.inject_xid(TS, 48)
    eventually(lambda: FaultDomain.GPU in node.domains(TS), what="events flow")
    assert monitor.running


def test_events_not_supported_is_a_warning_not_a_fault(make_node: MakeNode) -> None:
    node = make_node()
    wrap_symbol(node.fake, "nvmlDeviceRegisterEvents", lambda handle, mask, es: 3)
    monitor = node.start()
    eventually(lambda: monitor.running, what="threads up")
    assert node.board.snapshot() == {}
    node.fake.set_lost(SM)  # the probe still notices a lost GPU
    monitor.tick()
    assert node.domains(SM) == {FaultDomain.GPU}


# ---- storm, transitions ----------------------------------------------------------------------


def test_storm_of_1000_xids_ends_in_the_right_state(make_node: MakeNode) -> None:
    node = make_node()
    monitor = node.start()
    changes: list[int] = []
    node.board.subscribe(lambda: changes.append(node.board.version))
    for n in range(1000):
        # Application Xids on the time-slicing and sm-sharing GPUs, alternating.
        node.fake.inject_xid(TS if n % 2 else SM, 43 if n % 3 else 31, notify=False)
    eventually(lambda: monitor.events_seen >= 1000, what="every event handled")
    assert monitor.running
    assert node.domains(TS) == set() and node.domains(EX) == set()
    assert node.domains(SM) == {FaultDomain.MPS_SERVER}
    assert node.cause(SM, FaultDomain.MPS_SERVER) == "xid=31 class=application"  # the first
    assert len(changes) == 1  # one fault, no churn
    node.fake.inject_xid(EX, 79)  # still listening
    eventually(lambda: node.domains(EX) == {FaultDomain.GPU}, what="fault after the storm")


def test_transitions_reach_the_hook_and_the_state_file(make_node: MakeNode) -> None:
    node = make_node()
    broken: list[Transition] = []

    def hook(t: Transition) -> None:
        node.transitions.append(t)
        broken.append(t)
        raise RuntimeError("consumer bug")  # must not stop health updates

    monitor = node.start(on_transition=hook, wall=lambda: 1_700_000_000.0)
    node.fake.inject_xid(EX, 95)
    eventually(lambda: len(node.transitions) == 1, what="transition")
    t = node.transitions[0]
    assert t == Transition(
        node.uuid(EX),
        FaultDomain.GPU,
        "xid=95 class=reset",
        False,
        1_700_000_000.0,
        Mode.EXCLUSIVE,
        1,
    )

    def written() -> bool:
        gpu = health_state.read_health(node.state_dir)["gpus"][node.uuid(EX)]
        return bool(gpu["faults"]) and gpu["health"] == "Unhealthy"

    eventually(written, what="state file rewritten")
    gpu = health_state.read_health(node.state_dir)["gpus"][node.uuid(EX)]
    assert gpu["faults"]["gpu"]["cause"] == "xid=95 class=reset"
    assert gpu["faults"]["gpu"]["phase"] == "faulted"
    assert "xid=95 class=reset" in health_state.format_health_table(
        health_state.read_health(node.state_dir)
    )
    recover(node, monitor, EX)
    assert [x.healthy for x in broken] == [False, True]


# ---- with the real MPS supervisor over the simulated control daemon ------------------------


def test_application_xid_with_the_real_supervisor(make_node: MakeNode, short_tmp: Path) -> None:
    node = make_node()
    uuid = node.uuid(SM)
    binary = fake_mps.write_launcher(short_tmp / "nvidia-cuda-mps-control")
    node.cfg = dataclasses.replace(node.cfg, mps=MpsConfig(control_binary=str(binary)))
    root = short_tmp / "mps"
    timing = Timing(probe_interval=0.1, probe_timeout=3.0, command_timeout=15.0)
    sup = MpsSupervisor(root, lambda: node.cfg, node.board, None, timing=timing, multiuser=False)
    try:
        sup.sync(node.plan)
        sup.start()
        assert sup.wait_ready(uuid, 30), sup.snapshot()
        pipe = layout.pipe_dir(root, uuid)
        fake_mps.connect_client(pipe, 900, os.getuid())
        # The hardware: an application Xid faults that GPU's MPS server.
        node.fake.on_application_xid = lambda gpu: fake_mps.inject_fault(layout.pipe_dir(root, gpu))
        seen: list[set[GpuUuid]] = []
        node.board.subscribe(lambda: seen.append(set(node.board.snapshot())))
        node.start(
            mps_server_active=supervisor_server_active(sup),
            clock=time.monotonic,
            probe_interval=0.1,
            mps_settle=0.5,
        )
        node.fake.inject_xid(SM, 43)
        eventually(lambda: FaultDomain.MPS_SERVER in node.domains(SM), what="mps-server fault")
        eventually(
            lambda: (node.cause(SM, FaultDomain.MPS_SERVER) or "").startswith("mps-state=FAULT"),
            what="the supervisor sees the server in FAULT",
        )
        time.sleep(1.0)  # well past the settle: a FAULT server keeps the slices Unhealthy
        assert node.health(SM) is Health.UNHEALTHY
        fake_mps.recover(pipe)
        eventually(lambda: node.domains(SM) == set(), what="healthy once ACTIVE again")
        assert all(s <= {uuid} for s in seen), "another GPU changed"
    finally:
        sup.stop()
        sup.stop_daemons(force=True)


def test_application_xid_is_not_cleared_by_a_probe_from_before_it(
    make_node: MakeNode, short_tmp: Path
) -> None:
    # The supervisor's last probe (ACTIVE) predates the Xid; the next one is an hour away.
    # Before, READY alone cleared the fault once the settle passed.
    node = make_node()
    uuid = node.uuid(SM)
    binary = fake_mps.write_launcher(short_tmp / "nvidia-cuda-mps-control")
    node.cfg = dataclasses.replace(node.cfg, mps=MpsConfig(control_binary=str(binary)))
    root = short_tmp / "mps"
    timing = Timing(probe_interval=3600.0, probe_timeout=3.0, command_timeout=15.0)
    sup = MpsSupervisor(root, lambda: node.cfg, node.board, None, timing=timing, multiuser=False)
    try:
        sup.sync(node.plan)
        sup.start()
        assert sup.wait_ready(uuid, 30), sup.snapshot()
        eventually(lambda: sup.snapshot()[uuid].probed_at is not None, what="a first probe")
        node.start(
            mps_server_active=supervisor_server_active(sup),
            clock=time.monotonic,
            probe_interval=0.05,
            mps_settle=0.0,
        )
        node.fake.inject_xid(SM, 43)
        eventually(lambda: FaultDomain.MPS_SERVER in node.domains(SM), what="mps-server fault")
        time.sleep(0.5)  # many monitor ticks, no new supervisor probe
        assert FaultDomain.MPS_SERVER in node.domains(SM)
        sup._workers[uuid].wake.set()  # a probe now, after the Xid: ACTIVE (no server)
        eventually(lambda: node.domains(SM) == set(), what="cleared by a fresh probe")
    finally:
        sup.stop()
        sup.stop_daemons(force=True)
