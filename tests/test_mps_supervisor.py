"""MpsSupervisor against the simulated control binary: real daemons in temp dirs."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.config.settings import Config, MpsConfig
from deviceplugin.health.board import HealthBoard
from deviceplugin.inventory.gpus import Gpu
from deviceplugin.model import GIB, Enforcement, FaultDomain, GpuUuid, Mode, ResourceName, slice_id
from deviceplugin.mps import layout
from deviceplugin.mps.control import MpsControl
from deviceplugin.mps.shm import ShmState
from deviceplugin.mps.supervisor import (
    DaemonState,
    MpsSupervisor,
    Timing,
    backoff_delay,
)
from deviceplugin.plan import GpuPlan, SlicePlan
from deviceplugin.plumbing.process import pid_alive
from deviceplugin.simulate import mps_control as fake

GPU_A = GpuUuid("GPU-aaaaaaaa-2222-3333-4444-555555555555")
GPU_B = GpuUuid("GPU-bbbbbbbb-2222-3333-4444-555555555555")
FAST = Timing(
    probe_interval=0.1,
    probe_timeout=3.0,
    command_timeout=15.0,
    backoff_base=0.2,
    backoff_max=5.0,
)


def gpu_plan(uuid: GpuUuid, mode: Mode = Mode.SM_SHARING, usable_gib: int = 10) -> GpuPlan:
    gpu = Gpu(0, uuid, "NVIDIA H200", 16 * GIB, 0, "0000:01:00.0", 0, (9, 0), False, 0)
    return GpuPlan(
        gpu=gpu,
        mode=mode,
        resource=ResourceName(f"example.com/{mode.value}"),
        slice_size=GIB,
        reserved=(16 - usable_gib) * GIB,
        usable=usable_gib * GIB,
        device_ids=tuple(slice_id(uuid, i) for i in range(usable_gib)),
        enforcement=(Enforcement.MPS_PINNED_LIMIT,),
        reclaimable=False,
    )


def slice_plan(*plans: GpuPlan) -> SlicePlan:
    return SlicePlan(gpus=plans, resources=tuple(sorted({p.resource for p in plans})))


@dataclass
class RecordingModes:
    """ComputeModes fake: remembers every set, starts each GPU at `initial`."""

    initial: int = 0
    modes: dict[GpuUuid, int] = field(default_factory=dict)
    sets: list[tuple[GpuUuid, int]] = field(default_factory=list)

    def get_compute_mode(self, uuid: GpuUuid) -> int:
        return self.modes.get(uuid, self.initial)

    def set_compute_mode(self, uuid: GpuUuid, mode: int) -> None:
        self.sets.append((uuid, mode))
        self.modes[uuid] = mode


@dataclass
class Rig:
    root: Path
    binary: Path
    board: HealthBoard
    modes: RecordingModes
    config: Config
    sups: list[MpsSupervisor] = field(default_factory=list)

    def supervisor(
        self,
        timing: Timing = FAST,
        multiuser: bool | None = False,
        shm: dict[GpuUuid, ShmState] | None = None,
    ) -> MpsSupervisor:
        sup = MpsSupervisor(
            self.root,
            lambda: self.config,
            self.board,
            self.modes,
            timing=timing,
            multiuser=multiuser,
            shm_states=None if shm is None else (lambda: shm),
        )
        self.sups.append(sup)
        return sup

    def mps(self, **changes: Any) -> None:
        self.config = dataclasses.replace(
            self.config, mps=dataclasses.replace(self.config.mps, **changes)
        )

    def ctl(self, gpu: GpuUuid = GPU_A) -> MpsControl:
        return MpsControl(str(self.binary), self.root, gpu)

    def pid(self, gpu: GpuUuid = GPU_A) -> int:
        pid = layout.read_pid(self.root, gpu)
        assert pid is not None
        return pid

    def faults(self, gpu: GpuUuid = GPU_A) -> set[FaultDomain]:
        return set(self.board.faults(gpu))


def wait_until(cond: Callable[[], bool], timeout: float = 20.0, what: str = "") -> float:
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - start


def kill_everything(root: Path) -> None:
    pids = {layout.read_pid(root, g) for g in layout.known_gpus(root)}
    for gpu in layout.known_gpus(root):
        marker = layout.read_marker(root, gpu)
        if marker is not None:
            pids.add(marker.pid)
    for pid in pids - {None}:
        assert pid is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def rig(short_tmp: Path) -> Iterator[Rig]:
    with rig_in(short_tmp) as r:
        yield r


@contextlib.contextmanager
def rig_in(short_tmp: Path) -> Iterator[Rig]:
    """A rig under `short_tmp`; every supervisor stopped and daemon killed on exit."""
    binary = fake.write_launcher(short_tmp / "nvidia-cuda-mps-control")
    config = Config(mps=MpsConfig(control_binary=str(binary), active_thread_percentage=25))
    r = Rig(short_tmp / "mps", binary, HealthBoard(), RecordingModes(), config)
    try:
        yield r
    finally:
        for sup in r.sups:
            sup.stop()
        kill_everything(r.root)


def started(rig: Rig, *plans: GpuPlan, **kw: object) -> MpsSupervisor:
    sup = rig.supervisor(**kw)  # type: ignore[arg-type]
    sup.sync(slice_plan(*(plans or (gpu_plan(GPU_A),))))
    sup.start()
    for plan in plans or (gpu_plan(GPU_A),):
        if plan.mode is Mode.SM_SHARING:
            assert sup.wait_ready(plan.uuid, 30), sup.snapshot()
    return sup


def test_backoff_delays() -> None:
    assert [backoff_delay(n, 1.0, 30.0) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


def test_start_with_verified_settings(rig: Rig) -> None:
    sup = rig.supervisor()
    sup.sync(slice_plan(gpu_plan(GPU_A, usable_gib=10)))
    assert FaultDomain.MPS_DAEMON in rig.faults()  # fail closed until the daemon is verified
    assert not sup.ensure(GPU_A)
    sup.start()
    assert sup.wait_ready(GPU_A, 30)
    assert sup.ensure(GPU_A)
    assert rig.faults() == set()
    assert rig.ctl().read_defaults(timeout=10) == (10 * 1024, 25.0)
    assert rig.modes.sets == [(GPU_A, 3)]
    snap = sup.snapshot()[GPU_A]
    assert snap.state is DaemonState.READY and snap.pid == rig.pid() and snap.restarts == 0
    assert snap.settings is not None and snap.settings.pinned_limit_mib == 10 * 1024
    marker = layout.read_marker(rig.root, GPU_A)
    assert marker is not None and marker.pid == rig.pid() and marker.compute_mode_set
    env = (Path("/proc") / str(rig.pid()) / "environ").read_bytes().split(b"\0")
    assert f"CUDA_VISIBLE_DEVICES={GPU_A}".encode() in env
    assert not sup.ensure(GPU_B)  # not an sm-sharing GPU of the plan


def test_sigkill_unhealthy_fast_restarted_with_growing_backoff(rig: Rig) -> None:
    sup = started(rig)
    backoffs = []
    for _ in range(3):
        old = rig.pid()
        os.kill(old, signal.SIGKILL)
        wait_until(lambda: FaultDomain.MPS_DAEMON in rig.faults(), 2.0, "Unhealthy within 2 s")
        assert "daemon-dead" in rig.board.faults(GPU_A)[FaultDomain.MPS_DAEMON].cause
        wait_until(lambda: sup.snapshot()[GPU_A].state is DaemonState.READY, what="restart")
        wait_until(lambda: rig.faults() == set(), what="Healthy again")
        assert rig.pid() != old
        backoffs.append(sup.snapshot()[GPU_A].backoff)
    assert backoffs == [0.2, 0.4, 0.8]
    assert sup.snapshot()[GPU_A].restarts == 3
    assert rig.ctl().read_defaults(timeout=10) == (10 * 1024, 25.0)


def test_backoff_resets_after_stable_period(rig: Rig) -> None:
    sup = started(rig, timing=dataclasses.replace(FAST, stable_reset=0.5))
    for _ in range(2):
        os.kill(rig.pid(), signal.SIGKILL)
        wait_until(lambda: FaultDomain.MPS_DAEMON in rig.faults(), what="dead")
        wait_until(lambda: rig.faults() == set(), what="Healthy again")
        assert sup.snapshot()[GPU_A].backoff == 0.2
        time.sleep(0.6)


def test_wedged_daemon_detected_then_recovers(rig: Rig) -> None:
    sup = started(rig, timing=dataclasses.replace(FAST, probe_timeout=0.5))
    pid = rig.pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(lambda: FaultDomain.MPS_DAEMON in rig.faults(), 10, "wedge detected")
        assert "daemon-wedged" in rig.board.faults(GPU_A)[FaultDomain.MPS_DAEMON].cause
        assert sup.snapshot()[GPU_A].state is DaemonState.WEDGED
        assert not sup.ensure(GPU_A)
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: rig.faults() == set(), what="recovered")
    assert rig.pid() == pid  # not restarted: a wedge that clears keeps the daemon


def test_wedged_daemon_without_clients_killed_after_grace(rig: Rig) -> None:
    timing = dataclasses.replace(FAST, probe_timeout=0.5, wedge_kill_after=1.0)
    sup = started(rig, timing=timing)
    pid = rig.pid()
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: not pid_alive(pid), what="wedged daemon killed")
    wait_until(lambda: rig.faults() == set() and rig.pid() != pid, what="restarted")
    assert sup.snapshot()[GPU_A].restarts == 1


def test_server_fault_unhealthy_until_active(rig: Rig) -> None:
    started(rig)
    pipe = layout.pipe_dir(rig.root, GPU_A)
    fake.connect_client(pipe, 900, os.getuid())
    fake.inject_fault(pipe)
    wait_until(lambda: FaultDomain.MPS_SERVER in rig.faults(), 5, "FAULT seen")
    assert "mps-state=FAULT" in rig.board.faults(GPU_A)[FaultDomain.MPS_SERVER].cause
    assert FaultDomain.MPS_DAEMON not in rig.faults()
    time.sleep(0.3)
    assert FaultDomain.MPS_SERVER in rig.faults()  # stays while FAULT
    fake.recover(pipe)
    wait_until(lambda: rig.faults() == set(), what="ACTIVE again")


SUPERVISOR_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from deviceplugin.config.settings import Config, MpsConfig
    from deviceplugin.health.board import HealthBoard
    from deviceplugin.mps.supervisor import MpsSupervisor, Timing
    from tests.test_mps_supervisor import GPU_A, gpu_plan, slice_plan, FAST, RecordingModes

    root, binary = Path(sys.argv[1]), sys.argv[2]
    config = Config(mps=MpsConfig(control_binary=binary, active_thread_percentage=25))
    sup = MpsSupervisor(root, lambda: config, HealthBoard(), RecordingModes(), timing=FAST,
                        multiuser=False)
    sup.sync(slice_plan(gpu_plan(GPU_A)))
    sup.start()
    assert sup.wait_ready(GPU_A, 60)
    print(sup.snapshot()[GPU_A].pid, flush=True)
    time.sleep(600)
    """
)


