"""What NodePrepareResources did, per claim UID, so unprepare and restarts need no API server.

An entry is written `PrepareStarted` before the work and `PrepareCompleted` after it, with
everything needed to answer again, rewrite the claim's CDI spec and tear it down (the claim
may be gone by then). On disk under `--state-dir`: a snapshot (`dra-checkpoint.json`,
replaced atomically) and a journal of the changes since (`dra-checkpoint.journal`, one JSON
line per change: its sha256, a space, its JSON, numbered in order). A change is one line;
`sync()` makes the lines durable with one fdatasync (a prepare call needs one, ~0.2 ms on a
disk where a durable replace of the snapshot costs ~0.8 ms, p99 4 ms); the snapshot, with the
number of the last change it holds, is rewritten only when the journal has grown
(compaction). Both keep the boot ID they were written under, so a restart
can tell a plugin restart from a reboot.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from deviceplugin.plumbing import fsutil

CHECKPOINT_FILE = "dra-checkpoint.json"
JOURNAL_SUFFIX = ".journal"  # beside the snapshot: dra-checkpoint.journal
VERSION = 1
# The journal is folded into the snapshot once it holds this many lines and twice as many as
# there are entries (a compaction rewrites the snapshot durably: ~1 ms).
COMPACT_AFTER = 64
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


_DEVICE_FIELDS = tuple(f.name for f in fields(DeviceEntry))


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
    # by hand: dataclasses.asdict deep-copies every value (a tenth of a prepare's time)
    return {
        "uid": entry.uid,
        "namespace": entry.namespace,
        "name": entry.name,
        "state": entry.state.value,
        "devices": [{f: getattr(d, f) for f in _DEVICE_FIELDS} for d in entry.devices],
        "cdi_spec": entry.cdi_spec,
    }


def _checksum(claims: dict[str, Any], boot_id: str, seq: int | None) -> str:
    body: dict[str, Any] = {"bootID": boot_id, "claims": claims}
    if seq is not None:  # snapshots before sequence numbers were summed without one
        body["seq"] = seq
    canonical = json.dumps(body, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


class Checkpoint:
    """The prepared claims, in memory and on disk; callers serialise access (the Preparer)."""

    def __init__(self, path: Path, boot_id: Callable[[], str] = read_boot_id) -> None:
        self.path = path
        self.journal = path.with_suffix(JOURNAL_SUFFIX)
        self._boot_id = boot_id
        self._entries: dict[str, ClaimEntry] = {}
        self._journal_fd: int | None = None
        self._unwritten: list[bytes] = []  # journal lines (without newline) not yet written
        self._journal_lines = 0
        self._seq = 0  # the last change's number; a snapshot holds every change up to its own
        self._journal_synced = False  # its directory entry, once per file
        self._resave = False  # a journal write or sync failed: rewrite the snapshot next
        self.current_boot = ""
        self.loaded_boot: str | None = None  # the boot the file was written under, if any

    @classmethod
    def in_state_dir(cls, state_dir: Path, boot_id: Callable[[], str] = read_boot_id) -> Checkpoint:
        return cls(state_dir / CHECKPOINT_FILE, boot_id)

    def load(self) -> None:
        """Read the snapshot, then replay the journal over it (absent files are empty);
        raises CheckpointError. A torn last journal line (a crash mid-append) is dropped."""
        self.current_boot = self._boot_id()
        self.close()
        entries, boot, seq = self._load_snapshot()
        try:
            raw = self.journal.read_bytes()
        except FileNotFoundError:
            raw = b""
        # Each change is one write(2) of a line ending in a newline: a piece after the last
        # newline is a change a crash cut short, and never happened.
        lines = raw.split(b"\n")[:-1]
        count = 0
        for n, line in enumerate(lines, 1):
            where = f"{self.journal}: line {n}"
            digest, _, payload = line.partition(b" ")
            if hashlib.sha256(payload).hexdigest().encode() != digest:
                raise CheckpointError(f"{where}: checksum mismatch")
            try:
                change = json.loads(payload)
                line_seq = change.get("seq")  # absent in journals written before numbering
                if line_seq is not None and line_seq <= seq:
                    count += 1  # in the snapshot already: a crash cut its compaction short
                    continue
                op = change["op"]
                if op == "put":
                    entry = _entry_from_json(change["entry"])
                    entries[entry.uid] = entry
                elif op == "complete":
                    uid = change["uid"]
                    entries[uid] = replace(entries[uid], state=State.COMPLETED)
                elif op == "remove":
                    entries.pop(change["uid"], None)
                else:
                    raise CheckpointError(f"{where}: unknown op {op!r}")
                boot = change["bootID"]
                seq = line_seq if line_seq is not None else seq
            except CheckpointError:
                raise
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(f"{where}: unreadable: {exc}") from None
            count += 1
        self._entries, self.loaded_boot, self._journal_lines = entries, boot, count
        self._seq = seq

    def _load_snapshot(self) -> tuple[dict[str, ClaimEntry], str | None, int]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}, None, 0
        try:
            doc = json.loads(raw)
            if doc.get("version") != VERSION:
                raise CheckpointError(
                    f"{self.path}: version {doc.get('version')!r}, want {VERSION}"
                )
            claims, boot, seq = doc["claims"], doc["bootID"], doc.get("seq")
            if doc.get("checksum") != _checksum(claims, boot, seq):
                raise CheckpointError(f"{self.path}: checksum mismatch")
            entries = {uid: _entry_from_json(c) for uid, c in claims.items()}
            return entries, boot, int(seq or 0)
        except CheckpointError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{self.path}: unreadable: {exc}") from None

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

    def stamp(self) -> tuple[tuple[int, int, int] | None, ...]:
        """What the files on disk are now (inode, size, mtime of the snapshot and of the
        journal): another plugin instance (a rolling update) changed them when it differs
        from the stamp taken after this instance's own last change."""
        out: list[tuple[int, int, int] | None] = []
        for path in (self.path, self.journal):
            try:
                st = os.stat(path)
            except FileNotFoundError:
                out.append(None)
                continue
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(out)

    def flush(self) -> None:
        """Write the lines not written yet (not synced): before another instance reads."""
        if self._resave:
            self.save()
        else:
            self._write()

    # ---- changes: one journal line each --------------------------------------------------
    def put(self, entry: ClaimEntry, durable: bool = True, spec_text: str | None = None) -> None:
        """`durable=False`: written (in the kernel before any work the entry covers, so a
        crash leaves it to roll back), synced by the caller's `sync()`. `spec_text`: the
        entry's CDI spec as JSON (`cdi.encode_spec`, the file's text), spliced into the line
        instead of encoded a second time."""
        self._entries[entry.uid] = entry
        fields = _entry_to_json(entry)
        if spec_text is None or entry.cdi_spec is None:
            self._append({"op": "put", "entry": fields}, durable)
            return
        del fields["cdi_spec"]
        self._append({"op": "put", "entry": fields}, durable, spec_text=spec_text)

    def complete(self, uid: str, *, save: bool = True) -> ClaimEntry:
        """Mark the entry Completed; `save=False` leaves the line to the caller's `sync()`
        (one write and one fdatasync for a whole NodePrepareResources call): until then a
        crash leaves the entry Started, and its work is rolled back, as no answer left."""
        e = self._entries[uid]  # by hand: dataclasses.replace costs a tenth of this call
        entry = ClaimEntry(e.uid, e.namespace, e.name, State.COMPLETED, e.devices, e.cdi_spec)
        self._entries[uid] = entry
        self._append({"op": "complete", "uid": uid}, save, write_now=save)
        return entry

    def remove(self, uid: str, durable: bool = True) -> None:
        """`durable=False`: the line waits for the caller's `sync()` (an unprepare call's
        removals share one write)."""
        if self._entries.pop(uid, None) is not None:
            self._append({"op": "remove", "uid": uid}, durable, write_now=durable)

    def _append(
        self,
        change: dict[str, Any],
        durable: bool,
        write_now: bool = True,
        spec_text: str | None = None,
    ) -> None:
        """`spec_text`: JSON text to add to `change["entry"]` as its `cdi_spec`, unparsed."""
        if not self.current_boot:
            self.current_boot = self._boot_id()
        if self._resave:  # after a failed write or sync, the journal is not trusted
            self.save()
            return
        self._seq += 1
        change = {"bootID": self.current_boot, "seq": self._seq, **change}
        text = json.dumps(change)
        if spec_text is not None:  # the entry is the last field: `...}}` gets `, "cdi_spec": ...`
            text = f'{text[:-2]}, "cdi_spec": {spec_text}}}}}'
        payload = text.encode()
        self._unwritten.append(hashlib.sha256(payload).hexdigest().encode() + b" " + payload)
        self._journal_lines += 1
        self.loaded_boot = self.current_boot
        if durable:
            self.sync()
        elif write_now:
            self._write()

    def _write(self) -> None:
        """Append the lines not yet written, in order, with one write(2)."""
        if not self._unwritten:
            return
        data = b"\n".join(self._unwritten) + b"\n"
        try:
            if self._journal_fd is None:
                fsutil.ensure_dir(self.path.parent, 0o755)
                self._journal_fd = os.open(
                    self.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600
                )
            # One write(2) of whole lines: a crash leaves them whole or the last one torn at
            # the end, never interleaved (the Preparer serialises callers).
            if os.write(self._journal_fd, data) != len(data):
                raise OSError(f"{self.journal}: short write")
        except OSError:
            self._resave = True  # a torn line mid-file would make the journal unreadable
            raise
        finally:
            self._unwritten.clear()  # on failure the snapshot is rewritten from memory

    def sync(self) -> None:
        """Make every change so far durable: one fdatasync of the journal (and, the first
        time, of its directory entry). After a failure the next sync (or change) rewrites
        the snapshot instead: a failed fdatasync may have dropped the pages it did not
        write, and a retry of it would succeed without them."""
        if self._resave:
            self.save()
            return
        self._write()
        if self._journal_fd is None:
            return
        if os.fstat(self._journal_fd).st_nlink == 0:
            # The journal was deleted behind our back: what it held (and what went into the
            # open fd since) would be lost on restart, so the snapshot takes it all.
            self.save()
            return
        try:
            os.fdatasync(self._journal_fd)
            if not self._journal_synced:
                fsutil.fsync_path(self.path.parent)  # the journal's creation
                self._journal_synced = True
        except OSError:
            self._resave = True
            raise

    def compaction_due(self, slack: int = 1) -> bool:
        """The journal holds `slack` times more lines than is worth keeping: each prepared
        claim leaves two (Started, Completed), so the bar is four per entry."""
        return self._journal_lines > slack * max(COMPACT_AFTER, 4 * len(self._entries))

    # ---- the snapshot --------------------------------------------------------------------
    def save(self) -> None:
        """Rewrite the snapshot with every entry, under the current boot ID and the number of
        the last change it holds, durably, then empty the journal (compaction). A crash
        between the two leaves old lines beside the new snapshot: their numbers are not above
        the snapshot's, so a load skips them (replayed, they could bring back an entry whose
        removal the snapshot took from memory before its line reached the journal)."""
        if not self.current_boot:
            self.current_boot = self._boot_id()
        claims = {uid: _entry_to_json(e) for uid, e in sorted(self._entries.items())}
        doc = {
            "version": VERSION,
            "bootID": self.current_boot,
            "claims": claims,
            "seq": self._seq,
            "checksum": _checksum(claims, self.current_boot, self._seq),
        }
        fsutil.ensure_dir(self.path.parent, 0o755)
        data = json.dumps(doc, indent=1).encode() + b"\n"
        fsutil.atomic_write(self.path, data, 0o600)  # durable before the journal goes
        self.close()  # the lines not yet written are in the snapshot
        fsutil.remove(self.journal)  # a new journal starts with the next change
        self._journal_lines = 0
        self._resave = False
        self.loaded_boot = self.current_boot

    def close(self) -> None:
        """Close the journal; lines not yet written are dropped (a load replaces the entries,
        a save has them in the snapshot)."""
        self._unwritten.clear()
        fd, self._journal_fd = self._journal_fd, None
        self._journal_synced = False
        if fd is not None:
            os.close(fd)
