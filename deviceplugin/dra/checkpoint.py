"""What NodePrepareResources did, per claim UID, so unprepare and restarts need no API server.

One JSON file under `--state-dir`, replaced atomically with fsync on every change: an entry is
written `PrepareStarted` before the work and `PrepareCompleted` after it, with everything needed to
answer again, rewrite the claim's CDI spec and tear it down (the claim may be gone by then). The
file keeps the boot ID it was written under, so a restart can tell a plugin restart from a reboot.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from deviceplugin import fsutil

CHECKPOINT_FILE = "dra-checkpoint.json"
VERSION = 1
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


class CheckpointError(Exception):
    """The checkpoint file exists but cannot be trusted (unparseable, wrong version, bad sum)."""


class State(StrEnum):
    STARTED = "PrepareStarted"
    COMPLETED = "PrepareCompleted"


@dataclass(frozen=True)
class DeviceEntry:
    """One allocation result of a claim, prepared."""

    request: str  # the result's request (or request/subrequest)
    pool: str
    device: str  # gpu-<index>
    gpu: str  # the GPU's UUID
    mode: str
    share_id: str | None
    request_bytes: int  # charged against the device's capacity (the whole GPU when exclusive)
    limit_mib: int | None  # None for exclusive GPUs (no cap)
    enforcement: tuple[str, ...]
    ceiling_source: str | None
    ceiling_policy: str | None
    cdi_device_ids: tuple[str, ...]
    admin_access: bool = False  # never charged against capacity


@dataclass(frozen=True)
class ClaimEntry:
    uid: str
    namespace: str
    name: str
    state: State
    devices: tuple[DeviceEntry, ...]
    cdi_spec: dict[str, Any] | None = None  # the claim's CDI spec, to rewrite after a reboot


def read_boot_id() -> str:
    return BOOT_ID_PATH.read_text().strip()


def _entry_from_json(data: dict[str, Any]) -> ClaimEntry:
    devices = tuple(
        DeviceEntry(
            **{
                **d,
                "enforcement": tuple(d["enforcement"]),
                "cdi_device_ids": tuple(d["cdi_device_ids"]),
            }
        )
        for d in data["devices"]
    )
    return ClaimEntry(
        uid=data["uid"],
        namespace=data["namespace"],
        name=data["name"],
        state=State(data["state"]),
        devices=devices,
        cdi_spec=data.get("cdi_spec"),
    )


def _entry_to_json(entry: ClaimEntry) -> dict[str, Any]:
    data = asdict(entry)
    data["state"] = entry.state.value
    return data


def _checksum(claims: dict[str, Any], boot_id: str) -> str:
    canonical = json.dumps({"bootID": boot_id, "claims": claims}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


class Checkpoint:
    """The prepared claims, in memory and on disk; callers serialise access (the Preparer)."""

    def __init__(self, path: Path, boot_id: Callable[[], str] = read_boot_id) -> None:
        self.path = path
        self._boot_id = boot_id
        self._entries: dict[str, ClaimEntry] = {}
        self.current_boot = ""
        self.loaded_boot: str | None = None  # the boot the file was written under, if any

    @classmethod
    def in_state_dir(cls, state_dir: Path, boot_id: Callable[[], str] = read_boot_id) -> Checkpoint:
        return cls(state_dir / CHECKPOINT_FILE, boot_id)

    def load(self) -> None:
        """Read the file (an absent file is an empty checkpoint); raises CheckpointError."""
        self.current_boot = self._boot_id()
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            self._entries, self.loaded_boot = {}, None
            return
        try:
            doc = json.loads(raw)
            if doc.get("version") != VERSION:
                raise CheckpointError(
                    f"{self.path}: version {doc.get('version')!r}, want {VERSION}"
                )
            claims, boot = doc["claims"], doc["bootID"]
            if doc.get("checksum") != _checksum(claims, boot):
                raise CheckpointError(f"{self.path}: checksum mismatch")
            entries = {uid: _entry_from_json(c) for uid, c in claims.items()}
        except CheckpointError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{self.path}: unreadable: {exc}") from None
        self._entries, self.loaded_boot = entries, boot

    @property
    def rebooted(self) -> bool:
        """True when the file was written under another boot than this one."""
        return self.loaded_boot is not None and self.loaded_boot != self.current_boot

    def get(self, uid: str) -> ClaimEntry | None:
        return self._entries.get(uid)

    def __iter__(self) -> Iterator[ClaimEntry]:
        return iter(list(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: ClaimEntry, durable: bool = True) -> None:
        self._entries[entry.uid] = entry
        self.save(durable)

    def complete(self, uid: str, *, save: bool = True) -> ClaimEntry:
        """Mark the entry Completed; `save=False` leaves the durable write to the caller (one
        for a whole NodePrepareResources call)."""
        entry = replace(self._entries[uid], state=State.COMPLETED)
        self._entries[uid] = entry
        if save:
            self.save()
        return entry

    def remove(self, uid: str, durable: bool = True) -> None:
        if self._entries.pop(uid, None) is not None:
            self.save(durable)

    def save(self, durable: bool = True) -> None:
        """Replace the file atomically (and durably unless told), under the current boot ID.

        A Started entry may skip the fsyncs: it only matters after a crash of this process
        (the rename is atomic and the kernel keeps it); after a power loss there is nothing of
        an interrupted prepare left to undo (CDI specs live on a tmpfs, MPS daemons are gone).
        """
        if not self.current_boot:
            self.current_boot = self._boot_id()
        claims = {uid: _entry_to_json(e) for uid, e in sorted(self._entries.items())}
        doc = {
            "version": VERSION,
            "bootID": self.current_boot,
            "claims": claims,
            "checksum": _checksum(claims, self.current_boot),
        }
        fsutil.ensure_dir(self.path.parent, 0o755)
        data = json.dumps(doc, indent=1).encode() + b"\n"
        fsutil.atomic_write(self.path, data, 0o600, durable=durable)
        self.loaded_boot = self.current_boot
