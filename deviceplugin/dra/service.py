"""The kubelet's DRAPlugin service, v1 and v1beta1: one servicer class over either module.

It only translates: claims in, `Preparer` answers out, the blocking work off the event loop.
v1 answers carry `share_id` where the result has one; v1beta1 has no such field.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol, TypeVar

import grpc

from deviceplugin._pb import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from deviceplugin.dra.prepare import ClaimRef, Preparer
from deviceplugin.plumbing import logs
from deviceplugin.plumbing.afterreply import Callback, after_reply, holding

_log = logs.get("dra.service")
T = TypeVar("T")

# (registration string, generated messages, generated service helpers), kubelet's choice first.
VERSIONS: tuple[tuple[str, ModuleType, ModuleType], ...] = (
    ("v1.DRAPlugin", dra_v1_pb2, dra_v1_pb2_grpc),
    ("v1beta1.DRAPlugin", dra_v1beta1_pb2, dra_v1beta1_pb2_grpc),
)


class Observer(Protocol):
    def prepare_latency(self, seconds: float) -> None: ...
    def unprepare_latency(self, seconds: float) -> None: ...


class DraPluginService:
    """NodePrepareResources and NodeUnprepareResources of one API version."""

    def __init__(
        self, preparer: Preparer, pb: ModuleType, observer: Observer | None = None
    ) -> None:
        self._preparer = preparer
        self._pb = pb
        self._observer = observer
        self._share_ids = "share_id" in pb.Device.DESCRIPTOR.fields_by_name
        self.version = pb.DESCRIPTOR.package.rsplit(".", 1)[-1]

    async def NodePrepareResources(self, request: Any, context: Any) -> Any:
        refs = [ClaimRef(c.namespace, c.name, c.uid) for c in request.claims]
        started = time.perf_counter()
        try:
            results, later = await asyncio.to_thread(_held, self._preparer.prepare, refs)
        except Exception as exc:  # a bug, not a claim's fault: the kubelet retries the pod
            await self._fail(context, "prepare", exc)
        finally:
            if self._observer is not None:
                self._observer.prepare_latency(time.perf_counter() - started)
        response = self._pb.NodePrepareResourcesResponse()
        for uid, result in results.items():
            answer = response.claims[uid]
            if result.error is not None:
                answer.error = result.error
                continue
            for d in result.devices:
                device = answer.devices.add(
                    request_names=list(d.request_names),
                    pool_name=d.pool_name,
                    device_name=d.device_name,
                    cdi_device_ids=list(d.cdi_device_ids),
                )
                if d.share_id is not None and self._share_ids:
                    device.share_id = d.share_id
        _queue(later)
        return response

    async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        refs = [ClaimRef(c.namespace, c.name, c.uid) for c in request.claims]
        started = time.perf_counter()
        try:
            errors, later = await asyncio.to_thread(_held, self._preparer.unprepare, refs)
        except Exception as exc:
            await self._fail(context, "unprepare", exc)
        finally:
            if self._observer is not None:
                self._observer.unprepare_latency(time.perf_counter() - started)
        response = self._pb.NodeUnprepareResourcesResponse()
        for uid, error in errors.items():
            answer = response.claims[uid]  # an entry for every claim, empty on success
            if error is not None:
                answer.error = error
        _queue(later)
        return response

    async def _fail(self, context: Any, what: str, exc: Exception) -> Any:
        logs.log(_log, f"{what} failed", level=logging.ERROR, version=self.version, error=repr(exc))
        await context.abort(grpc.StatusCode.INTERNAL, f"{what} failed: {exc}")
        raise AssertionError("context.abort returned")


def _held(work: Callable[[list[ClaimRef]], T], refs: list[ClaimRef]) -> tuple[T, list[Callback]]:
    """`work(refs)` in the worker thread, its log lines and wake-ups held for after the reply."""
    with holding() as later:
        return work(refs), later


def _queue(later: list[Callback]) -> None:
    for callback in later:
        after_reply(callback)


def add_to_server(preparer: Preparer, server: Any, observer: Observer | None = None) -> list[str]:
    """Serve every DRAPlugin version on `server`; returns their registration strings."""
    names = []
    for name, pb, pb_grpc in VERSIONS:
        servicer = DraPluginService(preparer, pb, observer)
        pb_grpc.add_DRAPluginServicer_to_server(servicer, server)
        names.append(name)
    return names
