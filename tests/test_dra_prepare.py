"""The Preparer with a dict-backed ClaimSource: each mode with and without a claim ceiling,
idempotence, refusals (wrong UID, unallocated, another driver, over capacity, MPS clients),
unprepare from the checkpoint alone, restarts, rollback of an interrupted prepare and reboots."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.cdi import specs as cdi_specs
from deviceplugin.config.settings import Config, parse
from deviceplugin.dra.checkpoint import Checkpoint, CheckpointError, ClaimEntry, State
from deviceplugin.dra.prepare import ClaimRef, ClaimsUnavailable, Preparer, PrepareResult
from deviceplugin.model import GIB, MIB, GpuUuid
from deviceplugin.plan import SlicePlan, build_plan
from tests.test_plan import inventory

DRIVER = "gpu-fraction.dev"
NODE = "node-a"
MODES = {
    "version": "v1",
    "api": "dra",
    "gpus": [
        {"match": {"index": 0}, "mode": "time-slicing"},
        {"match": {"index": 1}, "mode": "sm-sharing"},
        {"match": {"index": 2}, "mode": "exclusive"},
        {"match": {"index": 3}, "mode": "time-slicing", "api": "device-plugin"},
    ],
}


class Claims:
    """ResourceClaims by (namespace, name), as the API server would return them."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.calls = 0
        self.down = False

    def add(self, claim: dict[str, Any]) -> ClaimRef:
        meta = claim["metadata"]
        self.objects[(meta["namespace"], meta["name"])] = claim
        return ClaimRef(meta["namespace"], meta["name"], meta["uid"])

    def get_many(
        self, keys: Sequence[tuple[str, str]]
    ) -> dict[tuple[str, str], dict[str, Any] | ClaimsUnavailable | None]:
        self.calls += len(keys)
        if self.down:
            return {k: ClaimsUnavailable("connection refused") for k in keys}
        return {k: self.objects.get(k) for k in keys}


class FakeMps:
    def __init__(self, ready: bool = True) -> None:
        self.ready = ready
        self.accounting = False  # no readback proof: ceilings on sm-sharing stay unreclaimable
        self.ensured: list[GpuUuid] = []

    def ensure(self, gpu: GpuUuid) -> bool:
        self.ensured.append(gpu)
        return self.ready

    def wait_ready(self, gpu: GpuUuid, timeout: float) -> bool:
        return self.ready

    def memory_accounting(self, gpu: GpuUuid) -> bool:
        return self.accounting


def result(
    device: str = "gpu-0",
    memory: str | None = "4Gi",
    request: str = "gpu",
    share: str | None = "share-1",
    driver: str = DRIVER,
    pool: str = NODE,
) -> dict[str, Any]:
    r: dict[str, Any] = {"request": request, "driver": driver, "pool": pool, "device": device}
    if memory is not None:
        r["consumedCapacity"] = {"memory": memory}
    if share is not None:
        r["shareID"] = share
    return r


def share_config(requests: list[str] | None = None, **params: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "source": "FromClaim",
        "opaque": {
            "driver": DRIVER,
            "parameters": {"apiVersion": "gpu-fraction.dev/v1", "kind": "GpuShareConfig", **params},
        },
    }
    if requests is not None:
        entry["requests"] = requests
    return entry


def claim(
    uid: str,
    *results: dict[str, Any],
    config: list[dict[str, Any]] | None = None,
    name: str | None = None,
    allocated: bool = True,
) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": "default", "name": name or f"claim-{uid}", "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu"}]}},
        "status": {},
    }
    if allocated:
        obj["status"]["allocation"] = {
            "devices": {"results": list(results or [result()]), "config": config or []}
        }
    return obj


class Rig:
    def __init__(self, tmp: Path, cfg: dict[str, Any] | None = None, boot: str = "boot-1") -> None:
        self.tmp = tmp
        self.config: Config = parse({**MODES, **(cfg or {})})
        self.plan: SlicePlan = build_plan(inventory("h200x8"), self.config)
        self.claims = Claims()
        self.mps = FakeMps()
        self.cdi_dir = tmp / "cdi"
        self.boot = boot
        self.on_prepared: list[tuple[str, bool]] = []  # (uid, with the claim as read)
        self.lock: Path | None = None  # rolling updates: the instances' shared lock
        self.preparer = self.fresh()

    def fresh(self, boot: str | None = None) -> Preparer:
        """A Preparer as a restarted plugin builds it: same state dir, new objects."""
        if boot is not None:
            self.boot = boot
        checkpoint = Checkpoint.in_state_dir(self.tmp / "state", lambda: self.boot)
        self.preparer = Preparer(
            driver=DRIVER,
            node_name=NODE,
            config=lambda: self.config,
            plan=lambda: self.plan,
            claims=self.claims,
            mps=self.mps,
            cdi_dir=self.cdi_dir,
            mps_root=self.tmp / "mps",
            checkpoint=checkpoint,
            on_prepared=lambda entry, read: self.on_prepared.append((entry.uid, read is not None)),
            instance_lock=self.lock,
        )
        self.preparer.restore()
        return self.preparer

    def uuid(self, index: int) -> str:
        return self.plan.gpus[index].uuid

    def usable(self, index: int) -> int:
        return self.plan.gpus[index].usable

    def prepare(self, *objs: dict[str, Any]) -> dict[str, PrepareResult]:
        return self.preparer.prepare([self.claims.add(o) for o in objs])

    def spec(self, uid: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(cdi_specs.claim_spec_path(self.cdi_dir, uid).read_text())
        return data

    def env(self, uid: str, k: int = 0) -> dict[str, str]:
        device = self.spec(uid)["devices"][k]
        return dict(e.split("=", 1) for e in device["containerEdits"]["env"])

    def checkpoint(self) -> dict[str, Any]:
        """What a restart reads back: the snapshot with the journal replayed over it."""
        cp = Checkpoint.in_state_dir(self.tmp / "state", lambda: self.boot)
        cp.load()
        claims = {e.uid: json.loads(json.dumps(dataclasses.asdict(e))) for e in cp}
        return {"bootID": cp.loaded_boot, "claims": claims}


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path)


