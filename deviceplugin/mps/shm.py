"""The per-GPU `/dev/shm` an MPS daemon shares with its clients: `<mps-root>/<uuid>/shm`.

A client reaches its server through the pipe directory *and* a shared `/dev/shm`
(reference/nvml-mps-xid.md 3.1), so the daemon and every client of a GPU must see the same
one. On a node the plugin mounts a tmpfs of `mps.shmSize` there (the MPS root is
`Bidirectional`, so the mount reaches the host and the containers); where it cannot, the
GPU's sm-sharing slices are not advertised. A simulation never mounts on the host: the
directory stays plain, bound at the daemon's `/dev/shm` when the plugin may make a mount
namespace (root), else the daemon keeps the host's `/dev/shm` and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path

from deviceplugin.mps import layout

SKIP_REASON = "mps-shm-unavailable"
MS_NOSUID = 2
MS_NODEV = 4

Mounter = Callable[[Path, int], None]


class ShmState(StrEnum):
    TMPFS = "tmpfs"  # a tmpfs of mps.shmSize, bound at the daemon's /dev/shm
    DIRECTORY = "directory"  # simulation as root: a plain directory bound at /dev/shm
    HOST = "host-shm"  # simulation without mount rights: the daemon keeps the host /dev/shm
    UNAVAILABLE = "unavailable"  # a node that cannot mount it: sm-sharing not advertised

    @property
    def bound(self) -> bool:
        """The daemon gets the shm dir as its /dev/shm (its own mount namespace or unit)."""
        return self in (ShmState.TMPFS, ShmState.DIRECTORY)


def mount_tmpfs(path: Path, size: int) -> None:
    """mount(2) a tmpfs of `size` bytes, mode 1777, at `path`; OSError when not allowed."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    options = f"size={size},mode=1777".encode()
    rc = libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", MS_NOSUID | MS_NODEV, options)
    if rc != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount tmpfs at {path}: {os.strerror(errno)}")


def may_mount() -> bool:
    """Whether this process may make mount namespaces and mounts (root; CAP_SYS_ADMIN)."""
    return os.geteuid() == 0


def ensure(
    root: Path,
    uuid: str,
    size: int,
    *,
    simulated: bool,
    mounter: Mounter | None = None,
    privileged: Callable[[], bool] | None = None,
) -> tuple[ShmState, str]:
    """Create the GPU's shm dir (and on a node its tmpfs); returns the state and why.

    Idempotent: a tmpfs already mounted there (a restarted plugin, live pods) is kept.
    """
    layout.prepare(root, uuid)
    path = layout.shm_dir(root, uuid)
    if simulated:
        if (privileged or may_mount)():
            return ShmState.DIRECTORY, "simulation: plain directory bound at the daemon's /dev/shm"
        return ShmState.HOST, "simulation without mount rights: daemon keeps the host /dev/shm"
    if os.path.ismount(path):
        return ShmState.TMPFS, "already mounted"
    try:
        (mounter or mount_tmpfs)(path, size)
    except OSError as exc:
        return ShmState.UNAVAILABLE, str(exc)
    return ShmState.TMPFS, f"mounted size={size}"