def test_process_group_killed_new_supervisor_adopts_same_pid(rig: Rig) -> None:
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR_SCRIPT, str(rig.root), str(rig.binary)],
        cwd=repo,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group, so killing it spares pytest
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        pid = int(line)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # what a container restart does
        proc.wait()
    time.sleep(0.2)
    assert pid_alive(pid), "the daemon must outlive the plugin's process group"
    sup = started(rig)
    snap = sup.snapshot()[GPU_A]
    assert snap.pid == pid and snap.restarts == 0
    log = layout.control_log(rig.root, GPU_A).read_text()
    assert log.count("Starting control daemon") == 1
    assert rig.modes.sets == []  # adoption changes nothing


def test_settings_change_without_clients_restarts(rig: Rig) -> None:
    sup = started(rig)
    old = rig.pid()
    sup.sync(slice_plan(gpu_plan(GPU_A, usable_gib=6)))
    wait_until(lambda: layout.read_pid(rig.root, GPU_A) not in (None, old), what="restart")
    wait_until(lambda: sup.snapshot()[GPU_A].state is DaemonState.READY, what="ready")
    assert rig.ctl().read_defaults(timeout=10) == (6 * 1024, 25.0)
    assert not sup.snapshot()[GPU_A].settings_pending


def test_settings_change_with_clients_waits_for_them(rig: Rig) -> None:
    sup = started(rig)
    old = rig.pid()
    pipe = layout.pipe_dir(rig.root, GPU_A)
    fake.connect_client(pipe, 901, os.getuid())
    rig.mps(active_thread_percentage=50)
    sup.sync(slice_plan(gpu_plan(GPU_A)))
    wait_until(lambda: sup.snapshot()[GPU_A].settings_pending, what="pending")
    time.sleep(1.0)  # many probes: still the same daemon, still Healthy
    assert rig.pid() == old and rig.faults() == set()
    fake.disconnect_client(pipe, 901)
    wait_until(lambda: layout.read_pid(rig.root, GPU_A) not in (None, old), what="restart")
    wait_until(lambda: sup.snapshot()[GPU_A].state is DaemonState.READY, what="ready")
    assert rig.ctl().read_defaults(timeout=10) == (10 * 1024, 50.0)


