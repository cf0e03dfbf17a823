"""ClaimStatusWriter: the allocation record of each prepared claim in its `status.devices[]`.

Off the prepare reply path: `submit()` only queues; a thread UPDATEs the claim's status
subresource (from the copy prepare read, without a GET; read again after a 409 or a failure)
with one entry per prepared device (driver, pool, device, shareID), a
`Ready` condition and `data` = `{gpu, mode, requestMiB, limitMiB, enforcement, ceiling:
{source, outcome}, mpsPipe}` (`mpsPipe` on sm-sharing only). A failed write never fails a
prepare: it is logged and retried with backoff until it lands or the claim is gone. A
permanent refusal (a 4xx other than 409 and 429: a missing node-scoped permission, an
invalid body) is never retried: the claim is given up, counted, and `on_abandoned` told.
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
from typing import Any

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


WRITTEN, UNCHANGED = "written", "unchanged"


def permanent(err: KubeError) -> bool:
    """A refusal that a retry cannot change: a 4xx other than 409 (a race) and 429 (load)."""
    return err.status is not None and 400 <= err.status < 500 and err.status not in (409, 429)


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
        # uid → (entry, failures, not before: monotonic)
        self._pending: dict[str, tuple[ClaimEntry, int, float]] = {}
        # uid → the claim as prepare read it: the first attempt UPDATEs from it, no GET (a
        # stale copy gets a 409, and the retry reads the claim afresh)
        self._read: dict[str, dict[str, Any]] = {}
        self._done: set[str] = set()
        self.written = 0
        self.failures = 0
        self.abandoned = 0  # claims given up on a permanent refusal
        self.last_error: str | None = None

    def submit(self, entry: ClaimEntry, claim: dict[str, Any] | None = None) -> None:
        with self._lock:
            if entry.uid in self._done or entry.uid in self._pending:
                return
            at = time.monotonic() + self._delay
            self._pending[entry.uid] = (entry, 0, at)
            if claim is not None:
                self._read[entry.uid] = claim
            wake = at < self._asleep_until  # else the thread comes round by then anyway
        if wake:  # not from inside the reply: the woken thread would take the GIL from it
            after_reply(self._wake.set)

    def forget(self, uid: str) -> None:
        """The claim was unprepared: its entries may stay (the claim is usually gone)."""
        with self._lock:
            self._pending.pop(uid, None)
            self._read.pop(uid, None)
            self._done.discard(uid)

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
                due = [e for e, _, at in self._pending.values() if at <= now]
                later = [at for _, _, at in self._pending.values() if at > now]
                if not due:
                    self._asleep_until = min(later) if later else math.inf
            if not due:
                self._wake.wait(min(later) - now if later else None)
                self._wake.clear()
                with self._lock:
                    self._asleep_until = -math.inf
                continue
            for entry in due:
                if self._stop.is_set():
                    return
                self._attempt(entry)

    def _attempt(self, entry: ClaimEntry) -> None:
        where = f"{entry.namespace}/{entry.name}"
        with self._lock:
            read = self._read.pop(entry.uid, None)  # one try from prepare's copy at most
        try:
            outcome = self.write(entry, read)
        except KubeError as err:
            if permanent(err):
                self._abandon(entry, err)
                return
            with self._lock:
                current = self._pending.get(entry.uid)
                if current is None:
                    return  # unprepared meanwhile
                failures = current[1] + 1
                delay = min(self._backoff.first * 2 ** (failures - 1), self._backoff.cap)
                if err.status == 409:
                    delay = min(delay, self._backoff.first)  # a race: read again soon
                self._pending[entry.uid] = (entry, failures, time.monotonic() + delay)
                self.failures += 1
                self.last_error = str(err)
            logs.log(_log, "claim status not written; retrying", level=logging.WARNING,
                     claim=where, uid=entry.uid, attempt=failures, retry_in=round(delay, 2),
                     error=str(err))  # fmt: skip
            return
        with self._lock:
            if self._pending.pop(entry.uid, None) is not None and outcome in (WRITTEN, UNCHANGED):
                self._done.add(entry.uid)
                self.written += outcome == WRITTEN
        logs.log(_log, f"claim status {outcome}", claim=where, uid=entry.uid,
                 devices=len(entry.devices))  # fmt: skip

    def _abandon(self, entry: ClaimEntry, err: KubeError) -> None:
        with self._lock:
            if self._pending.pop(entry.uid, None) is None:
                return  # unprepared meanwhile
            self._done.add(entry.uid)  # not resubmitted until it is unprepared
            gone = err.status == 404  # deleted between the read and the write
            self.abandoned += not gone
            self.last_error = str(err)
        if gone:
            return
        logs.log(_log, "claim status refused; not retried", level=logging.WARNING,
                 claim=f"{entry.namespace}/{entry.name}", uid=entry.uid, status=err.status,
                 error=str(err))  # fmt: skip
        if self._on_abandoned is not None:
            self._on_abandoned(entry, err)

    def write(self, entry: ClaimEntry, claim: dict[str, Any] | None = None) -> str:
        """One read-modify-UPDATE (no read when given the claim); "written", "unchanged" (the
        claim already holds this record), or why nothing was written (the claim is gone)."""
        if claim is None:
            try:
                claim = self._api.get_resource_claim(entry.namespace, entry.name)
            except KubeError as err:
                if err.status == 404:
                    return "skipped (claim gone)"
                raise
        meta = claim.get("metadata") or {}
        if meta.get("uid") != entry.uid:
            return "skipped (claim replaced)"
        status = dict(claim.get("status") or {})
        now = self._wall()
        theirs: list[dict[str, Any]] = []  # other drivers' (or pools') entries, kept
        written: list[dict[str, Any]] = []  # ours, as the claim holds them now
        for d in status.get("devices") or []:
            mine = d.get("driver") == self._driver and d.get("pool") == self._node
            (written if mine else theirs).append(d)
        ours = [device_status(d, self._driver, self._mps_root, now) for d in entry.devices]
        if _records(written) == _records(ours):
            return UNCHANGED  # e.g. requeued after a restart: nothing to write
        status["devices"] = theirs + ours
        body = {
            "apiVersion": claim.get("apiVersion", "resource.k8s.io/v1"),
            "kind": "ResourceClaim",
            "metadata": {
                "name": entry.name,
                "namespace": entry.namespace,
                "uid": entry.uid,
                "resourceVersion": meta.get("resourceVersion"),
            },
            "spec": claim.get("spec") or {},
            "status": status,
        }
        self._api.replace_resource_claim_status(entry.namespace, entry.name, body)
        return WRITTEN
