"""ClaimCache: the ResourceClaims allocated to this node's pool, watched; a GET otherwise.

NodePrepareResources reads a claim here (DESIGN section 10): the cached copy only when it has
the UID asked for and is allocated, so a replaced or not yet allocated claim is always read
fresh. Only claims with a result of this driver in this node's pool are kept, so the cache
stays small in a large cluster. The watch runs in a thread and never blocks a gRPC call.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

from deviceplugin.dra.prepare import ClaimsUnavailable
from deviceplugin.kube.client import Api, Backoff, Gone, KubeError
from deviceplugin.plumbing import logs

LOG = logs.get("dra.claims")
ClaimKey = tuple[str, str]  # (namespace, name)


def ours(claim: dict[str, Any], driver: str, pool: str) -> bool:
    """Allocated with at least one result of `driver` in `pool`."""
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get(
        "results"
    ) or []
    return any(r.get("driver") == driver and r.get("pool") == pool for r in results)


def _key(claim: dict[str, Any]) -> ClaimKey:
    meta = claim.get("metadata") or {}
    return str(meta.get("namespace", "")), str(meta.get("name", ""))


class ClaimCache:
    """`get` answers at once from the cache or with one GET; `start()`/`stop()` run the watch."""

    def __init__(self, api: Api, driver: str, node: str, backoff: Backoff | None = None) -> None:
        self._api = api
        self._driver = driver
        self._node = node
        self._backoff = backoff or Backoff()
        self._lock = threading.Lock()
        self._claims: dict[ClaimKey, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._response: Any = None
        self.synced = threading.Event()  # the first list arrived

    # ---- ClaimSource -------------------------------------------------------------------
    def get(self, namespace: str, name: str, uid: str) -> dict[str, Any] | None:
        with self._lock:
            cached = self._claims.get((namespace, name))
        if cached is not None and (cached.get("metadata") or {}).get("uid") == uid:
            # Shared, read only: the watch replaces a claim whole and never edits one, and
            # no reader writes into it (a deep copy per claim was a third of a prepare).
            return cached  # kept only when allocated (see `ours`)
        try:
            claim = self._api.get_resource_claim(namespace, name)
        except KubeError as err:
            if err.status == 404:
                return None
            raise ClaimsUnavailable(str(err)) from err
        self._store("MODIFIED", claim)
        return claim

    def cached(self) -> int:
        with self._lock:
            return len(self._claims)

    # ---- watch -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dra-claims", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        response = self._response
        if response is not None:
            # Unblocks the watch read from this thread (urllib3 >= 2.3).
            with contextlib.suppress(Exception):  # already closed
                response.shutdown()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _store(self, kind: str, claim: dict[str, Any]) -> None:
        key = _key(claim)
        with self._lock:
            if kind != "DELETED" and ours(claim, self._driver, self._node):
                self._claims[key] = claim
            else:
                self._claims.pop(key, None)

    def _relist(self) -> str:
        listed = self._api.list_resource_claims()
        items = [c for c in listed.get("items") or [] if ours(c, self._driver, self._node)]
        with self._lock:
            self._claims = {_key(c): c for c in items}
        self.synced.set()
        return str((listed.get("metadata") or {}).get("resourceVersion", ""))

    def _events(self, version: str) -> Iterator[dict[str, Any]]:
        return self._api.watch_resource_claims(version, self._opened)

    def _opened(self, response: Any) -> None:
        self._response = response
        if self._stop.is_set():  # stop() raced with the open
            response.shutdown()

    def _run(self) -> None:
        failures = 0
        version = ""
        while not self._stop.is_set():
            try:
                if not version:
                    version = self._relist()
                for event in self._events(version):
                    if self._stop.is_set():
                        return
                    obj = event.get("object") or {}
                    version = str((obj.get("metadata") or {}).get("resourceVersion", version))
                    if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                        self._store(str(event["type"]), obj)
                failures = 0  # a watch the server ended: go on from `version` at once
            except Gone:
                version = ""
            except KubeError as err:
                if self._stop.is_set():
                    return
                delay = min(self._backoff.first * self._backoff.factor**failures,
                            self._backoff.cap)  # fmt: skip
                if failures == 0:
                    logs.log(LOG, "claim watch failed; retrying", level=logging.WARNING,
                             error=str(err))  # fmt: skip
                failures += 1
                version = ""
                self._stop.wait(delay)
