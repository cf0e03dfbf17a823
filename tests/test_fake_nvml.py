"""The fake NVML driven through the REAL pynvml wrappers (reference nvml-mps-xid.md section 6)."""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest

from deviceplugin.inventory.nvml import handle_address
from deviceplugin.model import MIB
from deviceplugin.simulate.nvml import FakeNvml, XidClass, classify_xid
from deviceplugin.simulate.specs import parse_spec
from tests.conftest import MakeFake


@pytest.fixture
def fake(make_fake: MakeFake) -> FakeNvml:
    f = make_fake()
    pynvml.nvmlInit()
    return f


def _spec(**top: Any) -> Any:
    data: dict[str, Any] = {
        "driverVersion": "615.43.02",
        "gpus": [{"name": "NVIDIA H200", "memoryMiB": 143771, "count": 2}],
    }
    data.update(top)
    return parse_spec(data, source="test")


def _raises(code: int, call: Callable[[], object]) -> pynvml.NVMLError:
    with pytest.raises(pynvml.NVMLError) as info:
        call()
    assert info.value.value == code
    return info.value


# ---- init, shutdown, errors ---------------------------------------------------------------


def test_calls_before_init_are_uninitialized(make_fake: MakeFake) -> None:
    make_fake()
    err = _raises(1, pynvml.nvmlDeviceGetCount)
    assert isinstance(err, pynvml.NVMLError_Uninitialized)
    assert str(err) == "Uninitialized"


def test_python_side_uninitialized_without_any_library(make_fake: MakeFake) -> None:
    fake = make_fake()
    fake.uninstall()
    previous, pynvml.nvmlLib = pynvml.nvmlLib, None
    pynvml._nvmlGetFunctionPointer_cache.clear()
    try:
        assert str(_raises(1, pynvml.nvmlDeviceGetCount)) == "Uninitialized"
    finally:
        pynvml.nvmlLib = previous
        pynvml._nvmlGetFunctionPointer_cache.clear()


def test_init_is_reference_counted_and_extra_shutdowns_are_fine(make_fake: MakeFake) -> None:
    make_fake()
    _raises(1, pynvml.nvmlShutdown)  # never initialised
    pynvml.nvmlInit()
    pynvml.nvmlInit()
    pynvml.nvmlShutdown()
    assert pynvml.nvmlDeviceGetCount() == 2  # one init still holds
    pynvml.nvmlShutdown()
    _raises(1, pynvml.nvmlDeviceGetCount)  # after the final shutdown
    pynvml.nvmlShutdown()  # one too many: no error


def test_driver_not_loaded(make_fake: MakeFake) -> None:
    make_fake(init_error=9)
    err = _raises(9, pynvml.nvmlInit)
    assert isinstance(err, pynvml.NVMLError_DriverNotLoaded)
    assert str(err) == "Driver Not Loaded"


def test_error_string_lookup_goes_through_the_library(fake: FakeNvml) -> None:
    # Codes outside pynvml's own table are looked up with the C nvmlErrorString.
    assert str(pynvml.NVMLError(21)) == "No data"
    assert pynvml.nvmlErrorString(28) == "GPU not found"


# ---- identity -----------------------------------------------------------------------------


def test_identity_matches_the_spec(fake: FakeNvml) -> None:
    assert pynvml.nvmlSystemGetDriverVersion() == "615.43.02"
    assert pynvml.nvmlSystemGetCudaDriverVersion() == 13040
    assert pynvml.nvmlSystemGetCudaDriverVersion_v2() == 13040
    for sim in fake.spec.gpus:
        h = pynvml.nvmlDeviceGetHandleByIndex(sim.index)
        assert pynvml.nvmlDeviceGetUUID(h) == sim.uuid
        assert pynvml.nvmlDeviceGetName(h) == "NVIDIA H200"
        assert pynvml.nvmlDeviceGetMinorNumber(h) == sim.minor
        assert pynvml.nvmlDeviceGetCudaComputeCapability(h) == (9, 0)
        pci = pynvml.nvmlDeviceGetPciInfo(h)
        assert pci.busId == sim.pci_bus_id
        assert pci.busIdLegacy == sim.pci_bus_id[4:]
        assert pci.bus == int(sim.pci_bus_id.split(":")[1], 16)
        assert pci.pciDeviceId & 0xFFFF == 0x10DE


