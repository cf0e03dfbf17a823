"""ClaimReader: the ResourceClaims the kubelet names, one GET each, nothing kept.

NodePrepareResources reads each claim it has not prepared yet (DESIGN section 10): a GET by
namespace and name, several at once when the kubelet names several (as the upstream helper's
`getResourceClaims` does before it serialises). No list and no watch of claims: a node reads
only the claims its kubelet names, so API load does not grow with the cluster's claim churn,
no large list can exceed the container's memory, and RBAC needs `get` only. Nothing is cached:
a claim deallocated and allocated again keeps its UID, and only a fresh read sees the new
allocation. What this node prepared lives in the checkpoint.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from deviceplugin.dra.prepare import ClaimsUnavailable
from deviceplugin.kube.client import Api, KubeError

ClaimKey = tuple[str, str]  # (namespace, name)
# Concurrent GETs per process: one pod's claims (the kubelet's batch) rarely exceed this.
MAX_PARALLEL = 8


class ClaimReader:
    """`get` and `get_many` (ClaimSource) over the API server; `stop()` ends the pool."""

    def __init__(self, api: Api, max_parallel: int = MAX_PARALLEL) -> None:
        self._api = api
        self._max = max_parallel
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The claim as the API server has it now; None when not found."""
        try:
            return self._api.get_resource_claim(namespace, name)
        except KubeError as err:
            if err.status == 404:
                return None
            raise ClaimsUnavailable(str(err)) from err

    def get_many(
        self, keys: Sequence[ClaimKey]
    ) -> dict[ClaimKey, dict[str, Any] | ClaimsUnavailable | None]:
        """Each claim (or None, or why it could not be read), the GETs concurrent."""
        unique = list(dict.fromkeys(keys))
        if len(unique) <= 1:
            return {k: self._one(k) for k in unique}
        pool = self._executor()
        futures = {k: pool.submit(self._one, k) for k in unique}
        return {k: f.result() for k, f in futures.items()}

    def _one(self, key: ClaimKey) -> dict[str, Any] | ClaimsUnavailable | None:
        try:
            return self.get(*key)
        except ClaimsUnavailable as exc:
            return exc

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._max, thread_name_prefix="dra-claim-get")
            return self._pool

    def stop(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
