"""PodCache: the pods bound to this node, kept in memory by list + watch.

Allocate reads only this cache (never the network). The watch resumes from the last
resourceVersion after a disconnect and relists on 410 Gone; while the API server cannot be
reached the cache reports itself unsynced, so ceilings fall back to the request.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from deviceplugin.kube.client import Api, Backoff, Gone, KubeError
from deviceplugin.plumbing import logs

LOG = logs.get("kube.pods")
# Only annotations under these prefixes are kept; the rest of a pod is not our business.
KEPT_ANNOTATION_PREFIXES = ("nvidia.com/container.", "gpu-fraction.dev/")
# The watch never gives up; it only slows down.
WATCH_BACKOFF = Backoff(first=0.5, cap=30.0, attempts=1_000_000)


@dataclass(frozen=True)
class ContainerInfo:
    name: str
    init: bool
    resources: Mapping[str, int]  # extended resource → count (limits, else requests)


@dataclass(frozen=True)
class PodInfo:
    uid: str
    namespace: str
    name: str
    phase: str
    deleting: bool
    annotations: Mapping[str, str] = field(default_factory=dict)
    containers: tuple[ContainerInfo, ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)


def _counts(resources: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    if not isinstance(resources, dict):
        return out
    # Extended resources must have limits; requests, when given, equal them.
    for source in (resources.get("requests"), resources.get("limits")):
        if not isinstance(source, dict):
            continue
        for name, value in source.items():
            if "/" in name and isinstance(value, str | int) and str(value).isdigit():
                out[name] = int(value)
    return out


def pod_from_json(obj: Mapping[str, Any]) -> PodInfo:
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    annotations = {
        k: str(v)
        for k, v in (meta.get("annotations") or {}).items()
        if k.startswith(KEPT_ANNOTATION_PREFIXES)
    }
    containers = tuple(
        ContainerInfo(str(c.get("name", "")), init, _counts(c.get("resources")))
        for key, init in (("initContainers", True), ("containers", False))
        for c in spec.get(key) or ()
        if isinstance(c, dict)
    )
    return PodInfo(
        uid=str(meta.get("uid", "")),
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        phase=str((obj.get("status") or {}).get("phase", "")),
        deleting=meta.get("deletionTimestamp") is not None,
        annotations=annotations,
        containers=containers,
    )


class PodCache:
    """List + watch of `spec.nodeName=<node>` in a background thread; `stop()` is idempotent."""

    def __init__(
        self,
        api: Api,
        node: str,
        backoff: Backoff = WATCH_BACKOFF,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self._api = api
        self._node = node
        self._backoff = backoff
        self._on_change = on_change
        self._lock = threading.Lock()
        self._pods: dict[str, PodInfo] = {}
        self._synced = False
        self._rv = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._response: Any = None
        self._progress = False  # an event arrived since the last list
        self.relists = 0  # how many full lists ran; tests and metrics read it

    @property
    def synced(self) -> bool:
        return self._synced

    def pods(self) -> list[PodInfo]:
        with self._lock:
            return list(self._pods.values())

    def get(self, namespace: str, name: str) -> PodInfo | None:
        with self._lock:
            return next(
                (p for p in self._pods.values() if p.namespace == namespace and p.name == name),
                None,
            )

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kube-pod-cache", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        response = self._response
        if response is not None:
            # Unblocks the watch read from this thread (urllib3 >= 2.3).
            with contextlib.suppress(Exception):  # already closed
                response.shutdown()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        delays = self._backoff.delays()
        need_list = True
        while not self._stop.is_set():
            try:
                if need_list:
                    self._relist()
                    need_list = False
                self._watch()
                delays = self._backoff.delays()  # a watch that opened resets the backoff
            except Gone:
                logs.log(LOG, "pod watch expired; relisting", node=self._node)
                # Gone with no event since the last list: the server is unwell, back off.
                if not self._progress and self._stop.wait(next(delays, self._backoff.cap)):
                    break
                need_list = True
                continue
            except KubeError as err:
                self._synced = False
                delay = next(delays, self._backoff.cap)
                logs.log(LOG, "pod watch failed", level=logging.WARNING, error=str(err),
                         retry_in=delay)  # fmt: skip
                if self._stop.wait(delay):
                    break
            except Exception as err:  # never let the thread die on a surprise
                self._synced = False
                logs.log(LOG, "pod watch error", level=logging.ERROR, error=repr(err))
                need_list = True
                if self._stop.wait(self._backoff.cap):
                    break

    def _relist(self) -> None:
        listed = self._api.list_pods(self._node)
        pods = {}
        for item in listed.get("items") or ():
            pod = pod_from_json(item)
            pods[pod.uid] = pod
        with self._lock:
            self._pods = pods
            self._rv = str((listed.get("metadata") or {}).get("resourceVersion", ""))
        self.relists += 1
        self._progress = False
        self._synced = True
        logs.log(LOG, "pods listed", node=self._node, pods=len(pods), resource_version=self._rv)
        self._changed()

    def _watch(self) -> None:
        for event in self._api.watch_pods(self._node, self._rv, self._opened):
            if self._stop.is_set():
                return
            self._apply(event)
        self._response = None

    def _opened(self, response: Any) -> None:
        self._response = response
        self._synced = True
        if self._stop.is_set():  # stop() raced with the open
            response.shutdown()

    def _apply(self, event: Mapping[str, Any]) -> None:
        obj = event.get("object") or {}
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        kind = event.get("type")
        self._progress = True
        with self._lock:
            if rv:
                self._rv = str(rv)
            if kind == "BOOKMARK":
                return
            pod = pod_from_json(obj)
            if kind == "DELETED":
                self._pods.pop(pod.uid, None)
            elif kind in ("ADDED", "MODIFIED"):
                self._pods[pod.uid] = pod
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()
