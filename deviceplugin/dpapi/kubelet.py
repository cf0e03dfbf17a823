"""Talking to the kubelet: registration with backoff, and watching its directory.

`Registrar` registers one resource and retries refusals with capped exponential backoff;
`KubeletWatch` turns inotify events in the device-plugin directory (kubelet.sock re-created,
our own socket removed) into `RestartReason`s on the event loop.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from deviceplugin._pb import deviceplugin_v1beta1_pb2 as pb
from deviceplugin._pb import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from deviceplugin.dpapi.server import OPTIONS
from deviceplugin.plumbing import logs

LOG = logs.get("kubelet")

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
REGISTER_TIMEOUT = 30.0
BACKOFF_START = 0.5
BACKOFF_MAX = 30.0


class RestartReason(enum.StrEnum):
    KUBELET_RESTARTED = "kubelet-socket-recreated"
    OWN_SOCKET_GONE = "own-socket-gone"
    PLAN_CHANGED = "plan-changed"


class RegistrationError(Exception):
    pass


async def register(kubelet_socket: Path, endpoint: str, resource: str) -> None:
    """One Register call; raises RegistrationError with the kubelet's reason."""
    request = pb.RegisterRequest(
        version=API_VERSION, endpoint=endpoint, resource_name=resource, options=OPTIONS
    )
    async with grpc.aio.insecure_channel(f"unix://{kubelet_socket}") as channel:
        stub = pb_grpc.RegistrationStub(channel)
        try:
            await stub.Register(request, timeout=REGISTER_TIMEOUT)
        except grpc.aio.AioRpcError as exc:
            raise RegistrationError(f"{exc.code().name}: {exc.details()}") from None


@dataclass
class Backoff:
    start: float = BACKOFF_START
    cap: float = BACKOFF_MAX
    current: float = 0.0

    def next(self) -> float:
        self.current = self.start if self.current == 0 else min(self.cap, self.current * 2)
        return self.current

    def reset(self) -> None:
        self.current = 0.0


class KubeletWatch:
    """inotify on the kubelet directory; reasons land in an asyncio queue."""

    def __init__(self, kubelet_dir: Path, loop: asyncio.AbstractEventLoop) -> None:
        self._dir = kubelet_dir
        self._loop = loop
        self.events: asyncio.Queue[tuple[RestartReason, str]] = asyncio.Queue()
        self._own: set[str] = set()
        self._observer: Any = None

    def own(self, names: set[str]) -> None:
        """The socket file names currently ours (their removal means a kubelet restart)."""
        self._own = set(names)

    def start(self) -> None:
        watch = self

        class Handler(FileSystemEventHandler):
            def on_created(self, event: FileSystemEvent) -> None:
                watch._seen(event, created=True)

            def on_moved(self, event: FileSystemEvent) -> None:
                watch._seen(event, created=True, path=getattr(event, "dest_path", ""))

            def on_deleted(self, event: FileSystemEvent) -> None:
                watch._seen(event, created=False)

        observer = Observer()
        observer.schedule(Handler(), str(self._dir), recursive=False)
        observer.daemon = True
        observer.start()
        self._observer = observer

    def _seen(self, event: FileSystemEvent, created: bool, path: str | bytes = "") -> None:
        raw = path or event.src_path
        name = Path(raw.decode() if isinstance(raw, bytes) else raw).name
        if created and name == KUBELET_SOCKET:
            self._put(RestartReason.KUBELET_RESTARTED, name)
        elif not created and name in self._own:
            self._put(RestartReason.OWN_SOCKET_GONE, name)

    def _put(self, reason: RestartReason, name: str) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.events.put_nowait, (reason, name))

    def stop(self) -> None:
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.stop()
            observer.join(timeout=2)
