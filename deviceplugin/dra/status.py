"""ClaimStatusWriter: the allocation record of each prepared claim in its `status.devices[]`.

Off the prepare reply path: `submit()` only queues; a thread writes the claim's status
subresource with one entry per prepared device (driver, pool, device, shareID), a `Ready`
condition and `data` = `{gpu, mode, requestMiB, limitMiB, enforcement, ceiling: {source,
outcome}, mpsPipe}` (`mpsPipe` on sm-sharing only). The write is a forced server-side apply
of only our entries, as field manager `<driver>`, with the claim's UID as a precondition: a
driver never sends the allocation or reservedFor back (the API server compares them, opaque
parameters as raw bytes, and a change needs `resourceclaims/binding`), and other drivers'
entries are theirs (`status.devices` is a list-map keyed by driver/device/pool/shareID).
The claim prepare read (or a GET after a restart) only tells whether the record is already
there. `forget()` (unprepare) applies an empty list, which removes the entries we own.
A failed write never fails a prepare: it is logged and retried with backoff until it lands
or the claim is gone (404, or a UID that is no longer ours: quietly dropped). A permanent
refusal (a 4xx other than 409 and 429: a missing node-scoped permission, an invalid body) is
never retried: the claim is given up, counted, and `on_abandoned` told.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from deviceplugin.dra.checkpoint import ClaimEntry, DeviceEntry
from deviceplugin.dra.taints import time_added
from deviceplugin.kube.client import Api, KubeError
from deviceplugin.model import MIB, Mode
from deviceplugin.mps import layout
from deviceplugin.plumbing import logs
from deviceplugin.plumbing.afterreply import after_reply

_log = logs.get("dra.status")
# A prepared claim's status is written this long after its prepare (s): the write is
# milliseconds of Python in the kubernetes client, and run at once it held the GIL while the
# prepare's answer was on its way out, and the next prepare of a burst (a pod's claims) began
# (measured with 50 ms: prepare p50 5.7 to 3.6 ms, p99 23 to 9 ms for one claim on 2 CPUs).
WRITE_DELAY = 0.25


@dataclass(frozen=True)
class Backoff:
    first: float = 0.5
    cap: float = 30.0


def record(d: DeviceEntry, mps_root: Path) -> dict[str, Any]:
    """The allocation record of one prepared device (the entry's `data`)."""
    data: dict[str, Any] = {
        "gpu": d.gpu,
        "mode": d.mode,
        "requestMiB": d.request_bytes // MIB,
        "limitMiB": d.limit_mib,
        "enforcement": ",".join(d.enforcement) or "none",
        "ceiling": {"source": d.ceiling_source, "outcome": d.ceiling_policy},
    }
    if d.mode == Mode.SM_SHARING.value:
        data["mpsPipe"] = str(layout.pipe_dir(mps_root, d.gpu))
    return data


def device_status(d: DeviceEntry, driver: str, mps_root: Path, now: float) -> dict[str, Any]:
    limit = f"{d.limit_mib} MiB" if d.limit_mib is not None else "whole GPU"
    entry: dict[str, Any] = {
        "driver": driver,
        "pool": d.pool,
        "device": d.device,
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Prepared",
                "message": f"{d.mode} on {d.gpu}: request {d.request_bytes // MIB} MiB, "
                f"limit {limit}",
                "lastTransitionTime": time_added(now),
            }
        ],
        "data": record(d, mps_root),
    }
    if d.share_id is not None:
        entry["shareID"] = d.share_id
    return entry


WRITTEN, UNCHANGED, REMOVED = "written", "unchanged", "removed"
GONE, REPLACED = "skipped (claim gone)", "skipped (claim replaced)"
API_VERSION = "resource.k8s.io/v1"


def permanent(err: KubeError) -> bool:
    """A refusal that a retry cannot change: a 4xx other than 409 (a race) and 429 (load)."""
    return err.status is not None and 400 <= err.status < 500 and err.status not in (409, 429)


def replaced(err: KubeError) -> bool:
    """The apply's UID precondition failed: the claim of that name is another one now (the
    API server refuses a changed `metadata.uid` as immutable, a 422)."""
    return err.status == 422 and "metadata.uid" in str(err)


