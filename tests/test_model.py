from __future__ import annotations

import pytest

from deviceplugin.health.board import HealthBoard, device_health
from deviceplugin.model import FaultDomain, GpuUuid, Health, Mode, slice_id, split_slice_id


def test_slice_ids_round_trip() -> None:
    gpu = GpuUuid("GPU-12345678-1234-1234-1234-123456789abc")
    sid = slice_id(gpu, 17)
    assert sid == f"{gpu}::17" and len(sid) <= 63
    assert split_slice_id(sid) == (gpu, 17)
    assert split_slice_id(gpu) == (gpu, None)
    for bad in (f"{gpu}::", f"{gpu}::x", f"{gpu}::01", f"{gpu}::-1"):
        with pytest.raises(ValueError):
            split_slice_id(bad)


@pytest.mark.parametrize(
    ("mode", "faults", "allocated", "expected"),
    [
        (Mode.TIME_SLICING, set(), False, Health.HEALTHY),
        (Mode.TIME_SLICING, {FaultDomain.MPS_SERVER}, False, Health.HEALTHY),
        (Mode.EXCLUSIVE, {FaultDomain.MPS_DAEMON}, False, Health.HEALTHY),
        (Mode.SM_SHARING, {FaultDomain.MPS_SERVER}, True, Health.UNHEALTHY),
        (Mode.SM_SHARING, {FaultDomain.MPS_DAEMON}, False, Health.UNHEALTHY),
        (Mode.SM_SHARING, {FaultDomain.CLIENT_LIMIT}, False, Health.UNHEALTHY),
        (Mode.SM_SHARING, {FaultDomain.CLIENT_LIMIT}, True, Health.HEALTHY),
        (Mode.EXCLUSIVE, {FaultDomain.GPU}, True, Health.UNHEALTHY),
        (Mode.TIME_SLICING, {FaultDomain.MONITOR}, False, Health.UNHEALTHY),
    ],
)
def test_device_health_follows_fault_domains(
    mode: Mode, faults: set[FaultDomain], allocated: bool, expected: Health
) -> None:
    assert device_health(mode, faults, allocated) is expected


def test_board_notifies_on_change_only() -> None:
    board = HealthBoard(clock=lambda: 100.0)
    calls: list[int] = []
    unsubscribe = board.subscribe(lambda: calls.append(board.version))
    gpu = GpuUuid("GPU-a")
    assert board.set(gpu, FaultDomain.GPU, "xid=79")
    assert not board.set(gpu, FaultDomain.GPU, "xid=79")
    assert board.faults(gpu)[FaultDomain.GPU].since == 100.0
    assert board.clear(gpu, FaultDomain.GPU)
    assert not board.clear(gpu, FaultDomain.GPU)
    unsubscribe()
    board.set(gpu, FaultDomain.MPS_DAEMON, "dead")
    assert calls == [1, 2]