def test_handles_are_fresh_objects_with_one_address(fake: FakeNvml) -> None:
    a = pynvml.nvmlDeviceGetHandleByIndex(0)
    b = pynvml.nvmlDeviceGetHandleByUUID(fake.spec.gpus[0].uuid)
    assert a is not b
    assert handle_address(a) == handle_address(b)
    assert handle_address(a) != handle_address(pynvml.nvmlDeviceGetHandleByIndex(1))


def test_unknown_uuid_is_not_found_and_bad_input_invalid(fake: FakeNvml) -> None:
    err = _raises(6, lambda: pynvml.nvmlDeviceGetHandleByUUID("GPU-" + "0" * 8 + "-0000"))
    assert isinstance(err, pynvml.NVMLError_NotFound)
    assert str(err) == "Not Found"
    assert str(_raises(2, lambda: pynvml.nvmlDeviceGetHandleByUUID("nonsense"))) == (
        "Invalid Argument"
    )
    _raises(2, lambda: pynvml.nvmlDeviceGetHandleByIndex(2))


def test_memory_info_v1_counts_reserved_as_used_v2_does_not(fake: FakeNvml) -> None:
    fake.add_process(0, 4242, 3 * 1024 * MIB)
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    v1 = pynvml.nvmlDeviceGetMemoryInfo(h)
    v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    sim = fake.spec.gpus[0]
    assert v1.total == v2.total == 143771 * MIB
    assert v2.reserved == sim.memory_reserved > 0
    assert v2.used == 3 * 1024 * MIB
    assert v1.used == v2.used + v2.reserved
    assert v1.total == v1.free + v1.used
    assert v2.total == v2.free + v2.used + v2.reserved
    _raises(25, lambda: pynvml.nvmlDeviceGetMemoryInfo(h, version=2))


def test_mig_mode_not_supported_on_gpus_without_mig(make_fake: MakeFake) -> None:
    fake = make_fake("mixed")
    pynvml.nvmlInit()
    names = {g.index: g.name for g in fake.spec.gpus}
    for index, name in names.items():
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        if name == "NVIDIA L4":
            assert isinstance(
                _raises(3, lambda h=h: pynvml.nvmlDeviceGetMigMode(h)),
                pynvml.NVMLError_NotSupported,
            )
        else:
            assert pynvml.nvmlDeviceGetMigMode(h) == [0, 0]


# ---- lost GPU -----------------------------------------------------------------------------


def test_lost_gpu_raises_gpu_is_lost_and_blocks_every_handle_by_uuid(fake: FakeNvml) -> None:
    lost, healthy = fake.spec.gpus
    h_lost = pynvml.nvmlDeviceGetHandleByIndex(0)
    fake.set_lost(0)
    err = _raises(15, lambda: pynvml.nvmlDeviceGetMemoryInfo(h_lost))
    assert isinstance(err, pynvml.NVMLError_GpuIsLost)
    assert str(err) == "GPU is lost"
    assert err == pynvml.NVMLError_GpuIsLost()
    # NVML refuses GetHandleByUUID for EVERY GPU while one is lost, healthy ones included.
    _raises(15, lambda: pynvml.nvmlDeviceGetHandleByUUID(healthy.uuid))
    _raises(15, lambda: pynvml.nvmlDeviceGetHandleByUUID(lost.uuid))
    # The healthy GPU still answers through a handle resolved another way.
    h_ok = pynvml.nvmlDeviceGetHandleByIndex(1)
    assert pynvml.nvmlDeviceGetMemoryInfo(h_ok).total == healthy.memory_total
    fake.recover(0)
    assert pynvml.nvmlDeviceGetMemoryInfo(h_lost).total == lost.memory_total
    assert handle_address(pynvml.nvmlDeviceGetHandleByUUID(healthy.uuid)) == handle_address(h_ok)