# ---- each mode --------------------------------------------------------------------------


def test_time_slicing_share_answers_every_field_and_writes_one_spec(rig: Rig) -> None:
    out = rig.prepare(claim("u1", result("gpu-0", "4Gi", share="s-1")))
    assert out["u1"].error is None
    (dev,) = out["u1"].devices
    assert dev.request_names == ("gpu",)
    assert (dev.pool_name, dev.device_name, dev.share_id) == (NODE, "gpu-0", "s-1")
    assert dev.cdi_device_ids == (
        f"nvidia.com/gpu={rig.uuid(0)}",
        "gpu-fraction.dev/claim=u1-gpu-0-0",
    )
    spec = rig.spec("u1")
    assert spec["kind"] == "gpu-fraction.dev/claim"
    assert [d["name"] for d in spec["devices"]] == ["u1-gpu-0-0"]
    assert cdi_specs.validate_spec(spec) == []
    env = rig.env("u1")
    assert env["NVIDIA_GPU_MEMORY_REQUEST"] == env["NVIDIA_GPU_MEMORY_LIMIT"] == "4096"
    assert "CUDA_MPS_PIPE_DIRECTORY" not in env
    hooks = spec["devices"][0]["containerEdits"]["hooks"]
    assert [h["args"][2] for h in hooks] == ["apply-cuda-memory-limits"]
    entry = rig.checkpoint()["claims"]["u1"]
    assert entry["state"] == "PrepareCompleted" and entry["devices"][0]["request_bytes"] == 4 * GIB


def test_ceiling_in_claim_config_follows_the_ceilings_policy(tmp_path: Path) -> None:
    strict = Rig(tmp_path / "strict")  # reclaimable-only: a time-slicing GPU cannot reclaim
    cfg = [share_config(memoryLimit="8Gi")]
    strict.prepare(claim("u1", result("gpu-0", "4Gi"), config=cfg))
    assert strict.env("u1")["NVIDIA_GPU_MEMORY_LIMIT"] == "4096"
    dev = strict.checkpoint()["claims"]["u1"]["devices"][0]
    assert dev["ceiling_policy"] == "ignored: no-reclaim"
    assert dev["ceiling_source"] == "claim default/claim-u1 config (FromClaim)"

    loose = Rig(tmp_path / "loose", {"ceilings": "allow-overcommit"})
    loose.prepare(claim("u1", result("gpu-0", "4Gi"), config=cfg))
    assert loose.env("u1")["NVIDIA_GPU_MEMORY_REQUEST"] == "4096"
    assert loose.env("u1")["NVIDIA_GPU_MEMORY_LIMIT"] == "8192"
    assert loose.checkpoint()["claims"]["u1"]["devices"][0]["ceiling_policy"] == "overcommit"


def test_config_for_another_request_or_driver_does_not_apply(tmp_path: Path) -> None:
    rig = Rig(tmp_path, {"ceilings": "allow-overcommit"})
    other_driver = share_config(memoryLimit="16Gi")
    other_driver["opaque"]["driver"] = "gpu.nvidia.com"
    cfg = [share_config(["other"], memoryLimit="8Gi"), other_driver]
    rig.prepare(claim("u1", result("gpu-0", "4Gi"), config=cfg))
    assert rig.env("u1")["NVIDIA_GPU_MEMORY_LIMIT"] == "4096"


def test_sm_sharing_share_gets_mps_wiring_and_the_pinned_limit(tmp_path: Path) -> None:
    rig = Rig(tmp_path, {"ceilings": "allow-overcommit"})
    cfg = [share_config(["gpu"], memoryLimit="6Gi", activeThreadPercentage=30)]
    out = rig.prepare(claim("u1", result("gpu-1", "2Gi"), config=cfg))
    assert out["u1"].error is None
    env = rig.env("u1")
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=6144M"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    pipe = str(tmp_path / "mps" / rig.uuid(1) / "pipe")
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == pipe  # the daemon's own path, mounted there
    mounts = rig.spec("u1")["devices"][0]["containerEdits"]["mounts"]
    assert {(m["hostPath"], m["containerPath"]) for m in mounts} == {
        (pipe, pipe),
        (str(tmp_path / "mps" / rig.uuid(1) / "shm"), "/dev/shm"),
    }
    assert rig.mps.ensured == [rig.uuid(1)]


def test_sm_sharing_without_config_limits_to_the_request(rig: Rig) -> None:
    rig.prepare(claim("u1", result("gpu-1", "2Gi")))
    env = rig.env("u1")
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env  # default 100: no restriction


def test_exclusive_gpu_is_the_whole_gpu_without_caps(rig: Rig) -> None:
    cfg = [share_config(memoryLimit="1Gi")]
    out = rig.prepare(claim("u1", result("gpu-2", memory=None, share=None), config=cfg))
    (dev,) = out["u1"].devices
    assert dev.share_id is None
    # the driver's device alone: an edit-less device of ours would not start the container
    assert list(dev.cdi_device_ids) == [f"nvidia.com/gpu={rig.uuid(2)}"]
    assert not cdi_specs.claim_spec_path(rig.cdi_dir, "u1").exists()
    entry = rig.checkpoint()["claims"]["u1"]["devices"][0]
    assert entry["request_bytes"] == rig.usable(2) and entry["limit_mib"] is None
    again = rig.prepare(claim("u2", result("gpu-2", memory=None, share=None)))
    assert again["u2"].error is not None and "beyond its capacity" in again["u2"].error


