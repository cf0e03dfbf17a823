"""DraKubeletPlugin: the DRA socket, the registration socket, and keeping the latter there.

The DRA service (v1 and v1beta1, and the v1alpha1 health stream) listens on
`<plugins-dir>/<driver>/dra.sock` first; only then does the registration socket
`<registry-dir>/<driver>-reg.sock` appear, so the kubelet never dials an endpoint that does
not serve yet. A kubelet restart empties the registry directory (or
re-creates it): the socket is checked every second and re-created, and the kubelet registers us
again. A stale socket of our own name is removed at start; on stop only the sockets this
instance created (the same inode) go, never a successor's.

Rolling updates (an instance id, the pod's UID): the sockets are `dra-<id>.sock` and
`<driver>-<id>-reg.sock`, as the upstream helper's `RollingUpdate` names them (kubeletplugin
`draplugin.go`, `Start`), so two instances of a DaemonSet update with surge are registered at
once: the kubelet keeps both and uses the newest connected one, and the old one's socket
going away deregisters only the old one (kubernetes `pkg/kubelet/pluginmanager/pluginwatcher/
README.md`, "Seamless Upgrade"; kubelets from 1.33). The instances take turns preparing
(`locks.InstanceLock`, `serialize.lock` in `<plugins-dir>/<driver>/`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from deviceplugin._pb import pluginregistration_v1_pb2_grpc as reg_grpc
from deviceplugin.dra import health_stream, service, slices
from deviceplugin.dra.health_stream import HealthStreamService
from deviceplugin.dra.locks import LOCK_FILE
from deviceplugin.dra.prepare import Preparer
from deviceplugin.dra.registration import RegistrationService
from deviceplugin.plumbing import fsutil, logs

_log = logs.get("dra.plugin")

DRIVER = slices.DRIVER
DRA_SOCKET = "dra.sock"
UNIX_PATH_MAX = 107
_INSTANCE = re.compile(r"[a-z0-9]([-a-z0-9]{0,62})")  # a pod UID, or any short DNS label
WATCH_INTERVAL = 1.0  # the registration socket is back within this (the contract says 5 s)


class SocketPathTooLong(Exception):
    pass


def _part(instance: str | None) -> str:
    if instance is None:
        return ""
    if not _INSTANCE.fullmatch(instance):
        raise ValueError(f"DRA instance id {instance!r} is not a pod UID (lowercase, digits, -)")
    return f"-{instance}"


def dra_socket(plugins_dir: Path, driver: str = DRIVER, instance: str | None = None) -> Path:
    return plugins_dir / driver / f"dra{_part(instance)}.sock"


def registration_socket(
    registry_dir: Path, driver: str = DRIVER, instance: str | None = None
) -> Path:
    return registry_dir / f"{driver}{_part(instance)}-reg.sock"


def instance_lock(plugins_dir: Path, driver: str = DRIVER) -> Path:
    """The lock the instances of one node take turns with (rolling updates only)."""
    return plugins_dir / driver / LOCK_FILE


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the socket at `path`, or None when there is no socket there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISSOCK(st.st_mode) else None


def _clear(path: Path) -> None:
    if len(str(path).encode()) > UNIX_PATH_MAX:
        raise SocketPathTooLong(f"socket path {path} exceeds {UNIX_PATH_MAX} bytes")
    with contextlib.suppress(FileNotFoundError):
        if path.is_dir() and not path.is_symlink():
            raise IsADirectoryError(f"{path} is a directory, not a stale socket")
        path.unlink()


class DraKubeletPlugin:
    def __init__(
        self,
        *,
        plugins_dir: Path,
        registry_dir: Path,
        driver: str,
        preparer: Preparer,
        on_registration: Callable[[bool, str], None],
        health: HealthStreamService | None = None,
        observer: service.Observer | None = None,
        instance: str | None = None,
    ) -> None:
        self.driver = driver
        self.instance = instance
        self._health = health
        self._observer = observer
        self.dra_socket = dra_socket(plugins_dir, driver, instance)
        self.registration_socket = registration_socket(registry_dir, driver, instance)
        self._registry_dir = registry_dir
        self._preparer = preparer
        self._on_registration = on_registration
        self._dra_server: grpc.aio.Server | None = None
        self._reg_server: grpc.aio.Server | None = None
        self._reg_identity: tuple[int, int] | None = None
        self._dra_identity: tuple[int, int] | None = None
        self._watch: asyncio.Task[None] | None = None
        self._versions: list[str] = []
        self._registered = False
        self.registrations_served = 0  # registration sockets created (1 + re-creations)

    @property
    def registered(self) -> bool:
        """The kubelet's last verdict was a success and our registration socket is still there."""
        return self._registered

    def _status(self, ok: bool, error: str) -> None:
        self._registered = ok
        self._on_registration(ok, error)

    async def start(self) -> None:
        await self.stop()
        _clear(self.dra_socket)
        _clear(self.registration_socket)
        fsutil.ensure_dir(self.dra_socket.parent, 0o750)
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        self._versions = service.add_to_server(self._preparer, server, self._observer)
        if self._health is not None:  # listed after the DRAPlugin versions
            self._versions += health_stream.add_to_server(self._health, server)
        server.add_insecure_port(f"unix://{self.dra_socket}")
        await server.start()
        os.chmod(self.dra_socket, 0o600)
        self._dra_server = server
        self._dra_identity = _identity(self.dra_socket)
        logs.log(_log, "serving", socket=str(self.dra_socket), versions=",".join(self._versions))
        await self._serve_registration()
        self._watch = asyncio.create_task(self._keep_registration(), name="dra-registration")

    async def _serve_registration(self) -> None:
        """(Re)create the registration socket; the kubelet registers us when it appears."""
        old, self._reg_server = self._reg_server, None
        if old is not None:
            await old.stop(0)
        self._registered = False
        fsutil.ensure_dir(self._registry_dir, 0o750)
        _clear(self.registration_socket)
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        servicer = RegistrationService(
            self.driver, str(self.dra_socket), self._versions, self._status
        )
        reg_grpc.add_RegistrationServicer_to_server(servicer, server)
        server.add_insecure_port(f"unix://{self.registration_socket}")
        await server.start()
        os.chmod(self.registration_socket, 0o600)
        self._reg_server = server
        self._reg_identity = _identity(self.registration_socket)
        self.registrations_served += 1
        logs.log(_log, "registration socket ready", socket=str(self.registration_socket))

    async def _keep_registration(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            if _identity(self.registration_socket) == self._reg_identity:
                continue
            # Gone or replaced: the kubelet restarted (or someone cleaned up); it dropped us.
            if self._registered:
                self._status(False, "registration socket removed")
            logs.log(
                _log, "registration socket gone; re-creating", socket=str(self.registration_socket)
            )
            try:
                await self._serve_registration()
            except OSError as exc:  # e.g. the directory is being re-created: next round
                logs.log(_log, "registration socket not re-created", error=str(exc))

    async def stop(self) -> None:
        """Idempotent: registration first (the kubelet deregisters us), then the DRA service."""
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
        for server, path, mine in (
            (self._reg_server, self.registration_socket, self._reg_identity),
            (self._dra_server, self.dra_socket, self._dra_identity),
        ):
            if server is None:
                continue
            await server.stop(0.5)
            # only the socket we created: a successor may already have put its own there
            if mine is None or _identity(path) != mine:
                continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._reg_server = self._dra_server = None
        self._reg_identity = self._dra_identity = None
        self._registered = False

    def info(self) -> dict[str, Any]:
        """For logs and `inventory`: where we serve and whether the kubelet took us."""
        return {
            "driver": self.driver,
            "draSocket": str(self.dra_socket),
            "registrationSocket": str(self.registration_socket),
            "versions": list(self._versions),
            "registered": self._registered,
            "instance": self.instance,
        }
