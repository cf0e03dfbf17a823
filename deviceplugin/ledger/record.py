"""The ledger's records and their files: what one allocation holds and how it is written down.

`AllocationRecord` (keyed by `key_of` its device IDs) and its JSON, the journal's `add` line
included; `Listing`, one pod-resources List as `Ledger.reconcile` reads it; the snapshot's and
journal's file names and encoding; and `read_records`, which reads them without writing, for
other processes. The `Ledger` (store.py) keeps them.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deviceplugin.model import Delivery, Enforcement, GpuUuid, Mode, SliceId

LEDGER_FILE = "allocations.json"
JOURNAL_FILE = "allocations.journal"
# A journal being folded into the snapshot (by the syncer thread): replayed before the journal.
FOLDING_FILE = "allocations.journal.folding"
FORMAT_VERSION = 1

Key = tuple[str, ...]
PodKey = tuple[str, str]  # (namespace, pod name)


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
    # The spec's body, to rewrite it after a reboot empties the CDI dir (absent in records
    # written before it was kept: those cannot be rebuilt).
    cdi_body: Mapping[str, Any] | None = field(default=None, compare=False)
    owner: PodKey | None = None  # the pod pod-resources last listed it under
    # `cdi_body` as the spec file holds it (JSON text), when the writer kept it: the journal
    # line embeds it instead of encoding the body a second time on the reply path.
    cdi_json: str | None = field(default=None, compare=False, repr=False)

    @property
    def key(self) -> Key:
        return key_of(self.device_ids)

    @property
    def gpu(self) -> GpuUuid:
        return self.gpus[0]

    def journal_line(self) -> bytes:
        """The journal's `add` line for this record, `{"op":"add","record":{...}}`."""
        if self.cdi_json is None or self.cdi_body is None:
            return entry_line({"op": "add", "record": self.to_json()})
        # On the Allocate reply path: what every record of one grant shape shares is encoded
        # once per shape, the spec's body comes as the spec file's text.
        own = json.dumps(
            {
                "deviceIds": self.device_ids,
                "cdiSpec": self.cdi_spec,
                "created": self.created,
                "owner": self.owner,
            },
            separators=(",", ":"),
        )
        shared = _shared_fields(
            self.resource,
            self.gpus,
            self.mode,
            self.request_mib,
            self.limit_mib,
            self.enforcement,
            self.delivery,
            self.ceiling_source,
            self.ceiling_policy,
        )
        return f'{{"op":"add","record":{own[:-1]},{shared},"cdiBody":{self.cdi_json}}}}}\n'.encode()

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
            "cdiBody": self.cdi_body,
            "owner": list(self.owner) if self.owner is not None else None,
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
            cdi_body=data.get("cdiBody"),
            owner=_owner(data.get("owner")),
        )


@functools.lru_cache(maxsize=1024)
def _shared_fields(
    resource: str,
    gpus: tuple[GpuUuid, ...],
    mode: Mode,
    request_mib: int | None,
    limit_mib: int | None,
    enforcement: tuple[Enforcement, ...],
    delivery: Delivery,
    ceiling_source: str | None,
    ceiling_policy: str | None,
) -> str:
    """The journal fields one grant shape's records share, as JSON members (no braces)."""
    members = json.dumps(
        {
            "resource": resource,
            "gpus": gpus,
            "mode": mode.value,
            "requestMiB": request_mib,
            "limitMiB": limit_mib,
            "enforcement": [e.value for e in enforcement],
            "delivery": delivery.value,
            "ceilingSource": ceiling_source,
            "ceilingPolicy": ceiling_policy,
        },
        separators=(",", ":"),
    )
    return members[1:-1]


def _owner(value: object) -> PodKey | None:
    if isinstance(value, list) and len(value) == 2:
        return (str(value[0]), str(value[1]))
    return None


@dataclass(frozen=True)
class Listing:
    """One pod-resources List: which pod holds each listed device set, and every pod shown
    (with or without devices: a pod whose only GPU container was an init container that
    finished still owns that container's answer)."""

    held: Mapping[Key, PodKey | None]  # None: the pod is not known
    pods: frozenset[PodKey]

    @classmethod
    def of(cls, device_sets: Iterable[Collection[str]]) -> Listing:
        """A listing of device sets without pod names."""
        return cls({key_of(d): None for d in device_sets}, frozenset())


def entry_line(entry: Mapping[str, Any]) -> bytes:
    return json.dumps(entry, separators=(",", ":")).encode() + b"\n"


def snapshot_bytes(records: Mapping[Key, AllocationRecord]) -> bytes:
    body = {
        "version": FORMAT_VERSION,
        "allocations": [records[k].to_json() for k in sorted(records)],
    }
    return json.dumps(body).encode() + b"\n"


def read_records(state_dir: Path) -> list[AllocationRecord]:
    """The records on disk (snapshot plus journals), read without writing: for other
    processes."""
    try:
        records = parse_snapshot((state_dir / LEDGER_FILE).read_bytes())
    except FileNotFoundError:
        records = {}
    lines: list[bytes] = []
    for journal in (FOLDING_FILE, JOURNAL_FILE):
        with contextlib.suppress(FileNotFoundError):
            lines += (state_dir / journal).read_bytes().splitlines()
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


def parse_snapshot(raw: bytes) -> dict[Key, AllocationRecord]:
    data = json.loads(raw)
    if data.get("version") != FORMAT_VERSION:
        raise ValueError(f"unknown ledger version {data.get('version')!r}")
    records = [AllocationRecord.from_json(r) for r in data["allocations"]]
    return {r.key: r for r in records}