def test_two_results_in_one_claim_share_one_spec(rig: Rig) -> None:
    obj = claim("u1", result("gpu-0", "2Gi", "a", "s-a"), result("gpu-2", None, "b", None))
    (a, b) = rig.prepare(obj)["u1"].devices
    assert (a.request_names, b.request_names) == (("a",), ("b",))
    assert [d["name"] for d in rig.spec("u1")["devices"]] == ["u1-gpu-0-0"]  # gpu-2: whole
    assert rig.env("u1", 0)["NVIDIA_GPU_MEMORY_REQUEST"] == "2048"
    assert b.cdi_device_ids == (f"nvidia.com/gpu={rig.uuid(2)}",)


# ---- idempotence and refusals -----------------------------------------------------------


def test_prepare_is_idempotent_and_answers_from_the_checkpoint(rig: Rig) -> None:
    obj = claim("u1", result("gpu-0", "4Gi"))
    first = rig.prepare(obj)
    calls = rig.claims.calls
    cdi_specs.claim_spec_path(rig.cdi_dir, "u1").unlink()  # even a lost spec comes back
    assert rig.prepare(obj) == first
    assert rig.claims.calls == calls  # no second read of the claim
    assert rig.spec("u1")["devices"][0]["name"] == "u1-gpu-0-0"
    # the same claim again does not count twice against the device
    big = claim("u2", result("gpu-0", f"{(rig.usable(0) - 4 * GIB) // MIB}Mi", share="s-2"))
    assert rig.prepare(big)["u2"].error is None


def test_wrong_uid_is_refused_and_nothing_is_written(rig: Rig) -> None:
    rig.claims.add(claim("new-uid", name="web"))
    out = rig.preparer.prepare([ClaimRef("default", "web", "old-uid")])
    assert out["old-uid"].error is not None and "replaced" in out["old-uid"].error
    assert not rig.cdi_dir.exists() or not list(rig.cdi_dir.iterdir())
    assert not (rig.tmp / "state" / "dra-checkpoint.json").exists()


def test_unallocated_and_missing_claims_are_refused(rig: Rig) -> None:
    out = rig.prepare(claim("u1", allocated=False))
    assert out["u1"].error == "ResourceClaim default/claim-u1 is not allocated"
    out = rig.preparer.prepare([ClaimRef("default", "gone", "u9")])
    assert out["u9"].error == "ResourceClaim default/gone not found"


def test_only_this_drivers_results_on_this_node_are_prepared(rig: Rig) -> None:
    theirs = result("gpu-0", driver="gpu.nvidia.com")
    out = rig.prepare(claim("u1", theirs))
    assert out["u1"].error is not None and "no device of driver gpu-fraction.dev" in out["u1"].error
    mixed = claim("u2", theirs, result("gpu-0", "1Gi", "mine"), result("gpu-0", pool="node-b"))
    (dev,) = rig.prepare(mixed)["u2"].devices
    assert dev.request_names == ("mine",)


def test_a_device_plugin_gpu_is_not_prepared(rig: Rig) -> None:
    out = rig.prepare(claim("u1", result("gpu-3")), claim("u2", result("gpu-9")))
    assert "gpu-3 is not a DRA GPU" in str(out["u1"].error)
    assert "gpu-9 is not a DRA GPU" in str(out["u2"].error)


def test_over_capacity_across_claims_is_refused_until_unprepared(rig: Rig) -> None:
    usable_gib = rig.usable(0) // GIB
    first = claim("u1", result("gpu-0", f"{usable_gib - 3}Gi", share="s-1"))
    second = claim("u2", result("gpu-0", "4Gi", share="s-2"))
    out = rig.prepare(first, second)
    assert out["u1"].error is None
    assert out["u2"].error is not None and "beyond its capacity" in out["u2"].error
    assert not cdi_specs.claim_spec_path(rig.cdi_dir, "u2").exists()
    assert rig.preparer.unprepare([ClaimRef("default", "claim-u1", "u1")]) == {"u1": None}
    assert rig.prepare(second)["u2"].error is None


def test_mps_client_limit_counts_prepared_shares(tmp_path: Path) -> None:
    rig = Rig(tmp_path, {"mps": {"maxClients": 2}})
    out = rig.prepare(*(claim(f"u{n}", result("gpu-1", "1Gi", share=f"s{n}")) for n in range(3)))
    assert [out[f"u{n}"].error is None for n in range(3)] == [True, True, False]
    assert "mps.maxClients 2" in str(out["u2"].error)


def test_mps_not_ready_fails_the_claim_and_rolls_back(rig: Rig) -> None:
    rig.mps.ready = False
    out = rig.prepare(claim("u1", result("gpu-1", "1Gi")))
    assert out["u1"].error == f"MPS daemon for {rig.uuid(1)} is not ready yet"
    assert rig.checkpoint()["claims"] == {}
    assert not cdi_specs.claim_spec_path(rig.cdi_dir, "u1").exists()