def test_adoption_with_different_settings_and_clients_keeps_daemon(rig: Rig) -> None:
    first = started(rig)
    pid = rig.pid()
    first.stop()
    fake.connect_client(layout.pipe_dir(rig.root, GPU_A), 902, os.getuid())
    rig.mps(active_thread_percentage=60)
    second = started(rig)
    snap = second.snapshot()[GPU_A]
    assert snap.pid == pid and snap.settings_pending
    assert rig.faults() == set()


def test_second_uid_single_uid_mode_reported_not_silent(rig: Rig) -> None:
    started(rig, multiuser=False)
    pipe = layout.pipe_dir(rig.root, GPU_A)
    fake.connect_client(pipe, 910, 1000)
    fake.connect_client(pipe, 911, 1001)  # queued behind uid 1000
    wait_until(lambda: FaultDomain.MPS_SERVER in rig.faults(), 5, "uid conflict")
    cause = rig.board.faults(GPU_A)[FaultDomain.MPS_SERVER].cause
    assert "uid-conflict" in cause and "waiting=1001" in cause
    fake.disconnect_client(pipe, 910)  # uid 1001 gets its server
    wait_until(lambda: rig.faults() == set(), what="conflict cleared")


def test_second_uid_multi_user_mode_shares_server(rig: Rig) -> None:
    sup = started(rig, multiuser=True)
    cmdline = (Path("/proc") / str(rig.pid()) / "cmdline").read_bytes().split(b"\0")
    assert b"-multiuser-server" in cmdline
    pipe = layout.pipe_dir(rig.root, GPU_A)
    fake.connect_client(pipe, 920, 1000)
    fake.connect_client(pipe, 921, 1001)
    [server] = rig.ctl().server_list(timeout=10)
    assert rig.ctl().client_count([server], timeout=10) == 2
    time.sleep(0.5)
    assert rig.faults() == set()
    assert sup.snapshot()[GPU_A].tenant_mode.value == "multi-user"


