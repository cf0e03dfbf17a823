"""Allocator: preferred packing tables, every Allocate field per mode and strategy, refusals,
reuse of the same devices, the MPS client limit, ceilings, and reconcile."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from deviceplugin import grant_shape
from deviceplugin.cdi import specs as cdi_specs
from deviceplugin.config.settings import Config, parse
from deviceplugin.dpapi.allocator import (
    AllocationError,
    Allocator,
    CeilingDecision,
    ErrorCode,
    MpsNotReady,
)
from deviceplugin.dpapi.preferred import preferred
from deviceplugin.health.board import HealthBoard
from deviceplugin.inventory.gpus import Inventory
from deviceplugin.ledger.record import Listing
from deviceplugin.ledger.store import Ledger
from deviceplugin.model import (
    GIB,
    MIB,
    Delivery,
    Enforcement,
    FaultDomain,
    GpuUuid,
    Mode,
    ResourceName,
)
from deviceplugin.plan import SlicePlan, build_plan
from tests.test_plan import inventory

TS = "nvidia.com/gpu-fraction"
SM = "nvidia.com/gpu-fraction.sm-sharing"
EX = "nvidia.com/gpu"


class FakeMps:
    def __init__(self, ready: bool = True, memory_accounting: bool = True) -> None:
        self.ready = ready
        self.accounting = memory_accounting
        self.ensured: list[GpuUuid] = []

    def memory_accounting(self, gpu: GpuUuid) -> bool:
        return self.accounting

    def ensure(self, gpu: GpuUuid) -> bool:
        self.ensured.append(gpu)
        return self.ready

    def wait_ready(self, gpu: GpuUuid, timeout: float) -> bool:
        return self.ready


class FakeCeilings:
    def __init__(self, limit: int | None, source: str | None = "pod ns/p container c") -> None:
        self.decision = CeilingDecision(limit, source)
        self.calls: list[tuple[str, int, str]] = []

    def ceiling_for(self, resource: ResourceName, count: int, gpu: GpuUuid) -> CeilingDecision:
        self.calls.append((resource, count, gpu))
        return self.decision


MIXED = {
    "gpus": [
        {"match": {"index": 0}, "mode": "time-slicing"},
        {"match": {"index": 1}, "mode": "sm-sharing"},
        {"match": {"index": 2}, "mode": "exclusive"},
        {"match": {"index": 3}, "mode": "exclusive"},
    ]
}


class Rig:
    def __init__(
        self,
        tmp: Path,
        cfg: dict[str, Any] | None = None,
        inv: Inventory | None = None,
        mps: FakeMps | None = None,
        ceilings: FakeCeilings | None = None,
    ) -> None:
        self.config: Config = parse({"version": "v1", **MIXED, **(cfg or {})})
        self.inv = inv or inventory("mixed")
        self.plan: SlicePlan = build_plan(self.inv, self.config)
        self.cdi_dir = tmp / "cdi"
        self.mps_root = tmp / "mps"
        self.ledger = Ledger(tmp / "state", startup_grace=0.0)
        self.board = HealthBoard()
        self.mps = mps if mps is not None else FakeMps()
        self.allocator = Allocator(
            lambda: self.plan,
            lambda: self.config,
            self.cdi_dir,
            self.mps_root,
            self.ledger,
            self.board,
            self.mps,
            ceilings,
            clock=lambda: 100.0,
        )

    def gpu(self, index: int) -> GpuUuid:
        return self.inv.gpus[index].uuid

    def ids(self, index: int, *slices: int) -> list[str]:
        return [f"{self.gpu(index)}::{n}" for n in slices]


def spec_of(rig: Rig, name: str) -> dict[str, Any]:
    kind, _, device = name.partition("=")
    assert kind == cdi_specs.KIND
    data: dict[str, Any] = json.loads(cdi_specs.spec_path(rig.cdi_dir, device).read_text())
    assert cdi_specs.validate_spec(data) == []
    return data


def test_time_slicing_cdi(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    g = rig.gpu(0)
    grant = rig.allocator.allocate(TS, rig.ids(0, 3, 4))
    assert grant.envs == {} and grant.mounts == [] and grant.device_specs == []
    assert grant.cdi_devices[0] == f"nvidia.com/gpu={g}"
    spec = spec_of(rig, grant.cdi_devices[1])
    edits = spec["devices"][0]["containerEdits"]
    assert edits["env"] == [  # no NVIDIA_VISIBLE_DEVICES: the driver's spec keeps it `void`
        "NVIDIA_GPU_MEMORY_REQUEST=2048",
        "NVIDIA_GPU_MEMORY_LIMIT=2048",
    ]
    assert "mounts" not in edits
    assert edits["hooks"][0]["args"][-1] == g
    assert edits["hooks"][0]["path"] == "/usr/bin/nvidia-ctk"
    assert grant.annotations == {
        "gpu-fraction.dev/mode": "time-slicing",
        "gpu-fraction.dev/gpu": g,
        "gpu-fraction.dev/request": "2048Mi",
        "gpu-fraction.dev/limit": "2048Mi",
        "gpu-fraction.dev/enforcement": "cuda-memory-limits",
        "gpu-fraction.dev/delivery": "cdi-edit",
    }
    rec = grant.record
    assert rec.device_ids == tuple(rig.ids(0, 3, 4))
    assert (rec.mode, rec.request_mib, rec.limit_mib, rec.delivery) == (
        Mode.TIME_SLICING,
        2048,
        2048,
        Delivery.CDI,
    )
    assert rec.enforcement == (Enforcement.CUDA_MEMORY_LIMITS,)
    assert rec.cdi_spec is not None and Path(rec.cdi_spec).exists()
    assert rig.ledger.records() == [rec]


def test_sm_sharing_cdi(tmp_path: Path) -> None:
    rig = Rig(tmp_path, {"mps": {"activeThreadPercentage": "proportional"}})
    g = rig.gpu(1)
    grant = rig.allocator.allocate(SM, rig.ids(1, 0, 1, 2))
    assert rig.mps.ensured == [g]
    edits = spec_of(rig, grant.cdi_devices[1])["devices"][0]["containerEdits"]
    env = dict(e.split("=", 1) for e in edits["env"])
    # The daemon's own pipe path string, mounted from that host dir at that same path, and
    # the GPU's shm dir as the container's /dev/shm (DESIGN 3b).
    pipe = str(rig.mps_root / g / "pipe")
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == pipe
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=3072M"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "3"  # 3 of 139 slices → 2.2 → 3
    assert env["NVIDIA_GPU_MEMORY_REQUEST"] == "3072"
    assert edits["mounts"] == [
        {"hostPath": pipe, "containerPath": pipe, "options": ["rbind", "ro"]},
        {
            "hostPath": str(rig.mps_root / g / "shm"),
            "containerPath": "/dev/shm",
            "options": ["rbind", "rw"],
        },
    ]
    assert "hooks" not in edits  # protocol 2: no cuda-memory-limits
    assert grant.annotations["gpu-fraction.dev/enforcement"] == "mps-pinned-limit"


def test_sm_sharing_protocol_3_adds_hook(tmp_path: Path) -> None:
    rig = Rig(tmp_path, {"mps": {"protocolVersion": 3, "activeThreadPercentage": 50}})
    grant = rig.allocator.allocate(SM, rig.ids(1, 0))
    edits = spec_of(rig, grant.cdi_devices[1])["devices"][0]["containerEdits"]
    assert edits["hooks"][0]["args"][2] == "apply-cuda-memory-limits"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50" in edits["env"]
    assert grant.record.enforcement == (
        Enforcement.CUDA_MEMORY_LIMITS,
        Enforcement.MPS_PINNED_LIMIT,
    )


def test_default_thread_percentage_sets_no_variable(tmp_path: Path) -> None:
    rig = Rig(tmp_path, {"deviceListStrategy": ["envvar"]})
    grant = rig.allocator.allocate(SM, rig.ids(1, 0))
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in grant.envs


def test_envvar_strategy(tmp_path: Path) -> None:
    rig = Rig(tmp_path, {"deviceListStrategy": ["envvar"], "enforcement": "best-effort"})
    g = rig.gpu(1)
    grant = rig.allocator.allocate(SM, rig.ids(1, 5))
    assert grant.cdi_devices == []
    assert grant.envs == {
        "NVIDIA_VISIBLE_DEVICES": g,
        "NVIDIA_GPU_MEMORY_REQUEST": "1024",
        "NVIDIA_GPU_MEMORY_LIMIT": "1024",
        "CUDA_MPS_PIPE_DIRECTORY": str(rig.mps_root / g / "pipe"),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1024M",
    }
    pipe = str(rig.mps_root / g / "pipe")
    assert grant.mounts == [
        (pipe, pipe, True),
        ("/dev/shm", str(rig.mps_root / g / "shm"), False),
    ]
    assert grant.record.delivery is Delivery.ENV
    assert grant.annotations["gpu-fraction.dev/delivery"] == "plain-env"
    assert not rig.cdi_dir.exists()
    ts = rig.allocator.allocate(TS, rig.ids(0, 0))
    assert ts.record.enforcement == (Enforcement.NONE,)
    assert ts.annotations["gpu-fraction.dev/enforcement"] == "none"


def test_device_nodes_strategy(tmp_path: Path) -> None:
    rig = Rig(
        tmp_path, {"deviceListStrategy": ["envvar", "device-nodes"], "enforcement": "best-effort"}
    )
    grant = rig.allocator.allocate(TS, rig.ids(0, 0))
    assert grant.device_specs == [
        ("/dev/nvidia0", "/dev/nvidia0", "rw"),
        ("/dev/nvidiactl", "/dev/nvidiactl", "rw"),
        ("/dev/nvidia-uvm", "/dev/nvidia-uvm", "rw"),
        ("/dev/nvidia-uvm-tools", "/dev/nvidia-uvm-tools", "rw"),
    ]
    assert grant.envs["NVIDIA_VISIBLE_DEVICES"] == rig.gpu(0)


def test_exclusive(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    g2, g3 = rig.gpu(2), rig.gpu(3)
    grant = rig.allocator.allocate(EX, [g3, g2])
    # Whole GPUs: the driver's devices only (ours would have no edits left).
    assert set(grant.cdi_devices) == {f"nvidia.com/gpu={g2}", f"nvidia.com/gpu={g3}"}
    assert grant.record.cdi_spec is None
    assert grant.record.request_mib is None and grant.record.enforcement == ()
    assert grant.annotations["gpu-fraction.dev/mode"] == "exclusive"
    assert rig.mps.ensured == []


@pytest.mark.parametrize(
    ("resource", "ids", "code", "fragment"),
    [
        (TS, lambda r: [], ErrorCode.INVALID_ARGUMENT, "empty device list"),
        (
            TS,
            lambda r: ["GPU-nope::0"],
            ErrorCode.INVALID_ARGUMENT,
            "unknown device IDs: ['GPU-nope::0']",
        ),
        (TS, lambda r: r.ids(0, 9999), ErrorCode.INVALID_ARGUMENT, "unknown device IDs"),
        (TS, lambda r: r.ids(1, 0), ErrorCode.INVALID_ARGUMENT, "another resource"),
        (SM, lambda r: [r.gpu(2)], ErrorCode.INVALID_ARGUMENT, "another resource"),
        (TS, lambda r: r.ids(0, 1, 1), ErrorCode.INVALID_ARGUMENT, "repeated device IDs"),
    ],
)
def test_refusals(tmp_path: Path, resource: str, ids: Any, code: ErrorCode, fragment: str) -> None:
    rig = Rig(tmp_path)
    with pytest.raises(AllocationError) as info:
        rig.allocator.allocate(resource, ids(rig))
    assert info.value.code is code
    assert fragment in info.value.message
    assert rig.ledger.records() == []
    # the allocator still answers afterwards
    assert rig.allocator.allocate(TS, rig.ids(0, 0)).record.request_mib == 1024


def test_fractional_across_gpus_is_refused_with_largest_fit(tmp_path: Path) -> None:
    cfg = {
        "gpus": [
            {"match": {"index": 0}, "mode": "time-slicing"},
            {"match": {"index": 1}, "mode": "time-slicing"},
        ]
    }
    rig = Rig(tmp_path, cfg, inv=inventory("h200x2"))
    rig.allocator.allocate(TS, rig.ids(1, *range(100)))
    with pytest.raises(AllocationError) as info:
        rig.allocator.allocate(TS, rig.ids(0, 0) + rig.ids(1, 138))
    assert info.value.code is ErrorCode.FAILED_PRECONDITION
    msg = info.value.message
    assert rig.gpu(0) in msg and rig.gpu(1) in msg
    assert f"139 slices (139Gi) on {rig.gpu(0)}" in msg


def test_same_devices_again_reuse_record_and_spec(tmp_path: Path) -> None:
    rig = Rig(tmp_path, {"mps": {"maxClients": 1}})
    first = rig.allocator.allocate(SM, rig.ids(1, 0, 1))
    second = rig.allocator.allocate(SM, rig.ids(1, 1, 0))  # init container, then app container
    assert second.cdi_devices == first.cdi_devices
    assert second.record == first.record
    assert len(rig.ledger.records()) == 1
    assert len(list(rig.cdi_dir.iterdir())) == 1
    spec = Path(first.record.cdi_spec or "")
    inode = spec.stat().st_ino
    rig.allocator.allocate(SM, rig.ids(1, 0, 1))
    assert spec.stat().st_ino == inode  # the same spec: not written again
    spec.unlink()  # gone (someone cleaned /var/run/cdi): the same devices write it again
    third = rig.allocator.allocate(SM, rig.ids(1, 0, 1))
    assert json.loads(spec.read_text()) == third.record.cdi_body


def test_a_new_allocation_replaces_a_spec_file_left_under_its_name(tmp_path: Path) -> None:
    """No record of these devices (the file outlived its record): the new answer's spec
    replaces whatever the file held, unread."""
    rig = Rig(tmp_path)
    key = tuple(sorted(rig.ids(0, 5, 6)))
    orphan = cdi_specs.spec_path(rig.cdi_dir, cdi_specs.device_name(key))
    orphan.parent.mkdir(parents=True)
    orphan.write_text('{"cdiVersion": "0.3.0", "stale": true}\n')
    grant = rig.allocator.allocate(TS, rig.ids(0, 5, 6))
    assert grant.record.cdi_spec == str(orphan)
    assert json.loads(orphan.read_text()) == grant.record.cdi_body
    assert oct(orphan.stat().st_mode & 0o777) == oct(0o644)


def test_client_limit(tmp_path: Path) -> None:
    rig = Rig(tmp_path, {"mps": {"maxClients": 2}})
    g = rig.gpu(1)
    rig.allocator.allocate(SM, rig.ids(1, 0))
    assert FaultDomain.CLIENT_LIMIT not in rig.board.faults(g)
    rig.allocator.allocate(SM, rig.ids(1, 1))
    assert FaultDomain.CLIENT_LIMIT in rig.board.faults(g)
    with pytest.raises(AllocationError) as info:
        rig.allocator.allocate(SM, rig.ids(1, 2))
    assert info.value.code is ErrorCode.RESOURCE_EXHAUSTED
    assert "mps.maxClients 2" in info.value.message
    rig.allocator.allocate(SM, rig.ids(1, 1))  # a live allocation again: not a new client
    # the allocation of slice 0 ends: below the limit again
    gone = rig.ledger.records()[0]
    rig.ledger.remove(gone.key)
    rig.allocator.refresh_client_limits()
    assert FaultDomain.CLIENT_LIMIT not in rig.board.faults(g)
    rig.allocator.allocate(SM, rig.ids(1, 2))


def test_reconcile_updates_client_limit_and_removes_specs(tmp_path: Path) -> None:
    rig = Rig(tmp_path, {"mps": {"maxClients": 1}})
    grant = rig.allocator.allocate(SM, rig.ids(1, 0))
    assert FaultDomain.CLIENT_LIMIT in rig.board.faults(rig.gpu(1))
    gone = rig.allocator.reconcile(Listing.of([]))  # created at 100: long ago
    assert [r.key for r in gone] == [grant.record.key]
    assert FaultDomain.CLIENT_LIMIT not in rig.board.faults(rig.gpu(1))
    assert list(rig.cdi_dir.iterdir()) == []


def test_mps_not_ready(tmp_path: Path) -> None:
    rig = Rig(tmp_path, mps=FakeMps(ready=False))
    with pytest.raises(MpsNotReady) as info:
        rig.allocator.allocate(SM, rig.ids(1, 0))
    assert info.value.code is ErrorCode.UNAVAILABLE and info.value.gpu == rig.gpu(1)
    assert rig.ledger.records() == []
    rig.mps.ready = True
    assert rig.allocator.allocate(SM, rig.ids(1, 0)).record.mode is Mode.SM_SHARING


@pytest.mark.parametrize(
    ("cfg", "limit", "expected_mib", "policy"),
    [
        ({}, None, 2048, None),
        ({}, 4 * GIB, 2048, "ignored: no-reclaim"),
        ({"ceilings": "allow-overcommit"}, 4 * GIB, 4096, "overcommit"),
        ({"mps": {"protocolVersion": 3}}, 4 * GIB, 4096, "applied"),
        ({"mps": {"protocolVersion": 3}}, 1 * GIB, 2048, None),  # never below the request
        ({"ceilings": "allow-overcommit"}, 500 * GIB, (143771 - 1024), "overcommit"),  # clamped
    ],
)
def test_ceilings(
    tmp_path: Path, cfg: dict[str, Any], limit: int | None, expected_mib: int, policy: str | None
) -> None:
    ceilings = FakeCeilings(limit)
    rig = Rig(tmp_path, cfg, ceilings=ceilings)
    grant = rig.allocator.allocate(SM, rig.ids(1, 0, 1))
    assert ceilings.calls == [(SM, 2, rig.gpu(1))]
    assert grant.record.limit_mib == expected_mib
    assert grant.record.request_mib == 2048
    assert grant.record.ceiling_policy == policy
    assert grant.record.ceiling_source == "pod ns/p container c"
    edits = spec_of(rig, grant.cdi_devices[1])["devices"][0]["containerEdits"]
    assert f"NVIDIA_GPU_MEMORY_LIMIT={expected_mib}" in edits["env"]
    assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={expected_mib}M" in edits["env"]
    if policy is not None:
        assert grant.annotations["gpu-fraction.dev/ceiling-policy"] == policy


def test_protocol_3_without_accounting_proof_ignores_the_ceiling(tmp_path: Path) -> None:
    # The plan says protocol 3 (reclaimable in principle); the daemon's readback did not
    # confirm memory accounting, so borrowed memory is not reclaimable (DESIGN 3b).
    rig = Rig(
        tmp_path,
        {"mps": {"protocolVersion": 3}},
        mps=FakeMps(memory_accounting=False),
        ceilings=FakeCeilings(4 * GIB),
    )
    assert rig.plan.for_gpu(rig.gpu(1)).reclaimable  # type: ignore[union-attr]
    grant = rig.allocator.allocate(SM, rig.ids(1, 0, 1))
    assert grant.record.ceiling_policy == "ignored: no-reclaim"
    assert grant.record.limit_mib == 2048


def test_records_survive_allocator_restart(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    grant = rig.allocator.allocate(TS, rig.ids(0, 7))
    assert Ledger(tmp_path / "state").records() == [grant.record]


# -- preferred: tables --------------------------------------------------------------------


def _ids(gpu: str, *slices: int) -> list[str]:
    return [f"{gpu}::{n}" for n in slices]


def test_preferred_best_fit(tmp_path: Path) -> None:
    rig = Rig(tmp_path, {"defaultMode": "time-slicing", "gpus": []}, inv=inventory("h200x8"))
    a, b, c = rig.gpu(0), rig.gpu(1), rig.gpu(2)
    available = _ids(a, *range(10)) + _ids(b, 5, 3, 9) + _ids(c, 0, 1, 2, 3)
    # fits on a (10), b (3) and c (4) → c is the best fit for 4, b for 2
    assert preferred(rig.plan, TS, available, [], 4) == _ids(c, 0, 1, 2, 3)
    assert preferred(rig.plan, TS, available, [], 2) == _ids(b, 3, 5)
    # must_include first, topped up on the same GPU with the lowest slices
    assert preferred(rig.plan, TS, available, _ids(a, 7), 3) == _ids(a, 7, 0, 1)
    # no single GPU holds 12: spread over the fewest (a's 10, then the best fit for 2)
    assert preferred(rig.plan, TS, available, [], 12) == _ids(a, *range(10)) + _ids(b, 3, 5)
    # deterministic whatever the order of available
    assert preferred(rig.plan, TS, list(reversed(available)), [], 4) == _ids(c, 0, 1, 2, 3)


def test_preferred_exclusive_numa_local(tmp_path: Path) -> None:
    rig = Rig(tmp_path, {"defaultMode": "exclusive", "gpus": []}, inv=inventory("h200x8"))
    g = [rig.gpu(i) for i in range(8)]
    available = [g[1], g[2], g[4], g[5], g[6], g[7]]
    # must_include on node 1 → the rest from node 1 first
    assert preferred(rig.plan, EX, available, [g[4]], 3) == [g[4], g[5], g[6]]
    # node 0 has 2 free, node 1 has 4: a request for 2 fits node 0 best
    assert preferred(rig.plan, EX, available, [], 2) == [g[1], g[2]]
    assert preferred(rig.plan, EX, available, [], 3) == [g[4], g[5], g[6]]
    assert sorted(preferred(rig.plan, EX, available, [], 6)) == sorted(available)


def test_worked_out_shapes_follow_the_ceiling_and_a_reload(tmp_path: Path) -> None:
    # Answers of one shape (count, GPU) share their caps and CDI edits; a new ceiling
    # decision or a reloaded config is a new shape, never the last one's answer.
    ceilings = FakeCeilings(None)
    rig = Rig(tmp_path, ceilings=ceilings)
    first = rig.allocator.allocate(SM, rig.ids(1, 0))
    same_shape = rig.allocator.allocate(SM, rig.ids(1, 1))
    assert same_shape.annotations == first.annotations
    assert same_shape.cdi_devices[-1] != first.cdi_devices[-1]  # each set its own device
    assert (
        spec_of(rig, same_shape.cdi_devices[-1])["devices"][0]["name"]
        != spec_of(rig, first.cdi_devices[-1])["devices"][0]["name"]
    )
    ceilings.decision = CeilingDecision(4 * first.record.request_mib * MIB, "pod ns/p")
    raised = rig.allocator.allocate(SM, rig.ids(1, 2))
    # no MPS memory accounting read back: the ceiling is declared, then ignored
    assert raised.record.ceiling_source == "pod ns/p"
    assert raised.record.ceiling_policy == "ignored: no-reclaim"
    assert raised.annotations["gpu-fraction.dev/ceiling-source"] == "pod ns/p"
    assert first.annotations["gpu-fraction.dev/ceiling-source"] == "pod ns/p container c"
    ceilings.decision = CeilingDecision(None, None)
    rig.config = parse({"version": "v1", **MIXED, "mps": {"activeThreadPercentage": 50}})
    reloaded = rig.allocator.allocate(SM, rig.ids(1, 3))
    env = spec_of(rig, reloaded.cdi_devices[-1])["devices"][0]["containerEdits"]["env"]
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50" in env
    before = spec_of(rig, first.cdi_devices[-1])["devices"][0]["containerEdits"]["env"]
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50" not in before


def test_a_shapes_spec_text_is_the_spec_encoded(tmp_path: Path) -> None:
    # The spec file's text is put together from the shape's text around the device name:
    # it must be exactly what encoding the spec gives, for every mode and name.
    rig = Rig(tmp_path, ceilings=FakeCeilings(None))
    grants = [
        rig.allocator.allocate(SM, rig.ids(1, 0)),
        rig.allocator.allocate(TS, rig.ids(0, 3, 4)),
    ]
    for grant in grants:
        name = grant.cdi_devices[-1].partition("=")[2]
        path = cdi_specs.spec_path(rig.cdi_dir, name)
        body = json.loads(path.read_text())
        assert path.read_text() == cdi_specs.encode_spec(body) + "\n"
        assert grant.record.cdi_json == cdi_specs.encode_spec(body)
    shape = grant_shape.fractional(rig.config, rig.plan.gpus[1], tmp_path, 2, None, None, "a-name")
    for name in ("0digit-first", 'quote"d', "ünïcode"):
        assert shape.spec_text(name) == cdi_specs.encode_spec(shape.spec(name) or {})