def test_api_server_down_fails_only_that_call(rig: Rig) -> None:
    rig.claims.down = True
    out = rig.prepare(claim("u1"))
    assert out["u1"].error is not None and "connection refused" in out["u1"].error


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"memoryLimit": "lots"}, "parameters.memoryLimit: 'lots' is not a quantity"),
        ({"activeThreadPercentage": 0}, "parameters.activeThreadPercentage: must be"),
        ({"memoryLimt": "8Gi"}, "parameters: unknown fields ['memoryLimt']"),
        (
            {"kind": "Other"},
            "parameters: want apiVersion gpu-fraction.dev/v1 and kind GpuShareConfig",
        ),
    ],
)
def test_bad_claim_config_is_named_by_path(rig: Rig, params: dict[str, Any], message: str) -> None:
    out = rig.prepare(claim("u1", result("gpu-0"), config=[share_config(**params)]))
    assert f"status.allocation.devices.config[0].opaque.{message}" in str(out["u1"].error)


def test_an_overlong_quantity_fails_only_its_claim(rig: Rig) -> None:
    # 5,000 digits: Python's int() refuses text past 4,300 digits with its own ValueError,
    # which escaped as INTERNAL and failed every claim in the call (issue 33).
    out = rig.prepare(claim("u1", result("gpu-0", "9" * 5000)), claim("u2", result("gpu-0", "1Gi")))
    assert "consumedCapacity.memory: is 5000 characters long, over the 64 allowed" in str(
        out["u1"].error
    )
    assert out["u2"].error is None


# ---- unprepare, restarts, reboots -------------------------------------------------------


def test_unprepare_works_from_the_checkpoint_after_the_claim_is_deleted(rig: Rig) -> None:
    rig.prepare(claim("u1", result("gpu-1", "1Gi")))
    rig.claims.objects.clear()
    ref = ClaimRef("default", "claim-u1", "u1")
    assert rig.preparer.unprepare([ref, ClaimRef("default", "never", "u7")]) == {
        "u1": None,
        "u7": None,
    }
    assert not cdi_specs.claim_spec_path(rig.cdi_dir, "u1").exists()
    assert rig.checkpoint()["claims"] == {}
    assert rig.preparer.unprepare([ref]) == {"u1": None}


def test_plugin_restart_between_prepare_and_unprepare(rig: Rig) -> None:
    first = rig.prepare(claim("u1", result("gpu-0", "4Gi")))
    rig.claims.objects.clear()
    restarted = rig.fresh()
    assert restarted.prepare([ClaimRef("default", "claim-u1", "u1")]) == first
    assert {GpuUuid(rig.uuid(0))} == restarted.gpus_in_use()
    assert restarted.unprepare([ClaimRef("default", "claim-u1", "u1")]) == {"u1": None}
    assert not cdi_specs.claim_spec_path(rig.cdi_dir, "u1").exists()


def test_restart_keeps_capacity_accounting(rig: Rig) -> None:
    usable_gib = rig.usable(0) // GIB
    rig.prepare(claim("u1", result("gpu-0", f"{usable_gib - 1}Gi")))
    rig.fresh()
    out = rig.prepare(claim("u2", result("gpu-0", "2Gi")))
    assert "beyond its capacity" in str(out["u2"].error)


def _interrupted(rig: Rig, uid: str) -> None:
    """What a crash between Started and Completed leaves: the entry and maybe its spec."""
    cp = Checkpoint.in_state_dir(rig.tmp / "state", lambda: rig.boot)
    cp.load()
    cp.put(ClaimEntry(uid, "default", f"claim-{uid}", State.STARTED, (), None))
    spec = cdi_specs.build_spec(f"{uid}-gpu-0-0", {"A": "1"}, kind=cdi_specs.CLAIM_KIND)
    cdi_specs.write_spec(rig.cdi_dir, spec, cdi_specs.claim_spec_path(rig.cdi_dir, uid))


def test_a_started_entry_is_rolled_back_at_start(rig: Rig) -> None:
    rig.prepare(claim("u1", result("gpu-0", "1Gi")))
    _interrupted(rig, "u2")
    rig.fresh()
    assert sorted(rig.checkpoint()["claims"]) == ["u1"]
    assert not cdi_specs.claim_spec_path(rig.cdi_dir, "u2").exists()
    assert cdi_specs.claim_spec_path(rig.cdi_dir, "u1").exists()


def test_reboot_rewrites_completed_specs_and_drops_started_entries(rig: Rig) -> None:
    rig.prepare(claim("u1", result("gpu-1", "1Gi")))
    _interrupted(rig, "u2")
    before = rig.spec("u1")
    for path in rig.cdi_dir.iterdir():  # /var/run/cdi is a tmpfs
        path.unlink()
    rig.mps.ensured.clear()
    rig.fresh(boot="boot-2")
    doc = rig.checkpoint()
    assert doc["bootID"] == "boot-2" and sorted(doc["claims"]) == ["u1"]
    assert rig.spec("u1") == before
    assert not cdi_specs.claim_spec_path(rig.cdi_dir, "u2").exists()
    assert rig.mps.ensured == [rig.uuid(1)]  # its daemon is nudged before any prepare


def test_an_untrustworthy_checkpoint_is_an_error(rig: Rig) -> None:
    rig.prepare(claim("u1"))
    journal = rig.tmp / "state" / "dra-checkpoint.journal"
    lines = journal.read_bytes().splitlines(keepends=True)
    assert len(lines) == 2  # Started, then Completed
    journal.write_bytes(lines[0].replace(b'"request_bytes": ', b'"request_bytes": 1') + lines[1])
    with pytest.raises(CheckpointError, match="line 1: checksum"):
        rig.fresh()
    garbled = b"{not json"  # a line whose checksum holds, but not its content
    journal.write_bytes(hashlib.sha256(garbled).hexdigest().encode() + b" " + garbled + b"\n")
    with pytest.raises(CheckpointError, match="line 1: unreadable"):
        rig.fresh()
    journal.write_bytes(b"".join(lines))
    rig.fresh().prepare([])  # restores, and folds nothing: the journal is short
    cp = Checkpoint.in_state_dir(rig.tmp / "state", lambda: rig.boot)
    cp.load()
    cp.save()  # a compaction: the snapshot holds u1, the journal is gone
    assert not journal.exists()
    path = rig.tmp / "state" / "dra-checkpoint.json"
    doc = json.loads(path.read_text())
    doc["claims"]["u1"]["devices"][0]["request_bytes"] = 1
    path.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="checksum"):
        rig.fresh()
    path.write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable"):
        rig.fresh()