def _canonical(data: object) -> str:
    return json.dumps(data, sort_keys=True)


def _records(entries: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What an entry says, without its condition's timestamp, in a stable order."""
    return sorted(
        (
            e.get("pool"),
            e.get("device"),
            e.get("shareID"),
            _canonical(e.get("data")),
        )
        for e in entries
    )


class _Job(NamedTuple):
    entry: ClaimEntry
    failures: int
    at: float  # not before (monotonic)
    remove: bool  # unprepared: take our entries out


class ClaimStatusWriter:
    """`start()`/`stop()` (idempotent); `submit()` and `forget()` never block."""

    def __init__(
        self,
        api: Api,
        driver: str,
        node: str,
        mps_root: Path,
        *,
        backoff: Backoff | None = None,
        wall: Callable[[], float] = time.time,
        delay: float = WRITE_DELAY,
        on_abandoned: Callable[[ClaimEntry, KubeError], None] | None = None,
    ) -> None:
        self._api = api
        self._on_abandoned = on_abandoned
        self._delay = delay
        self._driver = driver
        self._node = node
        self._mps_root = mps_root
        self._backoff = backoff or Backoff()
        self._wall = wall
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._asleep_until = -math.inf  # when the thread wakes by itself (-inf: awake)
        self._pending: dict[str, _Job] = {}
        # uid → the claim as prepare read it: the first write compares against it, no GET
        self._read: dict[str, dict[str, Any]] = {}
        self._known: dict[str, ClaimEntry] = {}  # submitted, not unprepared: what forget() undoes
        self._done: set[str] = set()  # written, or given up: not resubmitted until unprepared
        self._refused: set[str] = set()  # given up: nothing of ours to remove either
        self.written = 0
        self.removed = 0
        self.failures = 0
        self.abandoned = 0  # claims given up on a permanent refusal
        self.last_error: str | None = None

    def submit(self, entry: ClaimEntry, claim: dict[str, Any] | None = None) -> None:
        with self._lock:
            queued = self._pending.get(entry.uid)
            if entry.uid in self._done or (queued is not None and not queued.remove):
                return
            self._known[entry.uid] = entry
            wake = self._queue(_Job(entry, 0, time.monotonic() + self._delay, remove=False))
            if claim is not None:
                self._read[entry.uid] = claim
        if wake:  # not from inside the reply: the woken thread would take the GIL from it
            after_reply(self._wake.set)

    def forget(self, uid: str) -> None:
        """The claim was unprepared: our entries come out of its status (the claim is usually
        gone already; a 404 is quiet)."""
        with self._lock:
            entry = self._known.pop(uid, None)
            self._pending.pop(uid, None)
            self._read.pop(uid, None)
            self._done.discard(uid)
            refused = uid in self._refused
            self._refused.discard(uid)
            if entry is None or refused:
                return
            wake = self._queue(_Job(entry, 0, time.monotonic() + self._delay, remove=True))
        if wake:
            after_reply(self._wake.set)

    def _queue(self, job: _Job) -> bool:
        """Under the lock; whether the thread must be woken for it."""
        self._pending[job.entry.uid] = job
        return job.at < self._asleep_until  # else the thread comes round by then anyway

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="dra-status", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=5.0)

    # ---- the thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            with self._lock:
                due = [j for j in self._pending.values() if j.at <= now]
                later = [j.at for j in self._pending.values() if j.at > now]
                if not due:
                    self._asleep_until = min(later) if later else math.inf
            if not due:
                self._wake.wait(min(later) - now if later else None)
                self._wake.clear()
                with self._lock:
                    self._asleep_until = -math.inf
                continue
            for job in due:
                if self._stop.is_set():
                    return
                self._attempt(job)

    def _attempt(self, job: _Job) -> None:
        entry = job.entry
        where = f"{entry.namespace}/{entry.name}"
        with self._lock:
            read = self._read.pop(entry.uid, None)  # one try from prepare's copy at most
        try:
            outcome = self.remove(entry) if job.remove else self.write(entry, read)
        except KubeError as err:
            if permanent(err):
                self._abandon(job, err)
                return
            with self._lock:
                if self._pending.get(entry.uid) is not job:
                    return  # unprepared (or prepared again) meanwhile
                failures = job.failures + 1
                delay = min(self._backoff.first * 2 ** (failures - 1), self._backoff.cap)
                if err.status == 409:
                    delay = min(delay, self._backoff.first)  # a race: try again soon
                self._pending[entry.uid] = job._replace(
                    failures=failures, at=time.monotonic() + delay
                )
                self.failures += 1
                self.last_error = str(err)
            logs.log(_log, "claim status not written; retrying", level=logging.WARNING,
                     claim=where, uid=entry.uid, attempt=failures, retry_in=round(delay, 2),
                     error=str(err))  # fmt: skip
            return
        with self._lock:
            if self._pending.get(entry.uid) is job:
                del self._pending[entry.uid]
                if not job.remove:
                    self._done.add(entry.uid)
                self.written += outcome == WRITTEN
                self.removed += outcome == REMOVED
        logs.log(_log, f"claim status {outcome}", claim=where, uid=entry.uid,
                 devices=0 if job.remove else len(entry.devices))  # fmt: skip

    def _abandon(self, job: _Job, err: KubeError) -> None:
        entry = job.entry
        with self._lock:
            if self._pending.get(entry.uid) is not job:
                return  # unprepared (or prepared again) meanwhile
            del self._pending[entry.uid]
            if not job.remove:
                self._done.add(entry.uid)  # not resubmitted until it is unprepared
                self._refused.add(entry.uid)
            self.abandoned += 1
            self.last_error = str(err)
        logs.log(_log, "claim status refused; not retried", level=logging.WARNING,
                 claim=f"{entry.namespace}/{entry.name}", uid=entry.uid, status=err.status,
                 removing=job.remove, error=str(err))  # fmt: skip
        if self._on_abandoned is not None:
            self._on_abandoned(entry, err)

    def write(self, entry: ClaimEntry, claim: dict[str, Any] | None = None) -> str:
        """Apply our record (no read when given the claim); "written", "unchanged" (the
        claim already holds this record, applied by us), or why nothing was written."""
        if claim is None:
            try:
                claim = self._api.get_resource_claim(entry.namespace, entry.name)
            except KubeError as err:
                if err.status == 404:
                    return GONE
                raise
        meta = claim.get("metadata") or {}
        if meta.get("uid") != entry.uid:
            return REPLACED
        now = self._wall()
        ours = [device_status(d, self._driver, self._mps_root, now) for d in entry.devices]
        held = [
            d
            for d in (claim.get("status") or {}).get("devices") or []
            if d.get("driver") == self._driver and d.get("pool") == self._node
        ]
        if _records(held) == _records(ours) and self._applied(meta):
            return UNCHANGED  # e.g. requeued after a restart: nothing to write
        return self._apply(entry, ours) or WRITTEN

    def remove(self, entry: ClaimEntry) -> str:
        """Apply an empty list: the entries our field manager owns go, others' stay."""
        return self._apply(entry, []) or REMOVED

    def _applied(self, meta: dict[str, Any]) -> bool:
        """Whether our field manager has applied this claim's status (else an equal record
        came from an older agent's UPDATE, which an empty apply would never remove)."""
        return any(
            m.get("manager") == self._driver
            and m.get("operation") == "Apply"
            and m.get("subresource") == "status"
            for m in meta.get("managedFields") or []
        )

    def _apply(self, entry: ClaimEntry, devices: list[dict[str, Any]]) -> str | None:
        """One forced apply of `devices` as our entries; None when it landed, else why not."""
        body = {
            "apiVersion": API_VERSION,
            "kind": "ResourceClaim",
            # the UID is a precondition: a claim re-created under the name is not ours
            "metadata": {"name": entry.name, "namespace": entry.namespace, "uid": entry.uid},
            "status": {"devices": devices},
        }
        try:
            self._api.apply_resource_claim_status(
                entry.namespace, entry.name, body, field_manager=self._driver
            )
        except KubeError as err:
            if err.status == 404:
                return GONE
            if replaced(err):
                return REPLACED
            raise
        return None