def test_lost_state_survives_a_restart_until_recover(make_fake: MakeFake, tmp_path: Path) -> None:
    first = make_fake(state_dir=tmp_path)
    first.inject_xid(1, 79)
    first.uninstall()
    again = make_fake(state_dir=tmp_path)
    assert again.is_lost(1) and not again.is_lost(0)
    pynvml.nvmlInit()
    _raises(15, lambda: pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(1)))
    again.recover(1)
    again.uninstall()
    third = make_fake(state_dir=tmp_path)
    assert not third.is_lost(1)
    assert third.recovery_action(1) == 0


# ---- events -------------------------------------------------------------------------------


def _event_set(indices: tuple[int, ...] = (0, 1), mask: int = 0) -> Any:
    es = pynvml.nvmlEventSetCreate()
    for i in indices:
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        wanted = mask or pynvml.nvmlDeviceGetSupportedEventTypes(h)
        pynvml.nvmlDeviceRegisterEvents(h, wanted, es)
    return es


def test_empty_wait_times_out_after_the_timeout(fake: FakeNvml) -> None:
    es = _event_set()
    start = time.monotonic()
    err = _raises(10, lambda: pynvml.nvmlEventSetWait_v2(es, 150))
    assert isinstance(err, pynvml.NVMLError_Timeout)
    assert str(err) == "Timeout"
    assert time.monotonic() - start >= 0.14
    pynvml.nvmlEventSetFree(es)


def test_one_event_per_wait_with_xid_data_and_no_mig_instance(fake: FakeNvml) -> None:
    es = _event_set()
    fake.inject_xid(1, 13)
    fake.inject_xid(0, 31)
    got = []
    for _ in range(2):
        ev = pynvml.nvmlEventSetWait_v2(es, 1000)
        assert ev.eventType == pynvml.nvmlEventTypeXidCriticalError
        assert ev.gpuInstanceId == ev.computeInstanceId == 0xFFFFFFFF
        got.append((pynvml.nvmlDeviceGetUUID(ev.device), ev.eventData))
    assert got == [(fake.spec.gpus[1].uuid, 13), (fake.spec.gpus[0].uuid, 31)]
    _raises(10, lambda: pynvml.nvmlEventSetWait_v2(es, 20))


def test_non_xid_events_carry_zero_data(fake: FakeNvml) -> None:
    es = _event_set((0,))
    fake.inject_xid(0, 48)  # double-bit ECC: Xid, DBE event, recovery action changed
    events = [pynvml.nvmlEventSetWait_v2(es, 1000) for _ in range(3)]
    assert [(e.eventType, e.eventData) for e in events] == [
        (pynvml.nvmlEventTypeXidCriticalError, 48),
        (pynvml.nvmlEventTypeDoubleBitEccError, 0),
        (pynvml.nvmlEventTypeGpuRecoveryAction, 0),
    ]


def test_only_registered_types_and_gpus_are_delivered(fake: FakeNvml) -> None:
    es = _event_set((0,), mask=pynvml.nvmlEventTypeXidCriticalError)
    fake.inject_xid(1, 13)  # GPU 1 is not in the set
    fake.inject_xid(0, 46)  # its recovery-action event is not registered
    ev = pynvml.nvmlEventSetWait_v2(es, 1000)
    assert (ev.eventType, ev.eventData) == (pynvml.nvmlEventTypeXidCriticalError, 46)
    _raises(10, lambda: pynvml.nvmlEventSetWait_v2(es, 20))


def test_register_unsupported_types_is_not_supported(make_fake: MakeFake) -> None:
    spec = _spec(gpus=[{"name": "NVIDIA T4", "memoryMiB": 15360, "ecc": False}])
    make_fake(spec)
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert not pynvml.nvmlDeviceGetSupportedEventTypes(h) & pynvml.nvmlEventTypeDoubleBitEccError
    es = pynvml.nvmlEventSetCreate()
    _raises(3, lambda: pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeAll, es))
    pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)


def test_xid_79_delivers_the_event_then_the_wait_raises_gpu_is_lost(fake: FakeNvml) -> None:
    es = _event_set()
    assert fake.inject_xid(0, 79) is XidClass.LOST
    ev = pynvml.nvmlEventSetWait_v2(es, 1000)
    assert ev.eventData == 79
    assert handle_address(ev.device) == handle_address(pynvml.nvmlDeviceGetHandleByIndex(0))
    _raises(15, lambda: pynvml.nvmlEventSetWait_v2(es, 1000))
    assert fake.is_lost(0)


