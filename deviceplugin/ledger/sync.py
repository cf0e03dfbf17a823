"""The ledger's sync thread: its files made durable (fsync) moments after each change.

`Syncer` gathers changes for `SYNC_GATHER` and fsyncs only the files and directories they
touched, off the Allocate reply path; before each sync it runs the `Ledger`'s fold (store.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from deviceplugin.plumbing import fsutil, logs
from deviceplugin.plumbing.afterreply import after_reply

# The ledger syncer gathers changes this long before one fsync (s).
SYNC_GATHER = 0.02

_log = logs.get("ledger")


class Syncer:
    """Makes the ledger's files durable soon after each change, off the Allocate reply path.

    The kubelet fsyncs its own checkpoint of an Allocate answer moments after the reply and
    replays it after a reboot without asking again, so a record lost to a power loss would
    leave that container without its CDI spec: the window between our write and our fsync
    is kept to `SYNC_GATHER` and this thread's wake-up (tens of milliseconds), not the
    kernel's writeback (seconds).
    """

    def __init__(self, fold: Callable[[], None] = lambda: None) -> None:
        self._fold = fold
        self._wake = threading.Condition()
        self._changes = 0  # changes made / made durable
        self._synced = 0
        self._dirty: set[Path] = set()  # files and directories changed since the last sync
        self._thread: threading.Thread | None = None

    def poke(self, *changed: Path) -> None:
        """A change to `changed` (a file written, or a directory whose entries changed)."""
        with self._wake:
            self._changes += 1
            self._dirty.update(changed)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ledger-sync", daemon=True)
                self._thread.start()
        # Woken inside an Allocate, this thread would take the GIL from the reply; it sleeps
        # SYNC_GATHER before its fsync anyway.
        after_reply(self._notify)

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify_all()

    def wait(self, timeout: float = 5.0) -> bool:
        """Until every change made so far is durable (tests, and shutdown)."""
        with self._wake:
            target = self._changes
            self._wake.notify_all()  # a poke's wake may still wait for its reply to leave
            return self._wake.wait_for(lambda: self._synced >= target, timeout)

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._changes > self._synced)
            # A burst of Allocates (a pod's containers, a node's pods after a restart) shares
            # one fsync, and an append seldom waits on the file's fsync in flight.
            time.sleep(SYNC_GATHER)
            try:
                self._fold()  # a grown journal into the snapshot, here and not in an Allocate
            except OSError as exc:
                logs.log(_log, "ledger not compacted", level=logging.WARNING, error=str(exc))
            with self._wake:
                target = self._changes
                dirty, self._dirty = self._dirty, set()
            # Only what changed: each sync is a GIL hand-off, and this thread's hand-offs
            # land in the middle of replies (an append only dirties the journal).
            for path in dirty:
                fsutil.fsync_path(path)
            with self._wake:
                self._synced = target
                self._wake.notify_all()
