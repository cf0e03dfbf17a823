"""What the supervisor must prove before it trusts a daemon (DESIGN 3b), against the
simulated control binary: memory accounting read back before borrowed memory counts as
reclaimable; an application-Xid fault cleared only on ACTIVE for every listed server;
cheap probes (one control-client run each, a wedge only after `probeFailures` in a row); the
daemon's logs kept under `maxLogBytes` by truncating in place."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from deviceplugin import caps
from deviceplugin.config.settings import Config
from deviceplugin.model import GIB, FaultDomain, GpuUuid
from deviceplugin.mps import layout
from deviceplugin.mps.control import ServerState, parse_probe
from deviceplugin.mps.supervisor import DaemonState, supervisor_server_active
from deviceplugin.plan import GpuPlan
from deviceplugin.simulate import mps_control as fake
from tests.test_mps_supervisor import (
    FAST,
    GPU_A,
    Rig,
    gpu_plan,
    rig_in,
    started,
    wait_until,
)


@pytest.fixture
def rig(short_tmp: Path) -> Iterator[Rig]:
    with rig_in(short_tmp) as r:
        yield r


def control_log(rig: Rig) -> str:
    return layout.control_log(rig.root, GPU_A).read_text()


# --- reclaim needs proof -------------------------------------------------------------------


def reclaimable_plan() -> GpuPlan:
    return dataclasses.replace(gpu_plan(GPU_A), reclaimable=True)


def test_protocol_3_reads_memory_accounting_back(rig: Rig) -> None:
    rig.mps(protocol_version=3)
    sup = started(rig)
    assert sup.snapshot()[GPU_A].memory_accounting
    assert sup.memory_accounting(GPU_A)
    assert "Cmd:get_memory_accounting" in control_log(rig)
    gp = caps.reclaimable(reclaimable_plan(), sup.memory_accounting)
    ceiling = caps.apply_ceiling(Config(), gp, GIB, 4 * GIB, "pod")
    assert (ceiling.limit, ceiling.policy) == (4 * GIB, "applied")


def test_refused_memory_accounting_is_not_reclaimable(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    fake.write_launcher(rig.binary, refuse_memory_accounting=True)
    rig.mps(protocol_version=3)
    with caplog.at_level(logging.WARNING, logger="gpu-fraction.mps"):
        sup = started(rig)
    assert not sup.memory_accounting(GPU_A)
    assert any("memory accounting not confirmed" in r.getMessage() for r in caplog.records)
    # The plan says protocol 3; without the readback the ceiling is ignored and recorded so.
    gp = caps.reclaimable(reclaimable_plan(), sup.memory_accounting)
    assert not gp.reclaimable
    ceiling = caps.apply_ceiling(Config(), gp, GIB, 4 * GIB, "pod")
    assert (ceiling.limit, ceiling.policy) == (GIB, "ignored: no-reclaim")


def test_protocol_2_never_claims_accounting(rig: Rig) -> None:
    sup = started(rig)
    assert not sup.memory_accounting(GPU_A)
    assert "memory_accounting" not in control_log(rig)
    assert caps.reclaimable(reclaimable_plan(), None).reclaimable is False


# --- FAULT clears only on ACTIVE -----------------------------------------------------------


def test_parse_probe_reads_list_then_states() -> None:
    got = parse_probe("101\n102\nACTIVE\nFAULT\n", [101, 102])
    assert got.servers == [101, 102]
    assert got.states == {101: ServerState.ACTIVE, 102: ServerState.FAULT}
    odd = parse_probe("101\nACTIVE (recovering)\n", [101])
    assert odd.states == {101: ServerState.UNKNOWN}
    assert odd.raw == {101: "ACTIVE (recovering)"}


def test_server_active_needs_every_listed_server_active(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    sup = started(rig)
    check = supervisor_server_active(sup)

    def active(gpu: GpuUuid, since: float = 0.0) -> bool | None:
        return check(gpu, since)

    pipe = layout.pipe_dir(rig.root, GPU_A)
    # A daemon listing no server has no faulted one; but only a probe after the Xid counts.
    wait_until(lambda: sup.snapshot()[GPU_A].server_states is not None, what="a probe")
    assert active(GPU_A) is True
    assert active(GPU_A, sup.clock() + 3600) is None
    fake.connect_client(pipe, 4242, os.getuid())
    fake.inject_fault(pipe)
    xid_at = sup.clock()
    wait_until(lambda: active(GPU_A, xid_at) is False, what="FAULT seen after the Xid")
    fake.recover(pipe)
    wait_until(lambda: active(GPU_A) is True, what="ACTIVE again")
    # Output the parser does not know keeps the fault and is logged verbatim, once.
    with caplog.at_level(logging.WARNING, logger="gpu-fraction.mps"):
        fake.force_server_status(pipe, "RECOVERING after fault")
        wait_until(lambda: active(GPU_A) is False, what="unknown state read")
        probes = sup.snapshot()[GPU_A]
        wait_until(lambda: control_log(rig).count("RECOVERING") >= 6, what="more probes")
    assert active(GPU_A) is False and probes.state is DaemonState.READY
    logged = [r for r in caplog.records if "not recognised" in r.getMessage()]
    assert len(logged) == 1
    assert logged[0].kv["output"] == repr("RECOVERING after fault")  # type: ignore[attr-defined]
    fake.force_server_status(pipe, None)
    wait_until(lambda: active(GPU_A) is True, what="ACTIVE after the odd output")
    fake.disconnect_client(pipe, 4242)


# --- cheap, steady probes ------------------------------------------------------------------


def test_one_probe_is_one_control_client_run(rig: Rig) -> None:
    sup = started(rig, timing=dataclasses.replace(FAST, probe_interval=0.2))
    pipe = layout.pipe_dir(rig.root, GPU_A)
    fake.connect_client(pipe, 4242, os.getuid())
    wait_until(lambda: bool(sup.snapshot()[GPU_A].server_states), what="server states")
    sessions = control_log(rig).count("NEW UI")
    lists = control_log(rig).count("Cmd:get_server_list")
    wait_until(lambda: control_log(rig).count("Cmd:get_server_list") >= lists + 5, what="probes")
    sessions_after = control_log(rig).count("NEW UI")
    lists_after = control_log(rig).count("Cmd:get_server_list")
    # Every session in between was one probe, listing servers and asking their state.
    assert sessions_after - sessions == lists_after - lists
    fake.disconnect_client(pipe, 4242)


def test_probe_interval_comes_from_config(rig: Rig) -> None:
    rig.mps(probe_interval=7.5, probe_failures=4)
    sup = rig.supervisor(timing=dataclasses.replace(FAST, probe_interval=None))
    assert (sup.probe_interval(), sup.probe_failures()) == (7.5, 4)
    assert Config().mps.probe_interval == 5.0 and Config().mps.probe_failures == 3


def test_a_wedge_needs_failures_in_a_row_and_a_dead_pid_counts_at_once(rig: Rig) -> None:
    rig.mps(probe_failures=3)
    timing = dataclasses.replace(FAST, probe_timeout=0.3, probe_interval=0.3, probe_failures=None)
    sup = started(rig, timing=timing)
    pid = rig.pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        # Two failures in a row: still READY, no fault.
        wait_until(lambda: sup._workers[GPU_A].probe_failures >= 1, what="a failed probe")
        assert FaultDomain.MPS_DAEMON not in rig.faults()
        wait_until(lambda: FaultDomain.MPS_DAEMON in rig.faults(), what="wedge")
        assert sup._workers[GPU_A].probe_failures >= 3
        assert sup.snapshot()[GPU_A].state is DaemonState.WEDGED
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: FaultDomain.MPS_DAEMON not in rig.faults(), what="answers again")
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: sup.snapshot()[GPU_A].state is not DaemonState.READY, what="dead")
    assert sup.snapshot()[GPU_A].failures >= 1  # dead at the first probe: a restart follows


def test_logs_stay_under_max_log_bytes(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    sup = started(rig, timing=dataclasses.replace(FAST, probe_interval=0.05))
    worker = sup._workers[GPU_A]
    log_dir = layout.log_dir(rig.root, GPU_A)
    log = layout.control_log(rig.root, GPU_A)

    def total() -> int:
        return sum(f.stat().st_size for f in log_dir.iterdir())

    # Growth per probe, measured on the simulated daemon that logs every session.
    before, probes = total(), worker.probes
    wait_until(lambda: worker.probes >= probes + 10, what="probes")
    per_probe = (total() - before) / (worker.probes - probes)
    assert per_probe > 50  # each probe leaves its session in the log, as the real daemon does
    cap = int(per_probe * 20)
    rig.mps(max_log_bytes=cap)
    inode = log.stat().st_ino
    sizes: list[int] = []
    start = worker.probes
    with caplog.at_level(logging.INFO, logger="gpu-fraction.mps"):
        # 60 probes would grow the logs to 3x the cap without it.
        def sampled() -> bool:
            sizes.append(total())
            return worker.probes >= start + 60

        wait_until(sampled, 180, what="probes")
    assert max(sizes) < cap + 3 * per_probe
    assert any("mps logs truncated" in r.getMessage() for r in caplog.records)
    # Truncated in place: the same file, appended to from zero, never renamed or rotated.
    assert log.stat().st_ino == inode
    assert {p.name for p in log_dir.iterdir()} <= {"control.log", "server.log"}


def test_an_unrecognised_status_keeps_the_supervisors_fault(rig: Rig) -> None:
    sup = started(rig)
    pipe = layout.pipe_dir(rig.root, GPU_A)
    fake.connect_client(pipe, 4242, os.getuid())
    fake.inject_fault(pipe)
    wait_until(lambda: FaultDomain.MPS_SERVER in rig.faults(), what="FAULT seen")
    fake.force_server_status(pipe, "RECOVERING")
    fake.recover(pipe)
    probes = sup._workers[GPU_A].probes
    wait_until(lambda: sup._workers[GPU_A].probes >= probes + 5, what="probes")
    assert FaultDomain.MPS_SERVER in rig.faults()
    fake.force_server_status(pipe, None)
    wait_until(lambda: FaultDomain.MPS_SERVER not in rig.faults(), what="ACTIVE read")
    fake.disconnect_client(pipe, 4242)


def test_new_mps_keys_parse_and_refuse_by_path() -> None:
    from deviceplugin.config.settings import ConfigError, parse

    mps = parse(
        {
            "version": "v1",
            "mps": {
                "probeInterval": "2s",
                "probeFailures": 5,
                "maxLogBytes": "1Mi",
                "shmSize": "1Gi",
            },
        }
    ).mps
    assert (mps.probe_interval, mps.probe_failures, mps.max_log_bytes, mps.shm_size) == (
        2.0,
        5,
        1 << 20,
        1 << 30,
    )
    assert (Config().mps.shm_size, Config().mps.max_log_bytes) == (8 << 30, 8 << 20)
    with pytest.raises(ConfigError) as info:
        parse(
            {
                "version": "v1",
                "mps": {"probeInterval": 0, "probeFailures": 0, "maxLogBytes": "0", "shmSize": -1},
            }
        )
    paths = sorted(p.split(":")[0] for p in info.value.problems)
    assert paths == ["mps.maxLogBytes", "mps.probeFailures", "mps.probeInterval", "mps.shmSize"]