def test_a_blocked_wait_wakes_on_injection_from_another_thread(fake: FakeNvml) -> None:
    es = _event_set()
    result: list[int] = []

    def waiter() -> None:
        result.append(pynvml.nvmlEventSetWait_v2(es, 30_000).eventData)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    fake.inject_xid(1, 119)
    t.join(timeout=10)
    assert result == [119]


def test_xid_classes_follow_the_catalog() -> None:
    assert classify_xid(79) is XidClass.LOST
    assert classify_xid(13) is XidClass.APPLICATION
    assert classify_xid(94) is XidClass.APPLICATION
    assert classify_xid(95) is XidClass.RESET
    assert classify_xid(63) is XidClass.IGNORE
    assert classify_xid(160) is XidClass.REBOOT
    assert classify_xid(4000) is XidClass.RESET  # unknown counts as reset-class


def _recovery(index: int) -> tuple[int, int]:
    values = pynvml.nvmlDeviceGetFieldValues(
        pynvml.nvmlDeviceGetHandleByIndex(index),
        [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION],
    )
    return values[0].nvmlReturn, values[0].value.uiVal


def test_reset_xid_sets_recovery_action_and_recover_clears_it(fake: FakeNvml) -> None:
    assert _recovery(0) == (0, pynvml.NVML_GPU_RECOVERY_ACTION_NONE)
    assert fake.inject_xid(0, 95) is XidClass.RESET
    assert _recovery(0) == (0, pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
    assert _recovery(1) == (0, pynvml.NVML_GPU_RECOVERY_ACTION_NONE)
    fake.recover(0)
    assert _recovery(0) == (0, pynvml.NVML_GPU_RECOVERY_ACTION_NONE)


def test_unknown_field_is_reported_per_entry(fake: FakeNvml) -> None:
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    values = pynvml.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, 1])
    assert values[0].nvmlReturn == pynvml.NVML_SUCCESS
    assert values[1].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_a_field_error_is_reported_in_its_entry_and_the_call_succeeds(fake: FakeNvml) -> None:
    """As real NVML: no exception from the call; the field's own nvmlReturn says it failed."""
    field = pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
    fake.set_field_error(0, field, pynvml.NVML_ERROR_UNKNOWN)
    assert fake.inject_xid(0, 95) is XidClass.RESET  # the action is GPU_RESET underneath
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    values = pynvml.nvmlDeviceGetFieldValues(h, [field, field])
    assert [v.nvmlReturn for v in values] == [pynvml.NVML_ERROR_UNKNOWN] * 2
    assert values[0].value.uiVal == 0
    assert _recovery(1) == (0, pynvml.NVML_GPU_RECOVERY_ACTION_NONE)  # other GPUs answer
    fake.set_field_error(0, field, None)
    assert _recovery(0) == (0, pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)


def test_application_xid_leaves_nvml_healthy_and_calls_the_hook(make_fake: MakeFake) -> None:
    faulted: list[str] = []
    fake = make_fake(on_application_xid=faulted.append)
    pynvml.nvmlInit()
    assert fake.inject_xid(1, 43) is XidClass.APPLICATION
    assert faulted == [fake.spec.gpus[1].uuid]
    assert _recovery(1) == (0, pynvml.NVML_GPU_RECOVERY_ACTION_NONE)
    assert pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(1)).total > 0
    fake.inject_xid(1, 43, notify=False)
    assert len(faulted) == 1


# ---- processes ----------------------------------------------------------------------------


def test_process_lists_follow_the_two_call_protocol(fake: FakeNvml) -> None:
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    fn = fake.library.nvmlDeviceGetComputeRunningProcesses_v3
    count = ctypes.c_uint(0)
    assert fn(h, ctypes.byref(count), None) == pynvml.NVML_SUCCESS  # no processes
    assert count.value == 0
    fake.add_process(0, 100, 1 << 30)
    fake.add_process(0, 101, 2 << 30)
    assert fn(h, ctypes.byref(count), None) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value == 2
    small = (pynvml.c_nvmlProcessInfo_v3_t * 1)()
    count.value = 1
    assert fn(h, ctypes.byref(count), small) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
    assert [(p.pid, p.usedGpuMemory) for p in procs] == [(100, 1 << 30), (101, 2 << 30)]
    assert all(p.gpuInstanceId == 0xFFFFFFFF for p in procs)
    assert pynvml.nvmlDeviceGetMPSComputeRunningProcesses(h) == []


