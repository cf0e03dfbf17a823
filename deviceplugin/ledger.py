"""The allocation ledger: every live allocation, persisted so a plugin restart loses nothing.

A snapshot, `<state-dir>/allocations.json` (rewritten atomically), plus a journal of the
changes since, `allocations.journal` (one JSON line per add or remove), folded into a new
snapshot once it grows: an Allocate appends one line instead of rewriting every record. A
record's key is the sorted tuple of its device IDs. Records leave only through `remove` or
`reconcile` (pod-resources says the allocation is gone); that is also when its CDI spec file
is deleted, because the kubelet replays an Allocate answer for the pod's whole life.
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
JOURNAL_FILE = "allocations.journal"
FORMAT_VERSION = 1
# Pod-resources may not list a container's devices yet right after Allocate returns; a record
# it has never listed is kept this long.
DEFAULT_RECONCILE_GRACE = 60.0
# The kubelet allocates a pod's init and app containers in one admission, moments apart; an
# unlisted record overlapping a listed allocation made within this window is its init container.
INIT_WINDOW = 10.0
# Fold the journal into the snapshot once it has this many lines (and twice the records).
COMPACT_AFTER = 64

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
    """Thread-safe; every change is on disk (in the kernel) before the call returns."""

    def __init__(self, state_dir: Path, clock: Callable[[], float] = time.time) -> None:
        self._dir = state_dir
        self.path = state_dir / LEDGER_FILE
        self.journal = state_dir / JOURNAL_FILE
        self._clock = clock
        self._lock = threading.Lock()
        self._journal_lines = 0
        self._listed: set[Key] = set()  # keys pod-resources has shown at least once
        fsutil.ensure_dir(state_dir, 0o755)
        self._records: dict[Key, AllocationRecord] = self._load()

    # ---- persistence ---------------------------------------------------------------------
    def _load(self) -> dict[Key, AllocationRecord]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            raw = None
        try:
            records = _parse_snapshot(raw) if raw is not None else {}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            # Keep the bad files for a human; start empty rather than refuse to serve.
            stamp = int(self._clock())
            aside = self.path.with_name(f"{LEDGER_FILE}.corrupt-{stamp}")
            os.replace(self.path, aside)
            if self.journal.exists():
                os.replace(self.journal, self.journal.with_name(f"{JOURNAL_FILE}.corrupt-{stamp}"))
            logs.log(
                _log,
                "allocation ledger unreadable; starting empty",
                path=self.path,
                moved_to=aside,
                error=e,
            )
            records = {}
        self._replay(records)
        self._compact(records)
        return records

    def _replay(self, records: dict[Key, AllocationRecord]) -> None:
        try:
            lines = self.journal.read_bytes().splitlines()
        except FileNotFoundError:
            return
        for n, line in enumerate(lines):
            try:
                entry = json.loads(line)
                if entry["op"] == "add":
                    record = AllocationRecord.from_json(entry["record"])
                    records[record.key] = record
                else:
                    records.pop(key_of(entry["key"]), None)
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                # A crash mid-append leaves a torn last line; anything else is damage.
                logs.log(_log, "journal line skipped", line=n + 1, of=len(lines), error=e)

    def _compact(self, records: dict[Key, AllocationRecord]) -> None:
        body = {
            "version": FORMAT_VERSION,
            "allocations": [records[k].to_json() for k in sorted(records)],
        }
        # No fsync: a plugin crash loses nothing (the kernel has the data); a power loss
        # restarts every pod anyway, and Allocate must stay fast.
        fsutil.atomic_write(self.path, json.dumps(body).encode() + b"\n", 0o644, durable=False)
        # A crash here replays the old journal over the new snapshot: adds and removes are
        # idempotent, so the result is the same.
        fsutil.remove(self.journal)
        self._journal_lines = 0

    def _append(self, entries: list[dict[str, Any]], records: dict[Key, AllocationRecord]) -> None:
        if self._journal_lines + len(entries) > max(COMPACT_AFTER, 2 * len(records)):
            self._compact(records)
            return
        data = b"".join(json.dumps(e, separators=(",", ":")).encode() + b"\n" for e in entries)
        fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        self._journal_lines += len(entries)

    # ---- changes -------------------------------------------------------------------------
    def add(self, record: AllocationRecord) -> None:
        """Insert or replace the record with the same key."""
        with self._lock:
            records = dict(self._records)
            records[record.key] = record
            self._append([{"op": "add", "record": record.to_json()}], records)
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
            self._append([{"op": "remove", "key": list(record.key)}], records)
            self._records = records
            self._listed.discard(record.key)
        _drop_spec(record)
        return record

    # ---- reads ---------------------------------------------------------------------------
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

    # ---- pod-resources -------------------------------------------------------------------
    def reconcile(
        self,
        live_device_sets: Iterable[Collection[str]],
        grace: float = DEFAULT_RECONCILE_GRACE,
    ) -> list[AllocationRecord]:
        """Drop the records pod-resources no longer lists; return them.

        A record is live when a container holds exactly its devices, or when it is the init
        container of a listed allocation (it overlaps one made within INIT_WINDOW after it:
        the kubelet hands an init container's devices to the app container). A record that
        was listed before and no longer is goes at once; one never listed is kept `grace`
        seconds, since pod-resources lists an allocation only once it is committed.
        """
        listed = [key_of(devices) for devices in live_device_sets]
        cutoff = self._clock() - grace
        with self._lock:
            listed_keys = set(listed)
            self._listed |= listed_keys & self._records.keys()
            gone = [
                r
                for r in self._records.values()
                if r.key not in listed_keys
                and not self._is_init_of_listed(r, listed)
                and (r.key in self._listed or r.created < cutoff)
            ]
            if not gone:
                return []
            gone_keys = {r.key for r in gone}
            records = {k: r for k, r in self._records.items() if k not in gone_keys}
            self._append([{"op": "remove", "key": list(k)} for k in sorted(gone_keys)], records)
            self._records = records
            self._listed -= gone_keys
        for record in gone:
            _drop_spec(record)
            logs.log(_log, "allocation gone", devices=",".join(record.device_ids), gpu=record.gpu)
        return gone

    def _is_init_of_listed(self, record: AllocationRecord, listed: list[Key]) -> bool:
        devices = set(record.device_ids)
        for key in listed:
            if devices.isdisjoint(key):
                continue
            app = self._records.get(key)
            if app is None or 0 <= app.created - record.created <= INIT_WINDOW:
                return True
        return False


def read_records(state_dir: Path) -> list[AllocationRecord]:
    """The records on disk (snapshot plus journal), read without writing: for other processes."""
    try:
        records = _parse_snapshot((state_dir / LEDGER_FILE).read_bytes())
    except FileNotFoundError:
        records = {}
    try:
        lines = (state_dir / JOURNAL_FILE).read_bytes().splitlines()
    except FileNotFoundError:
        lines = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a torn last line
        if entry.get("op") == "add":
            record = AllocationRecord.from_json(entry["record"])
            records[record.key] = record
        else:
            records.pop(key_of(entry.get("key", ())), None)
    return [records[k] for k in sorted(records)]


def _parse_snapshot(raw: bytes) -> dict[Key, AllocationRecord]:
    data = json.loads(raw)
    if data.get("version") != FORMAT_VERSION:
        raise ValueError(f"unknown ledger version {data.get('version')!r}")
    records = [AllocationRecord.from_json(r) for r in data["allocations"]]
    return {r.key: r for r in records}


def _drop_spec(record: AllocationRecord) -> None:
    if record.cdi_spec:
        fsutil.remove(Path(record.cdi_spec))
