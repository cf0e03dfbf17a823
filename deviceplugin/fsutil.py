"""Small, careful filesystem helpers for files other processes read while we write them.

`atomic_write` (temp file in the same directory, fsync, rename, fsync of the directory) so a
reader never sees half a CDI spec or ledger; `ensure_dir` creates directories with explicit
modes and refuses a root that is a symlink or world-writable (someone else could plant files).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path


class UnsafePathError(OSError):
    """A directory we would write into is a symlink or writable by anyone."""


def check_root(root: Path) -> None:
    """Refuse `root` when it is itself a symlink, not a directory, or world-writable."""
    st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(f"{root} is a symlink; refusing to write under it")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{root} is not a directory")
    # World-writable lets anyone plant files and links where we write, sticky bit or not
    # (the sticky bit stops deleting others' files, not creating new ones).
    if st.st_mode & stat.S_IWOTH:
        raise UnsafePathError(f"{root} is world-writable; refusing to write under it")


def ensure_dir(path: Path, mode: int = 0o755) -> Path:
    """Create `path` (and parents) with `mode` despite the umask, then check it as a root."""
    missing: list[Path] = []
    parent = path
    while not os.path.lexists(parent):
        missing.append(parent)
        parent = parent.parent
    # Each directory we create gets `mode` explicitly: mkdir(parents=True) would leave the
    # intermediate ones at the umask's mercy (world-writable under umask 0).
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            directory.mkdir()
            os.chmod(directory, mode)
    check_root(path)
    return path


def atomic_write(path: Path, data: bytes, mode: int = 0o644, durable: bool = True) -> None:
    """Replace `path` with `data` so readers see the old file or the new one, never a mix.

    `durable=False` skips the fsyncs: the rename is still atomic and survives a crash of this
    process (the kernel keeps the data), only not a power loss. The allocation path uses it
    because its files live on tmpfs or matter only while the node's pods run.
    """
    directory = path.parent
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    if durable:
        fsync_path(directory)  # the rename itself


def remove(path: Path) -> bool:
    """Delete `path` if present; True when something was removed."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path; one that is gone (or refuses) is skipped: what
    replaced it is synced by its own writer."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)
