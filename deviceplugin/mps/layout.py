"""The on-disk MPS contract: every path and marker under the MPS root, in one place.

Per GPU: `<root>/<uuid>/pipe` (CUDA_MPS_PIPE_DIRECTORY, with the daemon's pid file and
sockets; clients get this same path string, mounted at this same path), `<root>/<uuid>/shm`
(the daemon's and every client's `/dev/shm`), `<root>/<uuid>/log` (CUDA_MPS_LOG_DIRECTORY)
and `<root>/<uuid>/daemon.json` (what the supervisor started: pid, settings, whether it set
the compute mode). The supervisor, the
allocator and `mps stop` all read paths from here and nowhere else.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

from deviceplugin.model import GpuUuid
from deviceplugin.plumbing import fsutil

PID_FILE = "nvidia-cuda-mps-control.pid"
CONTROL_SOCKET = "control"
PRIVILEGED_SOCKET = "control_privileged"
# Files the daemon leaves in the pipe dir (reference 3.1); removed before a fresh start.
PIPE_FILES = (CONTROL_SOCKET, PRIVILEGED_SOCKET, "control_lock", "log", PID_FILE)
CONTROL_LOG = "control.log"
MARKER = "daemon.json"
# sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107
# The pid file holds a pid and a newline; the marker a few hundred bytes. Reads stop here.
PID_FILE_MAX = 32
MARKER_MAX = 64 * 1024
DIR_MODE = 0o755  # clients of any UID must reach the sockets; only root writes here
SHM_MODE = 0o1777  # a /dev/shm: every client UID creates its segments there (sticky)

_UUID_RE = re.compile(r"^(GPU|MIG)-[0-9A-Za-z-]{1,80}$")


class LayoutError(Exception):
    """The MPS root or a path under it is unsafe or unusable."""


def check_uuid(uuid: str) -> GpuUuid:
    """Return `uuid` when it is safe as a single path component, else raise LayoutError."""
    if not _UUID_RE.fullmatch(uuid):  # fullmatch: `$` would let a trailing newline in
        raise LayoutError(f"not a GPU UUID usable in a path: {uuid!r}")
    return GpuUuid(uuid)


def gpu_dir(root: Path, uuid: str) -> Path:
    return root / check_uuid(uuid)


def pipe_dir(root: Path, uuid: str) -> Path:
    return gpu_dir(root, uuid) / "pipe"


def shm_dir(root: Path, uuid: str) -> Path:
    return gpu_dir(root, uuid) / "shm"


def log_dir(root: Path, uuid: str) -> Path:
    return gpu_dir(root, uuid) / "log"


def pid_file(root: Path, uuid: str) -> Path:
    return pipe_dir(root, uuid) / PID_FILE


def control_socket(root: Path, uuid: str) -> Path:
    return pipe_dir(root, uuid) / CONTROL_SOCKET


def privileged_socket(root: Path, uuid: str) -> Path:
    """The longest socket path the daemon binds; it decides the 107-byte check."""
    return pipe_dir(root, uuid) / PRIVILEGED_SOCKET


def control_log(root: Path, uuid: str) -> Path:
    return log_dir(root, uuid) / CONTROL_LOG


def marker_path(root: Path, uuid: str) -> Path:
    return gpu_dir(root, uuid) / MARKER


def check_socket_length(root: Path, uuid: str) -> None:
    path = os.fsencode(privileged_socket(root, uuid))
    if len(path) > MAX_SOCKET_PATH:
        raise LayoutError(
            f"MPS socket path {os.fsdecode(path)!r} is {len(path)} bytes, over the "
            f"{MAX_SOCKET_PATH}-byte unix socket limit; choose a shorter --mps-root"
        )


def check_root(root: Path) -> None:
    """Refuse a root that is itself a symlink or world-writable (lstat, not its parents)."""
    try:
        fsutil.check_root(root)
    except FileNotFoundError:
        return
    except fsutil.UnsafePathError as exc:
        raise LayoutError(f"MPS root: {exc}") from None


def prepare(root: Path, uuid: str) -> None:
    """Create root, pipe, shm and log dirs with explicit modes after the safety checks."""
    check_uuid(uuid)
    check_root(root)
    check_socket_length(root, uuid)
    for path in (root, gpu_dir(root, uuid), pipe_dir(root, uuid), log_dir(root, uuid)):
        _mkdir(path)
    _mkdir(shm_dir(root, uuid), SHM_MODE)


def _mkdir(path: Path, mode: int = DIR_MODE) -> None:
    try:
        path.mkdir(mode=mode)
    except FileExistsError:
        if path.is_symlink() or not path.is_dir():
            raise LayoutError(f"{path} exists and is not a plain directory") from None
        return
    path.chmod(mode)  # mkdir's mode is filtered by the umask


def clean_pipe_dir(root: Path, uuid: str) -> list[str]:
    """Remove a dead daemon's pid file and sockets; returns the names removed.

    Whatever sits at those names goes, a directory planted there included (rmtree does not
    follow links), so nothing a client left there can keep a fresh daemon from starting."""
    removed = []
    for name in PIPE_FILES:
        path = pipe_dir(root, uuid) / name
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            continue
        removed.append(name)
    return removed


def read_pid(root: Path, uuid: str) -> int | None:
    """The daemon's pid from its pid file, or None. The file is in the pipe dir, which
    clients reach: it is read as untrusted (a regular file of our own UID, as the daemon we
    launched writes it, at most PID_FILE_MAX bytes, no link followed, no FIFO waited on)."""
    try:
        data = fsutil.read_bounded(pid_file(root, uuid), PID_FILE_MAX, owner=os.geteuid())
    except OSError:
        return None
    text = data.decode("ascii", errors="replace").strip()
    return int(text) if text.isdigit() else None


@dataclass(frozen=True)
class MpsSettings:
    """What a daemon was started with; differing settings mean a restart (without clients)."""

    pinned_limit_mib: int
    active_thread_percentage: int
    protocol_version: int
    multiuser: bool


@dataclass(frozen=True)
class DaemonMarker:
    pid: int
    settings: MpsSettings
    compute_mode_set: bool  # we changed the compute mode; `mps stop` restores DEFAULT
    started_at: float


def write_marker(root: Path, uuid: str, marker: DaemonMarker) -> None:
    path = marker_path(root, uuid)
    tmp = path.with_name(MARKER + ".tmp")
    data = json.dumps(asdict(marker), indent=2, sort_keys=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_marker(root: Path, uuid: str) -> DaemonMarker | None:
    """The marker, or None when it is missing or unreadable (then nothing is adopted blindly)."""
    try:
        data = json.loads(fsutil.read_bounded(marker_path(root, uuid), MARKER_MAX))
        return DaemonMarker(
            pid=int(data["pid"]),
            settings=MpsSettings(**data["settings"]),
            compute_mode_set=bool(data["compute_mode_set"]),
            started_at=float(data["started_at"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remove_marker(root: Path, uuid: str) -> None:
    marker_path(root, uuid).unlink(missing_ok=True)


def known_gpus(root: Path) -> list[GpuUuid]:
    """GPU directories under the root (for `mps stop --all`)."""
    if not root.is_dir():
        return []
    found = []
    for entry in sorted(root.iterdir()):
        if entry.is_dir() and not entry.is_symlink() and _UUID_RE.match(entry.name):
            found.append(GpuUuid(entry.name))
    return found
