"""Fault injection from another process into a running simulation, through the state dir."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from deviceplugin.model import GpuUuid
from deviceplugin.simulate.inject import InjectError, InjectionListener, inject, inject_dir
from deviceplugin.simulate.nvml import FakeNvml
from deviceplugin.simulate.specs import load_spec


class Hooks:
    def __init__(self) -> None:
        self.mps_faults: list[GpuUuid] = []
        self.recovered: list[GpuUuid] = []
        self.event = threading.Event()

    def mps_fault(self, uuid: GpuUuid) -> None:
        self.mps_faults.append(uuid)
        self.event.set()

    def recover(self, uuid: GpuUuid) -> None:
        self.recovered.append(uuid)


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[tuple[FakeNvml, InjectionListener, Hooks]]:
    fake = FakeNvml(load_spec("h200x2"), state_dir=tmp_path)
    fake.install()
    hooks = Hooks()
    listener = InjectionListener(tmp_path, fake, hooks.mps_fault, hooks.recover)
    listener.start()
    try:
        yield fake, listener, hooks
    finally:
        listener.stop()
        fake.uninstall()


def _client(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the client in a separate Python process, as `simulate inject` would."""
    code = (
        "import sys; from pathlib import Path\n"
        "from deviceplugin.simulate.inject import inject, InjectError\n"
        "a = sys.argv[1:]\n"
        "try:\n"
        "    print(inject(Path(a[0]), a[1], a[2], int(a[3]) if len(a) > 3 else None))\n"
        "except InjectError as e:\n"
        "    print(e, file=sys.stderr); sys.exit(1)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(state_dir), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_xid_79_from_another_process_makes_the_gpu_lost(
    sim: tuple[FakeNvml, InjectionListener, Hooks], tmp_path: Path
) -> None:
    fake, listener, _ = sim
    pynvml.nvmlInit()
    es = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(
        pynvml.nvmlDeviceGetHandleByIndex(1), pynvml.nvmlEventTypeXidCriticalError, es
    )
    done = _client(tmp_path, "1", "xid", "79")
    assert done.returncode == 0, done.stderr
    assert pynvml.nvmlEventSetWait_v2(es, 5000).eventData == 79
    assert fake.is_lost(1) and not fake.is_lost(0)
    assert listener.applied == 1
    assert list(inject_dir(tmp_path).iterdir()) == []  # request and result both cleaned up


def test_lost_and_recover_by_uuid(
    sim: tuple[FakeNvml, InjectionListener, Hooks], tmp_path: Path
) -> None:
    fake, _, hooks = sim
    uuid = fake.spec.gpus[0].uuid
    inject(tmp_path, uuid, "lost")
    assert fake.is_lost(0)
    # Persisted: a plugin restarted on the same state dir still sees it lost.
    assert FakeNvml(fake.spec, state_dir=tmp_path).is_lost(0)
    answer = inject(tmp_path, "0", "recover")
    assert answer["gpu"] == uuid
    assert not fake.is_lost(0) and fake.recovery_action(0) == 0
    assert hooks.recovered == [uuid]


def test_application_xid_and_mps_fault_reach_the_mps_hook(
    sim: tuple[FakeNvml, InjectionListener, Hooks], tmp_path: Path
) -> None:
    fake, _, hooks = sim
    before = time.monotonic()
    answer = inject(tmp_path, "1", "xid", 31)
    # when the fault entered the fake NVML, on the host-wide monotonic clock
    assert before <= answer["at"] <= time.monotonic()
    assert answer["xidClass"] == "application"
    assert not fake.is_lost(1) and fake.recovery_action(1) == 0
    inject(tmp_path, "0", "mps-fault")
    assert hooks.mps_faults == [fake.spec.gpus[1].uuid, fake.spec.gpus[0].uuid]
    inject(tmp_path, "0", "xid", 95)  # reset-class: NVML side only
    assert fake.recovery_action(0) == pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
    assert len(hooks.mps_faults) == 2


def test_unknown_gpu_is_refused_with_a_message(
    sim: tuple[FakeNvml, InjectionListener, Hooks], tmp_path: Path
) -> None:
    done = _client(tmp_path, "7", "lost")
    assert done.returncode == 1
    assert "no GPU '7'" in done.stderr


def test_no_running_plugin_is_reported(tmp_path: Path) -> None:
    with pytest.raises(InjectError) as info:
        inject(tmp_path, "0", "lost", timeout=0.2)
    assert "no simulated plugin" in str(info.value)
    # The directory exists (a plugin ran once) but nobody listens now.
    inject_dir(tmp_path).mkdir(parents=True)
    with pytest.raises(InjectError) as info:
        inject(tmp_path, "0", "lost", timeout=0.3)
    assert "took the request within 0.3s" in str(info.value)
    assert list(inject_dir(tmp_path).iterdir()) == []  # the request was taken back


def test_malformed_requests_are_refused_before_sending(tmp_path: Path) -> None:
    with pytest.raises(InjectError):
        inject(tmp_path, "0", "melt")
    with pytest.raises(InjectError):
        inject(tmp_path, "0", "xid")
    with pytest.raises(InjectError):
        inject(tmp_path, "0", "lost", xid=79)


def test_requests_waiting_before_start_are_applied(tmp_path: Path) -> None:
    fake = FakeNvml(load_spec("h200x2"))
    first = InjectionListener(tmp_path, fake)
    first.start()
    first.stop()
    first.stop()  # idempotent
    # A client writes while no listener runs; a listener started meanwhile picks it up.
    result: list[object] = []
    t = threading.Thread(target=lambda: result.append(inject(tmp_path, "1", "lost", timeout=10)))
    t.start()
    second = InjectionListener(tmp_path, fake)
    try:
        second.start()
        t.join(timeout=20)
    finally:
        second.stop()
    assert fake.is_lost(1)
    assert len(result) == 1


def test_mps_fault_without_mps_hook_is_refused(tmp_path: Path) -> None:
    fake = FakeNvml(load_spec("h200x2"))
    listener = InjectionListener(tmp_path, fake)
    listener.start()
    try:
        with pytest.raises(InjectError) as info:
            inject(tmp_path, "0", "mps-fault")
    finally:
        listener.stop()
    assert "no MPS" in str(info.value)