def test_stop_leaves_daemons_running(rig: Rig) -> None:
    sup = started(rig)
    pid = rig.pid()
    sup.stop()
    sup.stop()  # idempotent
    time.sleep(0.3)
    assert pid_alive(pid)
    assert rig.ctl().server_list(timeout=10) == []


def test_stop_daemons_all_restores_default_where_set(rig: Rig) -> None:
    rig.modes.modes[GPU_B] = 3  # already EXCLUSIVE_PROCESS before us: not ours to restore
    sup = started(rig, gpu_plan(GPU_A), gpu_plan(GPU_B))
    pids = [rig.pid(GPU_A), rig.pid(GPU_B)]
    assert rig.modes.sets == [(GPU_A, 3)]
    sup.stop()  # the plugin is stopped first; a running one would restart what `mps stop` quits
    other = rig.supervisor()  # what `mps stop --all` builds in a fresh process
    results = other.stop_daemons(None)
    assert set(results) == {GPU_A, GPU_B}
    assert all(not pid_alive(p) for p in pids)
    assert rig.modes.sets == [(GPU_A, 3), (GPU_A, 0)]
    assert rig.modes.modes == {GPU_A: 0, GPU_B: 3}
    assert layout.read_marker(rig.root, GPU_A) is None


def test_stop_daemons_keeps_one_with_clients_unless_forced(rig: Rig) -> None:
    started(rig).stop()
    pid = rig.pid()
    fake.connect_client(layout.pipe_dir(rig.root, GPU_A), 930, os.getuid())
    other = rig.supervisor()
    assert other.stop_daemons([GPU_A])[GPU_A].startswith("kept")
    assert pid_alive(pid)
    assert other.stop_daemons([GPU_A], force=True)[GPU_A].startswith("stopped")
    wait_until(lambda: not pid_alive(pid), what="quit")


