"""The config file's watch: a reload when the file's content changes.

A ConfigMap update swaps a `..data` symlink in the config's directory; an edit writes the file.
The watch asks the kernel only for the events those make and wakes a reload only when the
file's digest differs from the one the running config was read with.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from watchdog.events import (
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer

# Writes (seen when the file is closed), creations, renames and deletions: what a ConfigMap
# update or an edit does. Asked of the kernel, so neither our own reads of the config nor
# writes to other files of its directory (a log beside it) wake the watch's threads.
CONFIG_EVENTS = (FileCreatedEvent, FileClosedEvent, FileMovedEvent, FileDeletedEvent)


def _name(path: str | bytes) -> str:
    return Path(path.decode() if isinstance(path, bytes) else path).name


def config_digest(path: Path | None) -> str:
    """The config file's sha256 ("" without a config file, "unreadable" when it cannot be
    read)."""
    if path is None:
        return ""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return "unreadable"


def watch_config(
    path: Path | None,
    loop: asyncio.AbstractEventLoop,
    running_digest: Callable[[], str],
    reload: Callable[[], None],
) -> Any:
    """Watch the config's directory: a ConfigMap update swaps a `..data` symlink there.

    `reload` runs on `loop` when the file's digest is no longer `running_digest()`; None
    without a config file (nothing to watch), else the started observer (stop it when done).
    """
    if path is None:
        return None
    config_name = path.name

    class Handler(FileSystemEventHandler):
        def on_any_event(self, event: FileSystemEvent) -> None:
            # Only the file itself or a ConfigMap's `..data` link.
            names = {_name(event.src_path), _name(getattr(event, "dest_path", "") or "")}
            if config_name not in names and not any(n.startswith("..") for n in names):
                return
            if config_digest(path) != running_digest():
                loop.call_soon_threadsafe(reload)

    observer = Observer()
    observer.schedule(Handler(), str(path.parent), event_filter=list(CONFIG_EVENTS))
    observer.daemon = True
    observer.start()
    return observer
