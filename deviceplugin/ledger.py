"""The allocation ledger: every live allocation, persisted so a plugin restart loses nothing.

One JSON file, `<state-dir>/allocations.json`, rewritten atomically on each change. A record's
key is the sorted tuple of its device IDs. Records leave only through `remove` or `reconcile`
(pod-resources says the allocation is gone); that is also when its CDI spec file is deleted,
because the kubelet replays an Allocate answer for the pod's whole life.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deviceplugin import fsutil, logs
from deviceplugin.model import Delivery, Enforcement, GpuUuid, Mode, SliceId

LEDGER_FILE = "allocations.json"
FORMAT_VERSION = 1
# Pod-resources may not list a container's devices yet right after Allocate returns.
DEFAULT_RECONCILE_GRACE = 60.0

Key = tuple[str, ...]

_log = logs.get("ledger")


def key_of(device_ids: Iterable[str]) -> Key:
    return tuple(sorted(device_ids))


@dataclass(frozen=True)
class AllocationRecord:
    device_ids: tuple[SliceId, ...]  # sorted
    resource: str
    gpus: tuple[GpuUuid, ...]  # one for fractional modes; exclusive may span several
    mode: Mode
    request_mib: int | None  # None for exclusive (no caps)
    limit_mib: int | None
    enforcement: tuple[Enforcement, ...]
    delivery: Delivery
    ceiling_source: str | None  # where a ceiling above the request came from, if any
    ceiling_policy: str | None  # applied | overcommit | ignored: no-reclaim | None
    cdi_spec: str | None  # path of this allocation's CDI spec file
    created: float  # wall-clock seconds

    @property
    def key(self) -> Key:
        return key_of(self.device_ids)

    @property
    def gpu(self) -> GpuUuid:
        return self.gpus[0]

    def to_json(self) -> dict[str, Any]:
        return {
            "deviceIds": list(self.device_ids),
            "resource": self.resource,
            "gpus": list(self.gpus),
            "mode": self.mode.value,
            "requestMiB": self.request_mib,
            "limitMiB": self.limit_mib,
            "enforcement": [e.value for e in self.enforcement],
            "delivery": self.delivery.value,
            "ceilingSource": self.ceiling_source,
            "ceilingPolicy": self.ceiling_policy,
            "cdiSpec": self.cdi_spec,
            "created": self.created,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AllocationRecord:
        def opt_int(v: object) -> int | None:
            return None if v is None else int(v)  # type: ignore[call-overload]

        def opt_str(v: object) -> str | None:
            return None if v is None else str(v)

        return cls(
            device_ids=tuple(SliceId(str(d)) for d in sorted(data["deviceIds"])),
            resource=str(data["resource"]),
            gpus=tuple(GpuUuid(str(g)) for g in data["gpus"]),
            mode=Mode(data["mode"]),
            request_mib=opt_int(data.get("requestMiB")),
            limit_mib=opt_int(data.get("limitMiB")),
            enforcement=tuple(Enforcement(e) for e in data["enforcement"]),
            delivery=Delivery(data["delivery"]),
            ceiling_source=opt_str(data.get("ceilingSource")),
            ceiling_policy=opt_str(data.get("ceilingPolicy")),
            cdi_spec=opt_str(data.get("cdiSpec")),
            created=float(data["created"]),
        )


class Ledger:
    """Thread-safe; every change is on disk before the call returns."""

    def __init__(self, state_dir: Path, clock: Callable[[], float] = time.time) -> None:
        self._dir = state_dir
        self.path = state_dir / LEDGER_FILE
        self._clock = clock
        self._lock = threading.Lock()
        fsutil.ensure_dir(state_dir, 0o755)
        self._records: dict[Key, AllocationRecord] = self._load()

    def _load(self) -> dict[Key, AllocationRecord]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        try:
            data = json.loads(raw)
            if data.get("version") != FORMAT_VERSION:
                raise ValueError(f"unknown ledger version {data.get('version')!r}")
            records = [AllocationRecord.from_json(r) for r in data["allocations"]]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            # Keep the bad file for a human; start empty rather than refuse to serve.
            aside = self.path.with_name(f"{LEDGER_FILE}.corrupt-{int(self._clock())}")
            os.replace(self.path, aside)
            logs.log(
                _log,
                "allocation ledger unreadable; starting empty",
                path=self.path,
                moved_to=aside,
                error=e,
            )
            self._save({})
            return {}
        return {r.key: r for r in records}

    def _save(self, records: dict[Key, AllocationRecord]) -> None:
        body = {
            "version": FORMAT_VERSION,
            "allocations": [records[k].to_json() for k in sorted(records)],
        }
        # No fsync: a plugin crash loses nothing (the kernel has the data); a power loss
        # restarts every pod anyway, and Allocate must stay fast.
        fsutil.atomic_write(self.path, json.dumps(body).encode() + b"\n", 0o644, durable=False)

    def add(self, record: AllocationRecord) -> None:
        """Insert or replace the record with the same key."""
        with self._lock:
            records = dict(self._records)
            records[record.key] = record
            self._save(records)
            self._records = records

    def get(self, key: Key) -> AllocationRecord | None:
        with self._lock:
            return self._records.get(key_of(key))

    def remove(self, key: Key) -> AllocationRecord | None:
        """Forget an allocation that is gone and delete its CDI spec file."""
        with self._lock:
            records = dict(self._records)
            record = records.pop(key_of(key), None)
            if record is None:
                return None
            self._save(records)
            self._records = records
        _drop_spec(record)
        return record

    def records(self) -> list[AllocationRecord]:
        with self._lock:
            return [self._records[k] for k in sorted(self._records)]

    def used_ids(self, resource: str) -> set[SliceId]:
        with self._lock:
            return {
                d for r in self._records.values() if r.resource == resource for d in r.device_ids
            }

    def live_count(self, gpu: GpuUuid, mode: Mode) -> int:
        with self._lock:
            return sum(1 for r in self._records.values() if r.mode is mode and gpu in r.gpus)

    def gpus_in_use(self) -> set[GpuUuid]:
        with self._lock:
            return {g for r in self._records.values() for g in r.gpus}

    def reconcile(
        self,
        live_device_sets: Iterable[Collection[str]],
        grace: float = DEFAULT_RECONCILE_GRACE,
    ) -> list[AllocationRecord]:
        """Drop records none of whose devices any live container holds; return them.

        A record sharing any device with a live container stays (an init container's record
        overlaps its app container's), as does one younger than `grace` seconds, which
        pod-resources may not list yet.
        """
        live = {d for devices in live_device_sets for d in devices}
        cutoff = self._clock() - grace
        with self._lock:
            gone = [
                r
                for r in self._records.values()
                if r.created < cutoff and not live.intersection(r.device_ids)
            ]
            if not gone:
                return []
            gone_keys = {r.key for r in gone}
            records = {k: r for k, r in self._records.items() if k not in gone_keys}
            self._save(records)
            self._records = records
        for record in gone:
            _drop_spec(record)
            logs.log(_log, "allocation gone", devices=",".join(record.device_ids), gpu=record.gpu)
        return gone


def _drop_spec(record: AllocationRecord) -> None:
    if record.cdi_spec:
        fsutil.remove(Path(record.cdi_spec))
