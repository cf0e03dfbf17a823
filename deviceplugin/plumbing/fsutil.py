"""Small, careful filesystem helpers for files other processes read while we write them.

`atomic_write` (temp file in the same directory, fsync, rename, fsync of the directory) so a
reader never sees half a CDI spec or ledger; `ensure_dir` creates directories with explicit
modes and refuses a root that is a symlink or world-writable (someone else could plant files);
`read_bounded` reads a small file in a directory someone else may write (the MPS pipe dir).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import stat
from pathlib import Path


class UnsafePathError(OSError):
    """A directory we would write into is a symlink or writable by anyone."""


class UntrustedFileError(OSError):
    """A file we would read is not a small regular file of the expected owner."""


def read_bounded(path: Path, limit: int, owner: int | None = None) -> bytes:
    """At most `limit` bytes of the regular file `path`, else UntrustedFileError (or the
    OSError of the open). For files where someone else could plant a symlink (to /dev/zero),
    a FIFO (a read that never returns) or a huge file: the last component is never followed
    (O_NOFOLLOW), the open never waits (O_NONBLOCK), anything but a regular file of `owner`
    (when given) is refused before a byte is read, and no more than `limit` + 1 bytes are
    ever read."""
    st = os.lstat(path)  # a device node is refused before open() can touch it
    if not stat.S_ISREG(st.st_mode):
        raise UntrustedFileError(f"{path} is not a regular file")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)  # what we opened, not what lstat saw (it may have been swapped)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedFileError(f"{path} is not a regular file")
        if owner is not None and st.st_uid != owner:
            raise UntrustedFileError(f"{path} belongs to uid {st.st_uid}, not {owner}")
        if st.st_size > limit:
            raise UntrustedFileError(f"{path} is {st.st_size} bytes, over {limit}")
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:  # grew after the fstat
        raise UntrustedFileError(f"{path} is over {limit} bytes")
    return data


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
    try:
        check_root(path)  # the common case, on every spec write: one lstat
        return path
    except FileNotFoundError:
        pass
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


def restrict_dir(path: Path, mode: int) -> None:
    """Take group and other bits `mode` lacks off an existing directory we own (lstat: never
    through a link); ensure_dir leaves an existing directory's mode as it found it."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise UnsafePathError(f"{path} is not a directory of ours")
    if stat.S_IMODE(st.st_mode) & ~mode:
        os.chmod(path, stat.S_IMODE(st.st_mode) & mode)


_tmp_serial = itertools.count()


def atomic_write(path: Path, data: bytes, mode: int = 0o644, durable: bool = True) -> None:
    """Replace `path` with `data` so readers see the old file or the new one, never a mix.

    `durable=False` skips the fsyncs: the rename is still atomic and survives a crash of this
    process (the kernel keeps the data), only not a power loss. The allocation path uses it
    because its files live on tmpfs or matter only while the node's pods run. The temp file
    is named for this process and a counter (O_EXCL), not by tempfile's random names and
    buffered file objects: this sits on the Allocate and prepare paths.
    """
    directory = path.parent
    tmp_name = f"{directory}/.{path.name}.{os.getpid()}.{next(_tmp_serial)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        fd = os.open(tmp_name, flags, 0o600)
    except FileExistsError:  # left by a dead process that had our PID (a crash, a reboot)
        os.unlink(tmp_name)
        fd = os.open(tmp_name, flags, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, mode)  # exact, whatever the umask
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
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
