"""The kubelet plugin-registration service for our DRA driver (`pluginregistration.Registration`).

The kubelet's plugin watcher dials the socket in its registry directory, calls GetInfo (1 s
timeout) and answers with NotifyRegistrationStatus. GetInfo is a constant answer; the verdict is
logged and handed to a callback so readiness and slice publication can follow it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from deviceplugin._pb import pluginregistration_v1_pb2 as pb
from deviceplugin.plumbing import logs

_log = logs.get("dra.registration")

PLUGIN_TYPE = "DRAPlugin"


class RegistrationService:
    def __init__(
        self,
        driver: str,
        endpoint: str,
        versions: Sequence[str],
        on_status: Callable[[bool, str], None],
    ) -> None:
        self._info = pb.PluginInfo(
            type=PLUGIN_TYPE, name=driver, endpoint=endpoint, supported_versions=list(versions)
        )
        self._on_status = on_status

    async def GetInfo(self, request: pb.InfoRequest, context: Any) -> pb.PluginInfo:
        return self._info

    async def NotifyRegistrationStatus(
        self, request: pb.RegistrationStatus, context: Any
    ) -> pb.RegistrationStatusResponse:
        ok, error = request.plugin_registered, request.error
        logs.log(
            _log,
            "registered with kubelet" if ok else "kubelet refused registration",
            level=logging.INFO if ok else logging.ERROR,
            driver=self._info.name,
            error=error or "-",
        )
        self._on_status(ok, error)
        return pb.RegistrationStatusResponse()
