"""PluginSet: the per-resource servers, their registration, and restarts on kubelet events.

It keeps one ResourceServer per resource name, registers each with the kubelet (retrying a
refusal with backoff), and on a kubelet restart (kubelet.sock re-created) or the loss of its own
socket starts a fresh socket and registers again at once. When the kubelet closes a stream of a
registered resource and opens none, it registers that resource again (kubelets before 1.37
drop the newest plugin of a resource when an older one's stream ends, as in a rolling update).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from deviceplugin.dpapi.kubelet import (
    KUBELET_SOCKET,
    Backoff,
    KubeletWatch,
    RegistrationError,
    RestartReason,
    register,
)
from deviceplugin.dpapi.server import DevicePluginService, ResourceServer
from deviceplugin.plumbing import logs
from deviceplugin.plumbing.updates import MAX_UPDATES_PER_SECOND

LOG = logs.get("registry")
AUDIT_INTERVAL = 5.0  # seconds between the stat() checks behind inotify
# A stream the kubelet closed while we serve: register again after this long unless it opened
# another one (a closed stream is how a kubelet going away looks first, too).
REREGISTER_AFTER = 0.5

ServiceFactory = Callable[[str], DevicePluginService]


class PluginSet:
    def __init__(
        self,
        kubelet_dir: Path,
        instance: str,
        service_factory: ServiceFactory,
        on_registered: Callable[[str], None] | None = None,
        on_kubelet_restart: Callable[[], None] | None = None,
    ) -> None:
        self._dir = kubelet_dir
        self._instance = instance
        self._factory = service_factory
        self._on_registered = on_registered
        self._on_kubelet_restart = on_kubelet_restart
        self._servers: dict[str, ResourceServer] = {}
        self._wanted: frozenset[str] | None = None  # the last sync's resources; None before it
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.registered: dict[str, float] = {}  # resource -> monotonic time of last success
        # inode of the kubelet.sock each resource registered with: a re-created socket that
        # we already registered with needs no second restart
        self._registered_with: dict[str, int] = {}
        self._attempting: set[str] = set()
        self._watch: KubeletWatch | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._audit_task: asyncio.Task[None] | None = None
        self.audit_interval = AUDIT_INTERVAL
        self.reregister_after = REREGISTER_AFTER

    @property
    def resources(self) -> list[str]:
        return sorted(self._servers)

    def all_registered(self) -> bool:
        """Every resource of the last sync is registered; true for none (a node whose plan
        serves nothing must not stall a rollout), false before the first sync."""
        wanted = self._wanted
        return wanted is not None and all(r in self.registered for r in wanted)

    async def start(self, resources: list[str]) -> None:
        loop = asyncio.get_running_loop()
        self._watch = KubeletWatch(self._dir, loop)
        self._watch.start()
        self._watch_task = asyncio.create_task(self._follow(self._watch), name="kubelet-watch")
        self._audit_task = asyncio.create_task(self._audit(), name="kubelet-audit")
        await self.sync(resources)

    async def sync(self, resources: list[str]) -> None:
        """Serve exactly these resources (after a plan change)."""
        self._wanted = frozenset(resources)
        retired = sorted(set(self._servers) - set(resources))
        if retired and any(r in self.registered for r in retired):
            # Their streams now send an empty list (the plan has no device for them): let it
            # reach the kubelet, so capacity drops at once, not after its 5-minute grace for a
            # plugin that went away.
            await asyncio.sleep(1.0 / MAX_UPDATES_PER_SECOND + 0.1)
        for resource in retired:
            await self._drop(resource)
        for resource in sorted(set(resources) - set(self._servers)):
            service = self._factory(resource)
            service.on_stream_closed = lambda r=resource: self._stream_closed(r)
            server = ResourceServer(service, self._dir, self._instance)
            self._servers[resource] = server
            await self._restart(resource)

    async def stop(self) -> None:
        for task in (self._watch_task, self._audit_task):
            if task is not None:
                task.cancel()
        self._watch_task = self._audit_task = None
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        for resource in list(self._servers):
            await self._drop(resource)

    async def _drop(self, resource: str) -> None:
        task = self._tasks.pop(resource, None)
        if task is not None:
            task.cancel()
        server = self._servers.pop(resource)
        self.registered.pop(resource, None)
        await server.stop()
        self._own_sockets()

    async def _restart(self, resource: str) -> None:
        """Fresh socket, then register (cancelling any registration still retrying)."""
        task = self._tasks.pop(resource, None)
        if task is not None:
            task.cancel()
        self.registered.pop(resource, None)
        self._registered_with.pop(resource, None)
        server = self._servers[resource]
        await server.start()
        self._own_sockets()
        self._spawn_registration(resource, server)

    def _spawn_registration(self, resource: str, server: ResourceServer) -> None:
        task = self._tasks.pop(resource, None)
        if task is not None:
            task.cancel()
        self._attempting.discard(resource)
        self._tasks[resource] = asyncio.create_task(
            self._register_until_done(resource, server), name=f"register:{resource}"
        )

    def _stream_closed(self, resource: str) -> None:
        if resource in self._servers and resource in self.registered:
            loop = asyncio.get_running_loop()
            loop.call_later(self.reregister_after, self._register_if_dropped, resource)

    def _register_if_dropped(self, resource: str) -> None:
        """Register again where the kubelet closed our last stream but did not restart.

        Kubelets before 1.37 keep one client per resource name: when an older instance's
        stream ends (a rolling update's old pod stops after ours registered), `runClient`
        (pkg/kubelet/cm/devicemanager/plugin/v1beta1/handler.go, v1.36) disconnects whatever
        client the name maps to now, ours, and marks every device unhealthy; nothing
        reconnects it, so the node would advertise none of them until the next restart."""
        server = self._servers.get(resource)
        if server is None or resource not in self.registered or resource in self._attempting:
            return  # stopped, restarting or already registering
        if server.service.open_streams > 0:
            return  # the kubelet is watching us
        if server.socket_path is None or not server.socket_path.exists():
            return  # our socket is gone: the watch restarts it
        if _inode(self._dir / KUBELET_SOCKET) != self._registered_with.get(resource):
            return  # a kubelet restart, which has its own path
        logs.log(LOG, "stream closed by the kubelet; registering again", resource=resource)
        self._spawn_registration(resource, server)

    def _own_sockets(self) -> None:
        if self._watch is not None:
            self._watch.own({s.socket_path.name for s in self._servers.values() if s.socket_path})

    async def _register_until_done(self, resource: str, server: ResourceServer) -> None:
        backoff = Backoff()
        while True:
            path = server.socket_path
            if path is None:
                return
            self._attempting.add(resource)
            try:
                await register(self._dir / KUBELET_SOCKET, path.name, resource)
            except RegistrationError as exc:
                self._attempting.discard(resource)
                delay = backoff.next()
                logs.log(LOG, "register failed", resource=resource, reason=str(exc), retry_in=delay)
                await asyncio.sleep(delay)
                continue
            self._attempting.discard(resource)
            self.registered[resource] = time.monotonic()
            self._registered_with[resource] = _inode(self._dir / KUBELET_SOCKET)
            logs.log(LOG, "registered", resource=resource, endpoint=path.name)
            if self._on_registered:
                self._on_registered(resource)
            return

    async def _follow(self, watch: KubeletWatch) -> None:
        while True:
            reason, name = await watch.events.get()
            if reason is RestartReason.KUBELET_RESTARTED:
                logs.log(LOG, "kubelet restarted", reason=reason.value)
                if self._on_kubelet_restart:
                    self._on_kubelet_restart()
                await self._after_kubelet_restart()
            elif reason is RestartReason.OWN_SOCKET_GONE:
                for resource, server in list(self._servers.items()):
                    if server.socket_path is not None and server.socket_path.name == name:
                        logs.log(LOG, "restart", reason=reason.value, resource=resource)
                        await self._restart(resource)

    async def _audit(self) -> None:
        """A slow check behind inotify, which misses events when the directory itself is
        replaced (a re-mounted kubelet dir) or its watch queue overflows."""
        while True:
            await asyncio.sleep(self.audit_interval)
            current = _inode(self._dir / KUBELET_SOCKET)
            stale = any(
                resource in self.registered and self._registered_with.get(resource) != current
                for resource in self._servers
            )
            missing = any(
                s.socket_path is not None and not s.socket_path.exists()
                for s in self._servers.values()
            )
            if current != -1 and (stale or missing):
                logs.log(LOG, "kubelet restart noticed by audit", stale=stale, missing=missing)
                if self._on_kubelet_restart:
                    self._on_kubelet_restart()
                await self._after_kubelet_restart()

    async def _after_kubelet_restart(self) -> None:
        current = _inode(self._dir / KUBELET_SOCKET)
        for resource, server in list(self._servers.items()):
            if server.socket_path is None or not server.socket_path.exists():
                await self._restart(resource)  # the kubelet removed our socket
            elif resource in self.registered and self._registered_with.get(resource) == current:
                continue  # already registered with this kubelet
            elif resource in self._attempting:
                continue  # a Register call is in flight; a failure retries within 0.5 s
            else:
                self._spawn_registration(resource, server)  # cut a backoff sleep short


def _inode(path: Path) -> int:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return -1
