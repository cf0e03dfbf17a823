"""ResourceServer: one grpc.aio DevicePlugin server per resource name, on its own socket.

The servicer only delegates: device lists come from the DeviceFeed, preferred allocations and
Allocate answers from the allocation backend. It never sees NVML.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, Protocol

import grpc

from deviceplugin._pb import deviceplugin_v1beta1_pb2 as pb
from deviceplugin._pb import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from deviceplugin.dpapi.allocator import AllocationError, MpsNotReady
from deviceplugin.dpapi.answers import AnswerCache, GrantLike, allocate_response
from deviceplugin.dpapi.feed import DeviceFeed
from deviceplugin.dpapi.grpcerrors import status_for
from deviceplugin.model import GpuUuid
from deviceplugin.plumbing import logs
from deviceplugin.plumbing.afterreply import after_reply
from deviceplugin.plumbing.updates import Pacer

LOG = logs.get("server")

OPTIONS = pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)
MPS_READY_TIMEOUT = 10.0


SERVICE = "v1beta1.DevicePlugin"
UNIX_PATH_MAX = 107


class SocketPathTooLong(Exception):
    pass


class AllocationBackend(Protocol):
    def preferred(
        self, resource: str, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str]: ...

    def allocate(self, resource: str, device_ids: Sequence[str]) -> GrantLike: ...

    def wait_mps(self, gpu: GpuUuid, timeout: float) -> bool: ...


class Observer(Protocol):
    def allocate_latency(self, resource: str, seconds: float) -> None: ...
    def preferred_latency(self, resource: str, seconds: float) -> None: ...
    def refused(self, resource: str, reason: str, count: int = 0, message: str = "") -> None: ...


class DevicePluginService(pb_grpc.DevicePluginServicer):
    def __init__(
        self,
        resource: str,
        feed: DeviceFeed,
        backend: AllocationBackend,
        observer: Observer | None = None,
    ) -> None:
        self.resource = resource
        self._feed = feed
        self._backend = backend
        self._observer = observer
        self._cache: tuple[int, bytes] | None = None
        self._answers = AnswerCache()
        self.open_streams = 0
        # Told (on the event loop) whenever a ListAndWatch stream of this service ends.
        self.on_stream_closed: Callable[[], None] | None = None

    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: Any
    ) -> pb.DevicePluginOptions:
        return OPTIONS

    def current(self) -> bytes:
        """This resource's serialized ListAndWatchResponse (see `add_to_server`)."""
        version = self._feed.version
        if self._cache is None or self._cache[0] != version:
            self._cache = (version, self._feed.encoded(self.resource))
        return self._cache[1]

    async def ListAndWatch(self, request: pb.Empty, context: Any) -> AsyncIterator[bytes]:
        # Full list at once, then a full list on every change; never ends while we serve.
        # When the kubelet goes away grpc cancels this generator at its next await.
        self.open_streams += 1
        try:
            version = self._feed.version
            last = self.current()
            yield last
            # At most MAX_UPDATES_PER_SECOND a second; the last always carries the final state.
            pacer = Pacer()
            pacer.sent()
            while True:
                version = await self._feed.wait(version)
                wait = pacer.delay()
                if wait > 0:
                    await asyncio.sleep(wait)
                    version = self._feed.version
                response = self.current()
                if response == last:
                    continue
                last = response
                pacer.sent()
                yield response
        except asyncio.CancelledError:
            return  # the kubelet went away or closed the stream, or we are stopping
        finally:
            self.open_streams -= 1
            if self.on_stream_closed is not None:
                self.on_stream_closed()

    async def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: Any
    ) -> pb.PreferredAllocationResponse:
        started = time.perf_counter()
        responses = []
        for req in request.container_requests:
            try:
                ids = self._backend.preferred(
                    self.resource,
                    req.available_deviceIDs,  # ~4,450 IDs: turned into one set, nothing more
                    list(req.must_include_deviceIDs),
                    req.allocation_size,
                )
            except AllocationError as exc:
                await self._refuse(context, exc)
            responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        if self._observer:
            # The histogram's lock and bucket walk after the reply: it is timed already.
            after_reply(
                functools.partial(
                    self._observer.preferred_latency, self.resource, time.perf_counter() - started
                )
            )
        return pb.PreferredAllocationResponse(container_responses=responses)

    async def Allocate(self, request: pb.AllocateRequest, context: Any) -> bytes:
        """A serialized AllocateResponse (see `add_to_server`): each shape's shared fields
        are encoded once (answers.py)."""
        started = time.perf_counter()
        containers = []
        for req in request.container_requests:
            grant = await self._grant(list(req.devices_ids), context)
            containers.append(self._answers.container(grant))
        if self._observer:
            after_reply(
                functools.partial(
                    self._observer.allocate_latency, self.resource, time.perf_counter() - started
                )
            )
        return allocate_response(containers)

    async def _grant(self, ids: list[str], context: Any) -> GrantLike:
        try:
            return self._backend.allocate(self.resource, ids)
        except MpsNotReady as exc:
            # The GPU's MPS daemon is still starting: wait off the event loop, then retry once.
            ready = await asyncio.to_thread(self._backend.wait_mps, exc.gpu, MPS_READY_TIMEOUT)
            if not ready:
                await self._refuse(context, exc, len(ids))
            try:
                return self._backend.allocate(self.resource, ids)
            except AllocationError as again:
                await self._refuse(context, again, len(ids))
        except AllocationError as exc:
            await self._refuse(context, exc, len(ids))

    async def _refuse(self, context: Any, exc: AllocationError, count: int = 0) -> NoReturn:
        logs.log(LOG, "refused", resource=self.resource, code=exc.code, reason=exc.message)
        if self._observer:
            self._observer.refused(self.resource, str(exc.code), count, exc.message)
        await context.abort(status_for(exc.code), exc.message)
        raise AssertionError("context.abort returned")

    async def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: Any
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


