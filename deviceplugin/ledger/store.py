"""The allocation ledger: every live allocation, persisted so a plugin restart loses nothing.

A snapshot, `<state-dir>/allocations.json` (rewritten atomically), plus a journal of the
changes since, `allocations.journal` (one JSON line per add or remove), folded into a new
snapshot once it grows: an Allocate appends one line instead of rewriting every record. A
record's key is the sorted tuple of its device IDs. Records leave only through `remove` or
`reconcile` (pod-resources no longer lists the allocation and no listed pod owns it); that is
also when its CDI spec file is deleted, because the kubelet replays an Allocate answer for
the pod's whole life. A record keeps its CDI spec's body, so a reboot can rewrite it; the
files are fsynced by a thread of their own moments after each change (`Syncer`,
sync.py). The records, their JSON and the files' names and encoding are in
record.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from deviceplugin.ledger.record import (
    FOLDING_FILE,
    JOURNAL_FILE,
    LEDGER_FILE,
    AllocationRecord,
    Key,
    Listing,
    PodKey,
    entry_line,
    key_of,
    parse_snapshot,
    snapshot_bytes,
)
from deviceplugin.ledger.sync import Syncer
from deviceplugin.model import GpuUuid, Mode, SliceId
from deviceplugin.plumbing import fsutil, logs

# Pod-resources may not list a container's devices yet right after Allocate returns; a record
# it has never listed is kept this long.
DEFAULT_RECONCILE_GRACE = 60.0
# The kubelet allocates a pod's init and app containers in one admission, moments apart; an
# unlisted record overlapping a listed allocation made within this window is its init container.
INIT_WINDOW = 10.0
# Fold the journal into the snapshot once it has this many lines (and twice the records).
COMPACT_AFTER = 64
# After a (re)start the kubelet may still be restoring pods: its lists drop nothing for this
# long (DESIGN 3b, "Answers survive a reboot").
STARTUP_GRACE = 60.0
# Only the agent (root) reads its state; the directory is 0700 as well.
STATE_FILE_MODE = 0o600

_log = logs.get("ledger")


class Ledger:
    """Thread-safe; every change is on disk (in the kernel) before the call returns, and made
    durable (fsync) moments later by a thread of its own."""

    def __init__(
        self,
        state_dir: Path,
        clock: Callable[[], float] = time.time,
        startup_grace: float = STARTUP_GRACE,
    ) -> None:
        self._dir = state_dir
        self._startup_grace = startup_grace
        self._quiet_until = clock() + startup_grace
        self._paused = False
        self.path = state_dir / LEDGER_FILE
        self.journal = state_dir / JOURNAL_FILE
        self._clock = clock
        self._lock = threading.Lock()
        self._journal_lines = 0
        # Kept open between appends (one write per change on the reply path, no open/close);
        # closed when the journal is renamed aside or removed.
        self._journal_fd: int | None = None
        self._journal_closer: weakref.finalize[[int], Ledger] | None = None
        self._listed: set[Key] = set()  # keys pod-resources has shown at least once
        fsutil.ensure_dir(state_dir, 0o700)
        self.folding = state_dir / FOLDING_FILE
        self._fold_due = False
        self._snapshot_lock = threading.Lock()  # one snapshot writer: a fold or a compaction
        self._syncer = Syncer(self._fold)
        self._records: dict[Key, AllocationRecord] = self._load()

    def wait_durable(self, timeout: float = 5.0) -> bool:
        """Until every change so far is fsynced (shutdown waits on it)."""
        return self._syncer.wait(timeout)

    # ---- persistence ---------------------------------------------------------------------
    def _load(self) -> dict[Key, AllocationRecord]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            raw = None
        try:
            records = parse_snapshot(raw) if raw is not None else {}
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
        for journal in (self.folding, self.journal):  # a fold a crash cut short, then the rest
            self._replay_one(journal, records)

    def _replay_one(self, journal: Path, records: dict[Key, AllocationRecord]) -> None:
        try:
            lines = journal.read_bytes().splitlines()
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
        # No fsync here: a plugin crash loses nothing (the kernel has the data), and the
        # syncer makes it durable moments later, off the reply path.
        with self._snapshot_lock:  # after a fold in flight, or its older snapshot would win
            fsutil.atomic_write(self.path, snapshot_bytes(records), STATE_FILE_MODE, durable=False)
            # A crash here replays the old journal over the new snapshot: it holds every
            # change the snapshot does (`_append` writes a change's line before it compacts),
            # and adds and removes are idempotent, so the result is the same.
            fsutil.remove(self.folding)
            fsutil.remove(self.journal)
            self._close_journal()
        self._syncer.poke(self.path, self._dir)
        self._journal_lines = 0

    def _fold(self) -> None:
        """The syncer's part: fold a grown journal into the snapshot off the reply path. The
        journal is renamed aside under the lock (appends go on into a new one at once), the
        snapshot of the records as of then written durably outside it, then the old journal
        removed. A crash before the removal replays it over the new snapshot (each line sets
        or removes one record, in order: the same result). A journal deleted behind our
        back (the open fd would write on into nothing) is folded the same way."""
        with self._lock:
            fd = self._journal_fd
            if not self._fold_due and (fd is None or os.fstat(fd).st_nlink > 0):
                return
            self._fold_due = False
            records = dict(self._records)
            with contextlib.suppress(FileNotFoundError):  # deleted: the snapshot has it all
                os.replace(self.journal, self.folding)
            self._close_journal()
            self._journal_lines = 0
            self._snapshot_lock.acquire()  # before the lock goes: no compaction slips between
        try:
            fsutil.atomic_write(self.path, snapshot_bytes(records), STATE_FILE_MODE, durable=True)
            fsutil.remove(self.folding)
        finally:
            self._snapshot_lock.release()

    def _append(
        self,
        entries: Sequence[Mapping[str, Any] | bytes],
        after: Callable[[], dict[Key, AllocationRecord]],
    ) -> None:
        """Journal `entries` (the syncer folds a grown journal into the snapshot); when even
        a fold asked for has not kept up, also write the snapshot of `after()` here (the
        records as they will be: built only then). Raises before the caller changes anything
        in memory."""
        limit = max(COMPACT_AFTER, 2 * len(self._records))
        if self._journal_lines + len(entries) > limit:
            self._fold_due = True  # the syncer, poked below, folds it
        data = b"".join(e if isinstance(e, bytes) else entry_line(e) for e in entries)
        fd = self._journal_fd
        changed: tuple[Path, ...] = (self.journal,)
        if fd is None:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
            fd = os.open(self.journal, flags, STATE_FILE_MODE)
            os.fchmod(fd, STATE_FILE_MODE)  # one an older version left at 0644 too
            self._journal_fd, self._journal_closer = fd, weakref.finalize(self, os.close, fd)
            changed = (self.journal, self._dir)  # the journal may be new: its entry too
        view = memoryview(data)
        while view:  # a regular file takes it whole but for a full disk, which raises next
            view = view[os.write(fd, view) :]
        self._journal_lines += len(entries)
        if self._journal_lines > 4 * limit:
            # Journaled first: a crash before the compaction removes the journal leaves it
            # beside the new snapshot, and only a journal that holds this change too (a
            # removal, say) replays there to the same records. The change is in the journal
            # now, so a compaction that fails is logged and left to the syncer.
            try:
                self._compact(after())
                return
            except OSError as e:
                logs.log(_log, "allocation ledger not compacted", level=logging.WARNING, error=e)
        self._syncer.poke(*changed)

    def _close_journal(self) -> None:
        closer, self._journal_closer, self._journal_fd = self._journal_closer, None, None
        if closer is not None:
            closer()  # closes the fd, once

    # ---- changes -------------------------------------------------------------------------
    def add(self, record: AllocationRecord) -> None:
        """Insert or replace the record with the same key; a replaced one starts afresh (not
        yet listed: the kubelet handed the same devices to a new container)."""
        with self._lock:
            self._append(
                [record.journal_line()],
                lambda: {**self._records, record.key: record},
            )
            self._records[record.key] = record
            self._listed.discard(record.key)

    def get(self, key: Key) -> AllocationRecord | None:
        with self._lock:
            return self._records.get(key_of(key))

    def remove(self, key: Key) -> AllocationRecord | None:
        """Forget an allocation that is gone and delete its CDI spec file."""
        with self._lock:
            record = self._records.get(key_of(key))
            if record is None:
                return None
            gone = record.key
            self._append(
                [{"op": "remove", "key": list(gone)}],
                lambda: {k: r for k, r in self._records.items() if k != gone},
            )
            del self._records[gone]
            self._listed.discard(gone)
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
    def pause_removals(self) -> None:
        """Drop nothing until `hold_removals`: the kubelet (re)starts and our resources are not
        registered with it yet. Its pod-resources API answers long before it restores its
        pods (on the real node, a minute after a reboot, before its device manager even
        started): those lists show none of them."""
        with self._lock:
            self._paused = True

    def hold_removals(self) -> None:
        """Registered with the kubelet again: it restores its pods from now on, so its lists
        drop nothing for `startup_grace` more."""
        with self._lock:
            self._paused = False
            self._quiet_until = max(self._quiet_until, self._clock() + self._startup_grace)

    def reconcile(
        self, listing: Listing, grace: float = DEFAULT_RECONCILE_GRACE
    ) -> list[AllocationRecord]:
        """Drop the records the kubelet no longer holds; return them.

        A record is live while a container is listed with exactly its devices, or while the
        pod that owns it is listed (a finished init container is no longer listed, yet its
        pod may restart it and replay its answer). A record never listed is kept `grace`
        seconds (pod-resources lists an allocation only once it is committed) or while it is
        the init container of a listed allocation made within INIT_WINDOW after it. Nothing
        is dropped until `startup_grace` has passed since this ledger was opened, or since
        `hold_removals` (registered with the kubelet again), nor while paused.
        """
        now = self._clock()
        cutoff = now - grace
        with self._lock:
            records = dict(self._records)
            learned: list[AllocationRecord] = []
            for key, pod in listing.held.items():
                if key in records:
                    self._listed.add(key)
                    learned += _learn_owner(records, key, pod)
            for record in list(records.values()):
                if record.owner is None and record.key not in listing.held:
                    learned += _learn_owner(records, record.key, _init_of(record, listing, records))
            gone = [
                r
                for r in records.values()
                if r.key not in listing.held and not self._owned(r, listing, records, cutoff)
            ]
            if now < self._quiet_until or self._paused:
                gone = []
            gone_keys = {r.key for r in gone}
            for key in gone_keys:
                del records[key]
            entries: list[Mapping[str, Any] | bytes] = [r.journal_line() for r in learned]
            entries += [{"op": "remove", "key": list(k)} for k in sorted(gone_keys)]
            if entries:
                self._append(entries, lambda: records)
            self._records = records
            self._listed -= gone_keys
        for record in gone:
            _drop_spec(record)
            logs.log(_log, "allocation gone", devices=",".join(record.device_ids), gpu=record.gpu)
        return gone

    def _owned(
        self,
        record: AllocationRecord,
        listing: Listing,
        records: Mapping[Key, AllocationRecord],
        cutoff: float,
    ) -> bool:
        """Whether an unlisted record still belongs to a live pod or container."""
        if record.owner is not None:
            return record.owner in listing.pods
        if record.key in self._listed:
            return False  # listed before under no known pod, not now: gone
        return record.created >= cutoff or _overlaps_a_later_listed(record, listing, records)


def _learn_owner(
    records: dict[Key, AllocationRecord], key: Key, pod: PodKey | None
) -> list[AllocationRecord]:
    record = records[key]
    if pod is None or record.owner == pod:
        return []
    records[key] = replace(record, owner=pod)
    return [records[key]]


def _init_of(
    record: AllocationRecord, listing: Listing, records: Mapping[Key, AllocationRecord]
) -> PodKey | None:
    """The pod of a listed allocation `record` was the init container of, if one is known:
    the kubelet hands an init container's devices to the app containers of its pod, which
    it allocates moments later in the same admission."""
    devices = set(record.device_ids)
    for key, pod in listing.held.items():
        app = records.get(key)
        if pod is None or app is None or devices.isdisjoint(key):
            continue
        if 0 <= app.created - record.created <= INIT_WINDOW:
            return pod
    return None


def _overlaps_a_later_listed(
    record: AllocationRecord, listing: Listing, records: Mapping[Key, AllocationRecord]
) -> bool:
    """An init container's record whose pod is not known (a listing without pod names)."""
    devices = set(record.device_ids)
    for key in listing.held:
        if devices.isdisjoint(key):
            continue
        app = records.get(key)
        if app is None or 0 <= app.created - record.created <= INIT_WINDOW:
            return True
    return False


def _drop_spec(record: AllocationRecord) -> None:
    if record.cdi_spec:
        fsutil.remove(Path(record.cdi_spec))
