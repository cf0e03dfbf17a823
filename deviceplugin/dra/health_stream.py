"""The kubelet's `v1alpha1.DRAResourceHealth` stream (KEP-4680): per-device health to pods.

`NodeWatchResources` sends the complete list of this driver's devices at once, then again on
every change (paced like ListAndWatch, the last send carrying the final state) and at least
every `HEARTBEAT` seconds, so the kubelet never times a device out to Unknown while we serve.
HEALTHY, UNHEALTHY with the cause, or UNKNOWN where health monitoring is down (`unmonitored`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from deviceplugin._pb import dra_health_v1alpha1_pb2 as pb
from deviceplugin._pb import dra_health_v1alpha1_pb2_grpc as pb_grpc
from deviceplugin.plumbing import logs
from deviceplugin.plumbing.updates import Changes, Pacer

_log = logs.get("dra.health")

SERVICE = "v1alpha1.DRAResourceHealth"
TIMEOUT_SECONDS = 60  # health_check_timeout_seconds: Unknown if we go quiet this long
HEARTBEAT = TIMEOUT_SECONDS / 3
MESSAGE_MAX = 1024  # the kubelet truncates longer ones


@dataclass(frozen=True)
class DeviceState:
    device: str  # gpu-<index>
    health: str  # "Healthy" | "Unhealthy" | "Unknown"
    message: str


_HEALTH = {"Healthy": pb.HEALTHY, "Unhealthy": pb.UNHEALTHY, "Unknown": pb.UNKNOWN}


class HealthStreamService(pb_grpc.DRAResourceHealthServicer):
    """`poke()` from any thread when health may have changed; `devices()` says what it is."""

    def __init__(
        self,
        pool: str,
        devices: Callable[[], Sequence[DeviceState]],
        *,
        heartbeat: float = HEARTBEAT,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._pool = pool
        self._devices = devices
        self._heartbeat = heartbeat
        self._wall = wall
        self._changes = Changes()
        self.streams = 0  # streams opened so far

    def poke(self) -> None:
        self._changes.poke()

    def response(self, states: Sequence[DeviceState] | None = None) -> Any:
        """The complete list: `states`, or what `devices()` says now."""
        now = int(self._wall())
        return pb.NodeWatchResourcesResponse(
            devices=[
                pb.DeviceHealth(
                    device=pb.DeviceIdentifier(pool_name=self._pool, device_name=d.device),
                    health=_HEALTH[d.health],
                    last_updated_time=now,
                    health_check_timeout_seconds=TIMEOUT_SECONDS,
                    message=d.message[:MESSAGE_MAX],
                )
                for d in (self._devices() if states is None else states)
            ]
        )

    async def NodeWatchResources(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.streams += 1
        logs.log(_log, "health stream opened", pool=self._pool)
        version = self._changes.version
        last = list(self._devices())
        yield self.response(last)
        pacer = Pacer()
        pacer.sent()
        try:
            while True:
                seen = version
                version = await self._changes.wait(version, self._heartbeat)
                beat = version == seen  # nothing changed: the heartbeat is due
                if not beat and (wait := pacer.delay()) > 0:
                    await asyncio.sleep(wait)
                    version = self._changes.version
                now = list(self._devices())
                if now == last and not beat:
                    continue
                last = now
                pacer.sent()
                yield self.response(now)
        except asyncio.CancelledError:
            logs.log(_log, "health stream closed", pool=self._pool)
            return


def add_to_server(service: HealthStreamService, server: Any) -> list[str]:
    pb_grpc.add_DRAResourceHealthServicer_to_server(service, server)
    return [SERVICE]
