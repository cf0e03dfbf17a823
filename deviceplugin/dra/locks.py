"""The locks prepare and unprepare take: per key in one process, and per node across processes.

`KeyedLocks` serialises work per claim and per GPU (DESIGN section 10): a claim waiting up to
10 s for its GPU's MPS daemon holds that GPU only, so another tenant's claim on another GPU
goes on. `InstanceLock` serialises the plugin instances of one node during a rolling update
(two pods of the DaemonSet, one checkpoint): a `flock` on `serialize.lock` in the plugin's
directory, as the upstream helper's `RollingUpdate` does (kubeletplugin `draplugin.go`,
`serializeGRPCIfEnabled`), held while any call of this process is in flight, so calls of
one instance still overlap each other. Taking it fresh runs `on_acquired` (the other
instance may have changed the checkpoint); giving it up runs `before_release`.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from deviceplugin.plumbing import fsutil

LOCK_FILE = "serialize.lock"


class KeyedLocks:
    """One lock per key, made on first use and dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, list[int]]] = {}

    @contextmanager
    def hold(self, keys: Iterable[str]) -> Iterator[None]:
        """All of `keys`, taken in sorted order, so two holders never wait on each other;
        nested holds must follow one order everywhere (the Preparer: a claim, then GPUs)."""
        ordered = sorted(set(keys))
        taken: list[threading.Lock] = []
        try:
            for key in ordered:
                with self._guard:
                    lock, users = self._locks.setdefault(key, (threading.Lock(), [0]))
                    users[0] += 1
                try:
                    lock.acquire()
                except BaseException:
                    self._forget(key)
                    raise
                taken.append(lock)
            yield
        finally:
            for lock in reversed(taken):
                lock.release()
            for key in ordered[: len(taken)]:
                self._forget(key)

    def _forget(self, key: str) -> None:
        with self._guard:
            users = self._locks[key][1]
            users[0] -= 1
            if users[0] == 0:
                del self._locks[key]

    def held(self) -> int:
        """Keys held or waited for (for tests)."""
        with self._guard:
            return len(self._locks)


class InstanceLock:
    """The node-wide lock of this instance's in-flight calls; a no-op without a path."""

    def __init__(
        self,
        path: Path | None,
        on_acquired: Callable[[], None] = lambda: None,
        before_release: Callable[[], None] = lambda: None,
    ) -> None:
        self.path = path
        self._on_acquired = on_acquired
        self._before_release = before_release
        self._cond = threading.Condition()
        self._users = 0
        self._state = "idle"  # idle | acquiring | held | releasing
        self._fd: int | None = None
        self.acquisitions = 0  # flocks taken (for tests)

    @contextmanager
    def held(self) -> Iterator[None]:
        if self.path is None:
            yield
            return
        self._acquire()
        try:
            yield
        finally:
            self._release()

    def _acquire(self) -> None:
        assert self.path is not None
        with self._cond:
            while self._state in ("acquiring", "releasing"):
                self._cond.wait()
            self._users += 1
            if self._state == "held":
                return
            self._state = "acquiring"
        fd: int | None = None
        try:
            fsutil.ensure_dir(self.path.parent, 0o750)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)  # blocks while another instance has a call in flight
            self._on_acquired()
        except BaseException:
            if fd is not None:
                os.close(fd)
            with self._cond:
                self._users -= 1
                self._state = "idle"
                self._cond.notify_all()
            raise
        with self._cond:
            self._fd = fd
            self._state = "held"
            self.acquisitions += 1
            self._cond.notify_all()

    def _release(self) -> None:
        with self._cond:
            self._users -= 1
            if self._users > 0:
                return
            self._state = "releasing"
        try:
            self._before_release()
        finally:
            with self._cond:
                fd, self._fd = self._fd, None
                if fd is not None:
                    os.close(fd)  # drops the flock
                self._state = "idle"
                self._cond.notify_all()