def test_mps_clients_are_listed_by_the_mps_variant(fake: FakeNvml) -> None:
    fake.add_process(1, 7, 0)  # the MPS server shows as a compute process
    fake.add_process(1, 8, 5 << 20, mps_client=True)
    h = pynvml.nvmlDeviceGetHandleByIndex(1)
    assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)] == [7]
    assert [p.pid for p in pynvml.nvmlDeviceGetMPSComputeRunningProcesses(h)] == [8]
    fake.remove_process(1, 8)
    assert pynvml.nvmlDeviceGetMPSComputeRunningProcesses(h) == []


def test_missing_v3_symbol_is_a_library_mismatch(fake: FakeNvml) -> None:
    del fake.library.nvmlDeviceGetComputeRunningProcesses_v3
    pynvml._nvmlGetFunctionPointer_cache.clear()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLLibraryMismatchError) as info:
        pynvml.nvmlDeviceGetComputeRunningProcesses(h)
    assert not isinstance(info.value, pynvml.NVMLError)
    err = _raises(13, lambda: pynvml.nvmlDeviceGetComputeRunningProcesses_v3(h))
    assert str(err) == "Function Not Found"


# ---- privileged calls ---------------------------------------------------------------------


def test_set_compute_mode_needs_privilege(make_fake: MakeFake) -> None:
    fake = make_fake(_spec(privileged=False))
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    err = _raises(4, lambda: pynvml.nvmlDeviceSetComputeMode(h, 3))
    assert isinstance(err, pynvml.NVMLError_NoPermission)
    assert str(err) == "Insufficient Permissions"
    assert fake.compute_mode(0) == 0


def test_set_compute_mode_when_privileged(fake: FakeNvml) -> None:
    h = pynvml.nvmlDeviceGetHandleByIndex(1)
    pynvml.nvmlDeviceSetComputeMode(h, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    assert fake.compute_mode(1) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert pynvml.nvmlDeviceGetComputeMode(h) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert fake.compute_mode(0) == pynvml.NVML_COMPUTEMODE_DEFAULT
    _raises(2, lambda: pynvml.nvmlDeviceSetComputeMode(h, 7))


def test_memory_limits_exist_only_from_r615(fake: FakeNvml, make_fake: MakeFake) -> None:
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    ns = b"/sys/fs/cgroup/kubepods/pod1/c1"
    pynvml.nvmlDeviceSetMemoryLimits_v1(h, pynvml.c_nvmlSetMemoryLimits_v1_t(ns, 1 << 30, 2 << 30))
    got = pynvml.c_nvmlGetMemoryLimits_v1_t(ns)
    pynvml.nvmlDeviceGetMemoryLimits_v1(h, got)
    assert (got.softLimit, got.hardLimit) == (1 << 30, 2 << 30)
    assert fake.memory_limits(0) == {ns.decode(): (1 << 30, 2 << 30)}
    make_fake("a100x4-r580")
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    limits = pynvml.c_nvmlSetMemoryLimits_v1_t(ns, 1, 2)
    _raises(13, lambda: pynvml.nvmlDeviceSetMemoryLimits_v1(h, limits))


def test_concurrent_calls_and_injections_do_not_break(fake: FakeNvml) -> None:
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        try:
            while not stop.is_set():
                h = pynvml.nvmlDeviceGetHandleByIndex(1)
                pynvml.nvmlDeviceGetMemoryInfo(h)
                # processes started between the two calls: real NVML does this too
                with contextlib.suppress(pynvml.NVMLError_InsufficientSize):
                    pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for pid in range(200):
        fake.add_process(1, pid, 1 << 20)
        fake.inject_xid(0, 13)
    stop.set()
    for t in threads:
        t.join(timeout=10)
    assert errors == []
    assert (
        len(pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(1)))
        == 200
    )