def _already_serialized(message: bytes | Any) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def add_to_server(service: DevicePluginService, server: Any) -> None:
    """The generated registration, except that ListAndWatch and Allocate answer
    pre-serialized bytes.

    A list of thousands of devices is encoded once per change (from cached per-GPU pieces)
    instead of being rebuilt as messages and serialized again for every stream; an Allocate
    answer from its shape's bytes.
    """
    unary = grpc.unary_unary_rpc_method_handler
    handlers = {
        "GetDevicePluginOptions": unary(
            service.GetDevicePluginOptions,
            request_deserializer=pb.Empty.FromString,
            response_serializer=pb.DevicePluginOptions.SerializeToString,
        ),
        "ListAndWatch": grpc.unary_stream_rpc_method_handler(
            service.ListAndWatch,
            request_deserializer=pb.Empty.FromString,
            response_serializer=_already_serialized,
        ),
        "GetPreferredAllocation": unary(
            service.GetPreferredAllocation,
            request_deserializer=pb.PreferredAllocationRequest.FromString,
            response_serializer=pb.PreferredAllocationResponse.SerializeToString,
        ),
        "Allocate": unary(
            service.Allocate,
            request_deserializer=pb.AllocateRequest.FromString,
            response_serializer=_already_serialized,
        ),
        "PreStartContainer": unary(
            service.PreStartContainer,
            request_deserializer=pb.PreStartContainerRequest.FromString,
            response_serializer=pb.PreStartContainerResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


class ResourceServer:
    """A DevicePlugin gRPC server on a fresh unix socket inside the kubelet directory."""

    def __init__(self, service: DevicePluginService, kubelet_dir: Path, instance: str) -> None:
        self.service = service
        self._kubelet_dir = kubelet_dir
        self._instance = instance
        self._generation = 0
        self._server: grpc.aio.Server | None = None
        self.socket_path: Path | None = None

    @property
    def resource(self) -> str:
        return self.service.resource

    def _socket_name(self) -> str:
        # Unique per plugin instance and per restart; the kubelet only needs a bare file name.
        short = self.resource.rsplit("/", 1)[-1]
        return f"gfp-{short}-{self._instance}-{self._generation}.sock"

    async def start(self) -> Path:
        await self.stop()
        self._generation += 1
        path = self._kubelet_dir / self._socket_name()
        if len(str(path).encode()) > UNIX_PATH_MAX:
            raise SocketPathTooLong(
                f"socket path {path} exceeds {UNIX_PATH_MAX} bytes; use a shorter --kubelet-dir"
            )
        if path.exists() or path.is_symlink():
            path.unlink()
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        add_to_server(self.service, server)
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        os.chmod(path, 0o600)
        self._server = server
        self.socket_path = path
        logs.log(LOG, "serving", resource=self.resource, socket=path.name)
        return path

    async def stop(self, grace: float = 0.5) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)
        path, self.socket_path = self.socket_path, None
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