def test_a_torn_last_journal_line_is_a_change_that_never_happened(rig: Rig) -> None:
    rig.prepare(claim("u1", result("gpu-0", "1Gi", share="s-1")))
    journal = rig.tmp / "state" / "dra-checkpoint.journal"
    whole = journal.read_bytes()
    rig.prepare(claim("u2", result("gpu-0", "1Gi", share="s-2")))
    torn = journal.read_bytes()[len(whole) :]
    journal.write_bytes(whole + torn[: len(torn) // 3])  # a crash mid-append of u2's Started
    rig.fresh()
    assert sorted(rig.checkpoint()["claims"]) == ["u1"]


def test_a_started_line_holds_the_claims_cdi_spec_as_its_file_does(rig: Rig) -> None:
    """The spec's text is spliced into the journal line, not encoded again: the line still
    parses, sums, and holds the entry whole."""
    rig.prepare(claim("u1", result("gpu-1", "2Gi", share="s-1")))
    journal = rig.tmp / "state" / "dra-checkpoint.journal"
    lines = journal.read_bytes().splitlines()
    digest, _, payload = lines[0].partition(b" ")
    assert hashlib.sha256(payload).hexdigest().encode() == digest
    change = json.loads(payload)
    assert change["op"] == "put" and change["entry"]["state"] == State.STARTED.value
    assert change["entry"]["cdi_spec"] == rig.spec("u1")
    assert change["entry"]["devices"][0]["gpu"] == rig.uuid(1)
    assert rig.checkpoint()["claims"]["u1"]["cdi_spec"] == rig.spec("u1")


def test_admin_access_is_never_charged(rig: Rig) -> None:
    rig.prepare(claim("u1", result("gpu-2", memory=None, share=None)))
    watcher = result("gpu-2", memory=None, share=None)
    watcher["adminAccess"] = True
    out = rig.prepare(claim("u2", watcher))
    assert out["u2"].error is None
    assert list(out["u2"].devices[0].cdi_device_ids) == [f"nvidia.com/gpu={rig.uuid(2)}"]
    assert rig.checkpoint()["claims"]["u2"]["devices"][0]["admin_access"] is True


def test_config_for_a_request_applies_to_its_subrequests(tmp_path: Path) -> None:
    rig = Rig(tmp_path, {"ceilings": "allow-overcommit"})
    cfg = [share_config(["gpu"], memoryLimit="8Gi"), share_config(["gpu/big"], memoryLimit="9Gi")]
    small = result("gpu-0", "2Gi", request="gpu/small", share="s-1")
    big = result("gpu-0", "2Gi", request="gpu/big", share="s-2")
    out = rig.prepare(claim("u1", small, config=cfg), claim("u2", big, config=cfg))
    assert rig.env("u1")["NVIDIA_GPU_MEMORY_LIMIT"] == "8192"
    assert rig.env("u2")["NVIDIA_GPU_MEMORY_LIMIT"] == "9216"  # the later, narrower entry
    # The kubelet matches a container's request name exactly, and pods name requests, not
    # subrequests: the answer names the request; the checkpoint keeps the subrequest.
    assert [d.request_names for d in out["u1"].devices] == [("gpu",)]
    assert rig.checkpoint()["claims"]["u2"]["devices"][0]["request"] == "gpu/big"


def test_a_call_of_many_claims_costs_one_durable_checkpoint_save(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    syncs: list[int] = []
    writes: list[int] = []
    real, real_write = os.fdatasync, os.write
    monkeypatch.setattr(os, "fdatasync", lambda fd: (syncs.append(fd), real(fd))[1])
    monkeypatch.setattr(os, "write", lambda fd, b: (writes.append(fd), real_write(fd, b))[1])
    journal = rig.tmp / "state" / "dra-checkpoint.journal"
    objs = [claim(f"u{n}", result("gpu-0", "1Gi", share=f"s-{n}")) for n in range(8)]
    out = rig.prepare(*objs)
    assert all(r.error is None for r in out.values())
    assert len(syncs) == 1  # one fdatasync for the call, before any answer
    assert len(journal.read_bytes().splitlines()) == 8 + 8  # Started, then Completed, each
    # each Started line before its claim's spec; the Completed lines ride along, the last
    # with the sync: 9 writes, not 16
    assert writes.count(syncs[0]) == 9
    assert not (rig.tmp / "state" / "dra-checkpoint.json").exists()  # no snapshot rewrite
    # what a restart reads back: every claim Completed
    states = {uid: e["state"] for uid, e in rig.checkpoint()["claims"].items()}
    assert states == {f"u{n}": State.COMPLETED.value for n in range(8)}
    rig.preparer.unprepare([ClaimRef("default", f"claim-u{n}", f"u{n}") for n in range(8)])
    assert len(syncs) == 2  # the call's removals: one more
    assert rig.checkpoint()["claims"] == {}
    rig.preparer.unprepare([ClaimRef("default", "claim-u0", "u0")])  # unknown now: nothing
    assert len(syncs) == 2


def test_a_completed_line_waits_for_the_sync_and_a_crash_before_it_rolls_back(
    rig: Rig,
) -> None:
    """No answer leaves before the call's sync, so until then Started is the truth on disk."""
    rig.prepare(claim("u1", result("gpu-0", "1Gi", share="s-1")))
    state = rig.tmp / "state"
    cp = Checkpoint.in_state_dir(state, lambda: rig.boot)
    cp.load()
    done = cp.get("u1")
    assert done is not None
    cp.put(dataclasses.replace(done, uid="u2", name="claim-u2", state=State.STARTED), False)
    cp.complete("u2", save=False)

    def after_a_crash() -> State | None:
        restarted = Checkpoint.in_state_dir(state, lambda: rig.boot)
        restarted.load()
        entry = restarted.get("u2")
        return None if entry is None else entry.state

    assert after_a_crash() is State.STARTED  # rolled back at start: no answer left
    cp.sync()
    assert after_a_crash() is State.COMPLETED


def test_the_journal_is_folded_into_the_snapshot_by_unprepare(rig: Rig) -> None:
    journal = rig.tmp / "state" / "dra-checkpoint.journal"
    snapshot = rig.tmp / "state" / "dra-checkpoint.json"
    for n in range(40):  # 3 lines each: past COMPACT_AFTER (64) with few entries held
        rig.prepare(claim(f"u{n}", result("gpu-0", "1Gi", share=f"s-{n}")))
        rig.preparer.unprepare([ClaimRef("default", f"claim-u{n}", f"u{n}")])
    assert snapshot.exists()
    left = journal.read_bytes().splitlines() if journal.exists() else []
    assert len(left) <= 64
    rig.prepare(claim("kept", result("gpu-0", "1Gi", share="s-k")))
    assert sorted(rig.checkpoint()["claims"]) == ["kept"]


def test_a_crash_in_a_compaction_brings_back_no_claim_it_had_unprepared(rig: Rig) -> None:
    # Unprepare's removals go into the snapshot from memory, before their journal lines are
    # written; a crash before the old journal is removed leaves it beside the new snapshot,
    # and its lines must not bring the removed claims back (they would hold capacity).
    journal = rig.tmp / "state" / "dra-checkpoint.journal"
    snapshot = rig.tmp / "state" / "dra-checkpoint.json"
    rig.prepare(claim("first", result("gpu-0", "1Gi", share="s-f")))
    crashes = 0
    for n in range(40):
        before = snapshot.stat().st_mtime_ns if snapshot.exists() else None
        old_lines = journal.read_bytes() if journal.exists() else b""
        rig.preparer.unprepare([ClaimRef("default", f"claim-u{n - 1}", f"u{n - 1}")])
        if (snapshot.stat().st_mtime_ns if snapshot.exists() else None) != before:
            crashes += 1
            crashed = rig.tmp / f"crash-{n}"
            crashed.mkdir()
            (crashed / snapshot.name).write_bytes(snapshot.read_bytes())
            (crashed / journal.name).write_bytes(old_lines)
            cp = Checkpoint.in_state_dir(crashed, lambda: rig.boot)
            cp.load()
            assert sorted(e.uid for e in cp) == sorted(e.uid for e in rig.preparer.prepared())
            cp.put(dataclasses.replace(cp.get("first"), uid="later", name="later"))  # type: ignore[arg-type]
            again = Checkpoint.in_state_dir(crashed, lambda: rig.boot)
            again.load()  # a change after the crash is numbered past the snapshot: it applies
            assert sorted(e.uid for e in again) == ["first", "later"]
        rig.prepare(claim(f"u{n}", result("gpu-0", "1Gi", share=f"s-{n}")))
    assert crashes >= 1  # compactions happened between the prepares
    assert sorted(rig.checkpoint()["claims"]) == ["first", "u39"]


def test_a_checkpoint_written_before_changes_were_numbered_still_loads(rig: Rig) -> None:
    # An upgrade finds files an older plugin wrote: a snapshot without `seq` (summed without
    # it) and journal lines without one; every line applies, in order.
    from deviceplugin.dra import checkpoint as ckpt

    state = rig.tmp / "state"
    rig.prepare(claim("u1", result("gpu-0", "1Gi", share="s-1")))
    rig.preparer._checkpoint.save()
    snapshot = state / ckpt.CHECKPOINT_FILE
    doc = json.loads(snapshot.read_text())
    del doc["seq"]
    doc["checksum"] = ckpt._checksum(doc["claims"], doc["bootID"], None)
    snapshot.write_text(json.dumps(doc))
    rig.prepare(claim("u2", result("gpu-0", "1Gi", share="s-2")))
    rig.preparer.unprepare([ClaimRef("default", "claim-u1", "u1")])
    journal = state / "dra-checkpoint.journal"
    lines = []
    for line in journal.read_bytes().splitlines():
        change = json.loads(line.partition(b" ")[2])
        assert change.pop("seq") > 0
        payload = json.dumps(change).encode()
        lines.append(hashlib.sha256(payload).hexdigest().encode() + b" " + payload)
    journal.write_bytes(b"\n".join(lines) + b"\n")
    assert sorted(rig.checkpoint()["claims"]) == ["u2"]


def test_a_journal_deleted_behind_our_back_is_rebuilt_by_the_next_sync(rig: Rig) -> None:
    # The open fd would write on into an unlinked file that no restart reads.
    journal = rig.tmp / "state" / "dra-checkpoint.journal"
    rig.prepare(claim("u1", result("gpu-0", "1Gi")))
    journal.unlink()
    rig.prepare(claim("u2", result("gpu-0", "1Gi", share="s-2")))
    assert sorted(rig.checkpoint()["claims"]) == ["u1", "u2"]
    rig.prepare(claim("u3", result("gpu-0", "1Gi", share="s-3")))  # a new journal goes on
    assert journal.exists()
    assert sorted(rig.checkpoint()["claims"]) == ["u1", "u2", "u3"]


def test_a_failed_durable_save_reports_no_claim_prepared_and_the_retry_answers(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    real = os.fdatasync

    def failing(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", failing)
    out = rig.prepare(claim("u1", result("gpu-0", "1Gi", share="s-1")))
    assert out["u1"].error is not None and "checkpoint not saved" in out["u1"].error
    monkeypatch.setattr(os, "fdatasync", real)
    again = rig.prepare(claim("u1", result("gpu-0", "1Gi", share="s-1")))
    assert again["u1"].error is None and again["u1"].devices
    # the retry did not trust the journal a failed sync left: it rewrote the snapshot
    assert (rig.tmp / "state" / "dra-checkpoint.json").exists()
    assert rig.checkpoint()["claims"]["u1"]["state"] == State.COMPLETED.value


def test_a_restart_queues_every_prepared_claim_for_its_status_record(rig: Rig) -> None:
    rig.prepare(claim("u1", result("gpu-0", "1Gi", share="s-1")))
    assert rig.on_prepared == [("u1", True)]  # with the claim prepare read
    failed = rig.prepare(claim("u2", result("gpu-0", "999Gi", share="s-2")))
    assert failed["u2"].error is not None and rig.on_prepared == [("u1", True)]
    rig.fresh()  # a write the restart cut short is done again (the writer reads the claim)
    assert rig.on_prepared == [("u1", True), ("u1", False)]


# ---- shapes worked out once -------------------------------------------------------------


def test_claims_of_one_shape_share_its_edits_and_differ_where_they_differ(tmp_path: Path) -> None:
    # Results of one shape (GPU, request, ceiling decision, thread share) share their checked
    # CDI edits; every other input is a new shape, never the last one's answer.
    rig = Rig(tmp_path, {"ceilings": "allow-overcommit"})
    eight, six = [share_config(memoryLimit="8Gi")], [share_config(memoryLimit="6Gi")]
    out = rig.prepare(
        claim("u1", result("gpu-0", "4Gi"), config=eight),
        claim("u2", result("gpu-0", "4Gi", share="s-2"), config=eight),
        claim("u3", result("gpu-0", "4Gi", share="s-3"), config=six),
        claim("u4", result("gpu-0", "4Gi", share="s-4")),
        claim("9u5", result("gpu-0", "4Gi", share="s-5"), config=eight),
    )
    assert all(r.error is None for r in out.values()), out
    limits = {uid: rig.env(uid)["NVIDIA_GPU_MEMORY_LIMIT"] for uid in out}
    assert limits == {"u1": "8192", "u2": "8192", "u3": "6144", "u4": "4096", "9u5": "8192"}
    devices = rig.checkpoint()["claims"]
    assert (
        devices["u2"]["devices"][0]["ceiling_source"] == "claim default/claim-u2 config (FromClaim)"
    )
    assert devices["u4"]["devices"][0]["ceiling_source"] is None
    # a device name that starts with a digit needs CDI 0.5.0; the same edits otherwise
    assert rig.spec("u1")["cdiVersion"] < "0.5.0" <= rig.spec("9u5")["cdiVersion"]
    assert (
        rig.spec("9u5")["devices"][0]["containerEdits"]
        == rig.spec("u1")["devices"][0]["containerEdits"]
    )
    assert cdi_specs.validate_spec(rig.spec("9u5")) == []
    rig.config = parse({**MODES, "mps": {"activeThreadPercentage": 50}})  # a reload
    rig.prepare(claim("u6", result("gpu-0", "4Gi", share="s-6"), config=eight))
    assert rig.env("u6")["NVIDIA_GPU_MEMORY_LIMIT"] == "4096"  # reclaimable-only now: ignored


def test_an_sm_sharing_ceiling_follows_the_daemons_accounting_each_time(tmp_path: Path) -> None:
    rig = Rig(tmp_path, {"mps": {"protocolVersion": 3}})
    assert rig.plan.gpus[1].reclaimable  # protocol 3: reclaimable once the daemon proves it
    cfg = [share_config(memoryLimit="6Gi")]
    rig.prepare(claim("u1", result("gpu-1", "2Gi"), config=cfg))
    rig.mps.accounting = True
    rig.prepare(claim("u2", result("gpu-1", "2Gi", share="s-2"), config=cfg))
    rig.mps.accounting = False
    rig.prepare(claim("u3", result("gpu-1", "2Gi", share="s-3"), config=cfg))
    pinned = [rig.env(u)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] for u in ("u1", "u2", "u3")]
    assert pinned == ["0=2048M", "0=6144M", "0=2048M"]
    policies = [rig.checkpoint()["claims"][u]["devices"][0]["ceiling_policy"] for u in ("u1", "u2")]
    assert policies == ["ignored: no-reclaim", "applied"]


def test_a_uid_that_makes_no_cdi_name_is_refused(rig: Rig) -> None:
    out = rig.prepare(claim("bad/uid", result("gpu-0", "1Gi")))
    assert out["bad/uid"].error is not None and "no valid CDI device name" in out["bad/uid"].error
    assert rig.checkpoint()["claims"] == {}


def test_a_claim_refused_in_a_call_holds_nothing_for_the_next(rig: Rig) -> None:
    # The call's tally takes a claim's holdings only once it is prepared.
    usable_gib = rig.usable(0) // GIB
    too_big = claim("u1", result("gpu-0", "1Gi"), result("gpu-0", f"{usable_gib}Gi", "b", "s-b"))
    fits = claim("u2", result("gpu-0", f"{usable_gib}Gi", share="s-2"))
    out = rig.prepare(too_big, fits)
    assert out["u1"].error is not None and "beyond its capacity" in out["u1"].error
    assert out["u2"].error is None


# ---- serialised per GPU, not per node ---------------------------------------------------


class SlowMps(FakeMps):
    """GPU `slow`'s daemon is not ready until `release` is set (or `timeout` passes)."""

    def __init__(self, slow: str) -> None:
        super().__init__()
        self.slow = slow
        self.release = threading.Event()
        self.waiting = threading.Event()

    def ensure(self, gpu: GpuUuid) -> bool:
        self.ensured.append(gpu)
        return gpu != self.slow or self.release.is_set()

    def wait_ready(self, gpu: GpuUuid, timeout: float) -> bool:
        self.waiting.set()
        return self.release.wait(timeout)


def test_a_claim_waiting_for_one_gpus_mps_daemon_delays_no_other_gpu(rig: Rig) -> None:
    slow = SlowMps(rig.uuid(1))
    rig.mps = slow
    rig.fresh()
    waiting = claim("u-slow", result("gpu-1", "2Gi", share="s-1"))
    out: dict[str, PrepareResult] = {}
    worker = threading.Thread(target=lambda: out.update(rig.prepare(waiting)))
    worker.start()
    try:
        assert slow.waiting.wait(5)  # holding GPU 1 while its daemon starts
        started = time.monotonic()
        other = rig.prepare(claim("u-b", result("gpu-0", "2Gi", share="s-2")))
        whole = rig.prepare(claim("u-c", result("gpu-2", None, share=None)))
        undone = rig.preparer.unprepare([ClaimRef("default", "claim-u-b", "u-b")])
        took = time.monotonic() - started
        assert other["u-b"].error is None and whole["u-c"].error is None
        assert undone == {"u-b": None}
        assert took < 1.0 and worker.is_alive()  # the sm-sharing claim still waits
    finally:
        slow.release.set()
        worker.join(10)
    assert out["u-slow"].error is None
    assert set(rig.checkpoint()["claims"]) == {"u-slow", "u-c"}


def test_two_claims_on_one_gpu_take_turns_and_never_overfill_it(rig: Rig) -> None:
    most = f"{(rig.usable(0) // MIB) // 2 + 1024}Mi"  # two of them do not fit
    objs = [claim(f"u{n}", result("gpu-0", most, share=f"s{n}")) for n in range(4)]
    refs = [rig.claims.add(o) for o in objs]
    answers: dict[str, PrepareResult] = {}
    threads = [
        threading.Thread(target=lambda r=r: answers.update(rig.preparer.prepare([r]))) for r in refs
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(a.error is None for a in answers.values()) == [False, False, False, True]


# ---- several of our devices in one container --------------------------------------------

TWO_OF_EACH = {
    "gpus": [
        {"match": {"index": 0}, "mode": "time-slicing"},
        {"match": {"index": 1}, "mode": "time-slicing"},
        {"match": {"index": 2}, "mode": "sm-sharing"},
        {"match": {"index": 3}, "mode": "sm-sharing"},
        {"match": {"index": 4}, "mode": "exclusive"},
    ]
}


@pytest.fixture
def wide(tmp_path: Path) -> Rig:
    return Rig(tmp_path, TWO_OF_EACH)


@pytest.mark.parametrize(
    "other",
    [
        result("gpu-3", "2Gi", request="gpu", share="s-2"),  # count: 2 on two sm-sharing GPUs
        result("gpu-2", "2Gi", request="more", share="s-2"),  # a second share of the same GPU
        result("gpu-0", "2Gi", request="ts", share="s-2"),
        result("gpu-4", None, request="whole", share=None),
    ],
)
def test_an_sm_sharing_device_must_be_its_claims_only_device(
    wide: Rig, other: dict[str, Any]
) -> None:
    out = wide.prepare(claim("u1", result("gpu-2", "2Gi", share="s-1"), other))
    error = out["u1"].error
    assert error is not None and "ResourceClaim default/claim-u1" in error
    assert "must be the claim's only device" in error and "one MPS control daemon" in error
    assert wide.mps.ensured == []  # refused before any daemon was waited for
    assert "u1" not in wide.checkpoint()["claims"]
    assert wide.prepare(claim("u2", result("gpu-2", "2Gi", share="s-3")))["u2"].error is None


def test_time_slicing_shares_of_one_claim_need_the_same_amount(wide: Rig) -> None:
    same = wide.prepare(
        claim("u1", result("gpu-0", "4Gi", share="s-1"), result("gpu-1", "4Gi", share="s-2"))
    )
    assert same["u1"].error is None and len(same["u1"].devices) == 2
    # both devices' edits carry the same pair, so whichever CDI applies last is right for both
    assert (
        wide.env("u1", 0)["NVIDIA_GPU_MEMORY_LIMIT"] == wide.env("u1", 1)["NVIDIA_GPU_MEMORY_LIMIT"]
    )
    apart = wide.prepare(
        claim("u2", result("gpu-0", "2Gi", share="s-3"), result("gpu-1", "6Gi", share="s-4"))
    )
    error = apart["u2"].error
    assert error is not None and "different amounts in one claim" in error
    assert "gpu-0 (request gpu: 2048Mi, limit 2048Mi)" in error and "6144Mi" in error
    # a whole GPU beside a share carries no memory variables: allowed
    mixed = wide.prepare(
        claim("u3", result("gpu-0", "2Gi", share="s-5"), result("gpu-4", None, "b", None))
    )
    assert mixed["u3"].error is None
