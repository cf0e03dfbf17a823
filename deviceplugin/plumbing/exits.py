"""ExitWatch: a process's exit seen at once, through a pidfd, without polling.

`open(pid)` takes a pidfd (Linux 5.3+, `pidfd_open(2)`) for a process the caller has just
confirmed is the one it means, so a later reuse of the pid cannot fool the watch; `watch`
hands it to one thread that waits on every watched pidfd with epoll and calls the process's
callback when it exits (a pidfd becomes readable when its process terminates, reaped or not,
child or not). Where the kernel has no pidfd_open (ENOSYS) `open` says so once in the log and
returns None: the caller keeps its polling probes alone.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import threading
from collections.abc import Callable

from deviceplugin.plumbing import logs

_log = logs.get("exits")


class PidFd:
    """One process's pidfd, or (fd None) a process already gone when it was opened."""

    def __init__(self, pid: int, fd: int | None) -> None:
        self.pid = pid
        self._fd = fd
        self._lock = threading.Lock()

    @property
    def fd(self) -> int | None:
        return self._fd

    @property
    def gone(self) -> bool:
        """It had exited before its pidfd could be opened."""
        return self._fd is None

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class ExitWatch:
    """One thread, one epoll set, any number of watched processes; thread-safe."""

    def __init__(self, name: str = "exit-watch") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._callbacks: dict[int, tuple[PidFd, Callable[[], None]]] = {}  # by fd
        self._epoll: select.epoll | None = None
        self._wake_r = self._wake_w = -1
        self._thread: threading.Thread | None = None
        self._unavailable_logged = False
        self.available: bool | None = None  # None until the first open; False: ENOSYS

    def open(self, pid: int) -> PidFd | None:
        """A pidfd for `pid` (gone=True when it has already exited); None where the kernel
        has none (logged once)."""
        pidfd_open = getattr(os, "pidfd_open", None)
        try:
            if pidfd_open is None:
                raise OSError(errno.ENOSYS, "os.pidfd_open missing")
            fd = pidfd_open(pid)
        except ProcessLookupError:
            return PidFd(pid, None)
        except OSError as exc:
            # ENOSYS: a kernel before 5.3; EPERM: a seccomp profile that refuses it.
            if exc.errno in (errno.ENOSYS, errno.EPERM):
                self.available = False
            if not self._unavailable_logged:
                self._unavailable_logged = True
                logs.log(
                    _log,
                    "process exit watch unavailable: exits are seen by the probes only",
                    level=logging.WARNING,
                    pid=pid,
                    error=str(exc),
                )
            return None
        self.available = True
        return PidFd(pid, fd)

    def watch(self, pidfd: PidFd, on_exit: Callable[[], None]) -> Callable[[], None]:
        """Call `on_exit` (on the watch's thread) once the process exits; returns a cancel
        that closes the pidfd. A process gone before it was opened is reported here."""
        fd = pidfd.fd
        if fd is None:
            on_exit()
            return pidfd.close
        with self._lock:
            epoll = self._ensure_thread()
            self._callbacks[fd] = (pidfd, on_exit)
            epoll.register(fd, select.EPOLLIN)

        def cancel() -> None:
            with self._lock:
                entry = self._callbacks.get(fd)
                if entry is not None and entry[0] is pidfd:
                    del self._callbacks[fd]
                    if self._epoll is not None:
                        with contextlib.suppress(OSError):
                            self._epoll.unregister(fd)
            pidfd.close()

        return cancel

    def watched(self) -> int:
        with self._lock:
            return len(self._callbacks)

    def close(self) -> None:
        """Stop the thread and close every pidfd still watched (no callback runs)."""
        with self._lock:
            thread, self._thread, self._epoll = self._thread, None, None
            entries = list(self._callbacks.values())
            self._callbacks.clear()
            if thread is not None:
                os.write(self._wake_w, b"x")
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        for pidfd, _ in entries:
            pidfd.close()

    def _ensure_thread(self) -> select.epoll:
        """Under the lock: the epoll set and its thread, started on first use."""
        if self._thread is None:
            epoll = select.epoll()
            wake_r, wake_w = os.pipe()
            epoll.register(wake_r, select.EPOLLIN)
            self._epoll, self._wake_r, self._wake_w = epoll, wake_r, wake_w
            self._thread = threading.Thread(
                target=self._run, args=(epoll, wake_r, wake_w), name=self._name, daemon=True
            )
            self._thread.start()
        assert self._epoll is not None
        return self._epoll

    def _run(self, epoll: select.epoll, wake_r: int, wake_w: int) -> None:
        try:
            while True:
                try:
                    ready = epoll.poll()
                except InterruptedError:
                    continue
                for fd, _ in ready:
                    if fd == wake_r:
                        return
                    with self._lock:
                        entry = self._callbacks.pop(fd, None)
                        if entry is not None:
                            with contextlib.suppress(OSError):
                                epoll.unregister(fd)
                    if entry is None:
                        continue  # cancelled meanwhile
                    pidfd, on_exit = entry
                    pidfd.close()
                    try:
                        on_exit()
                    except Exception as exc:  # one callback's failure must not end the watch
                        logs.log(_log, "exit callback failed", level=logging.ERROR,
                                 pid=pidfd.pid, error=repr(exc))  # fmt: skip
        finally:
            epoll.close()
            os.close(wake_r)
            os.close(wake_w)