def test_default_pinned_limit_is_a_setting(rig: Rig) -> None:
    # mps.defaultPinnedMemoryLimit: the most a client can raise its own limit to (issue 33).
    rig.mps(default_pinned_memory_limit=3 * GIB)
    sup = started(rig, gpu_plan(GPU_A, usable_gib=10))
    assert rig.ctl().read_defaults(timeout=10)[0] == 3 * 1024
    first = rig.pid()
    # Never above the usable memory; a change restarts a daemon without clients.
    rig.mps(default_pinned_memory_limit=64 * GIB)
    sup.sync(slice_plan(gpu_plan(GPU_A, usable_gib=10)))
    wait_until(lambda: layout.read_pid(rig.root, GPU_A) not in (None, first), what="restart")
    wait_until(lambda: sup.snapshot()[GPU_A].state is DaemonState.READY, what="ready")
    assert rig.ctl().read_defaults(timeout=10)[0] == 10 * 1024


def test_set_compute_mode_false_leaves_modes_untouched(rig: Rig) -> None:
    rig.mps(set_compute_mode=False)
    sup = started(rig, gpu_plan(GPU_A), gpu_plan(GPU_B, Mode.TIME_SLICING))
    rig.modes.modes[GPU_B] = 3
    sup.sync(slice_plan(gpu_plan(GPU_A), gpu_plan(GPU_B, Mode.TIME_SLICING)))
    sup.stop_daemons(None)
    assert rig.modes.sets == []


def test_gpu_leaving_sm_sharing_is_retired_and_defaulted(rig: Rig) -> None:
    rig.modes.modes[GPU_B] = 3
    sup = started(rig, gpu_plan(GPU_A), gpu_plan(GPU_B, Mode.TIME_SLICING))
    assert (GPU_B, 0) in rig.modes.sets  # time-slicing GPUs run in DEFAULT
    pid = rig.pid()
    sup.sync(slice_plan(gpu_plan(GPU_A, Mode.TIME_SLICING), gpu_plan(GPU_B, Mode.TIME_SLICING)))
    wait_until(lambda: not pid_alive(pid), what="daemon quit")
    assert rig.modes.modes[GPU_A] == 0
    assert sup.snapshot() == {}
    assert rig.faults() == set()


def test_ensure_is_non_blocking_and_wait_ready_blocks(rig: Rig) -> None:
    sup = rig.supervisor()
    sup.sync(slice_plan(gpu_plan(GPU_A)))
    assert not sup.wait_ready(GPU_A, 0.2)  # not started yet
    sup.start()
    seen: list[bool] = []
    waiter = threading.Thread(target=lambda: seen.append(sup.wait_ready(GPU_A, 30)))
    waiter.start()
    t0 = time.monotonic()
    sup.ensure(GPU_A)
    assert time.monotonic() - t0 < 5  # liveness only: ensure returns without the daemon
    waiter.join()
    assert seen == [True]
    assert sup.ensure(GPU_A)
    assert rig.ctl().read_defaults(timeout=10)[0] == 10 * 1024


def test_stop_all_restores_default_through_fake_nvml(rig: Rig) -> None:
    import pynvml

    from deviceplugin.inventory.nvml import NvmlSession
    from deviceplugin.simulate.nvml import FakeNvml
    from deviceplugin.simulate.specs import load_spec

    spec = load_spec("h200x2")
    nvml = FakeNvml(spec)
    before = pynvml.nvmlLib
    nvml.install()
    try:
        with NvmlSession.open() as session:
            uuid = GpuUuid(spec.gpus[0].uuid)
            assert nvml.compute_mode(uuid) == 0
            sup = MpsSupervisor(
                rig.root, lambda: rig.config, rig.board, session, timing=FAST, multiuser=False
            )
            rig.sups.append(sup)
            sup.sync(slice_plan(gpu_plan(uuid)))
            sup.start()
            assert sup.wait_ready(uuid, 30)
            assert nvml.compute_mode(uuid) == 3
            pid = rig.pid(uuid)
            sup.stop()
            assert pid_alive(pid)
            results = sup.stop_daemons(None)
            assert results[uuid].startswith("stopped")
            assert nvml.compute_mode(uuid) == 0
            assert not pid_alive(pid)
    finally:
        nvml.uninstall()
        assert pynvml.nvmlLib is before
