"""Which UIDs a legacy MPS daemon serves, read from its `control.log`.

A legacy daemon runs one server for one UID at a time; a client of another UID waits until
every current client exits (reference/nvml-mps-xid.md 3.1). The daemon reports no queue over
its commands, so the log lines (`Starting new server <pid> for user <uid>`, `NEW CLIENT <pid>
from user <uid>`, `Server <pid> exited`) are the only witness; `TenantWatch` follows them.
"""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path

_NEW_SERVER = re.compile(r"Starting new server (\d+) for user (\d+)")
_SERVER_EXIT = re.compile(r"Server (\d+) exited")
_NEW_CLIENT = re.compile(r"NEW CLIENT (\d+) from user (\d+)")
_DAEMON_START = "Starting control daemon"


class TenantMode(StrEnum):
    MULTI_USER = "multi-user"  # `-multiuser-server`: every UID shares one server
    SINGLE_UID = "single-uid"  # one UID per GPU; a second UID is reported, never left hanging


class TenantWatch:
    """Follows one daemon's control.log; `waiting_uids()` names UIDs queued behind another."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._servers: dict[int, int] = {}  # server pid → uid
        self._waiting: dict[int, int] = {}  # client pid → uid

    def poll(self) -> None:
        try:
            with self.path.open("rb") as f:
                f.seek(0, 2)
                if f.tell() < self._offset:  # truncated or replaced: replay from the start
                    self._reset()
                    self._offset = 0
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # only whole lines; a partial one is read next time
        self._offset += end
        for line in data[:end].decode(errors="replace").splitlines():
            self.feed(line)

    def rewound(self) -> None:
        """The log was truncated in place after a poll: read from its start, keep the state."""
        self._offset = 0

    def feed(self, line: str) -> None:
        if _DAEMON_START in line:
            self._reset()
        elif match := _NEW_SERVER.search(line):
            uid = int(match.group(2))
            self._servers[int(match.group(1))] = uid
            self._waiting = {c: u for c, u in self._waiting.items() if u != uid}
        elif match := _SERVER_EXIT.search(line):
            self._servers.pop(int(match.group(1)), None)
        elif match := _NEW_CLIENT.search(line):
            uid = int(match.group(2))
            if self._servers and uid not in self._servers.values():
                self._waiting[int(match.group(1))] = uid

    def server_uids(self) -> set[int]:
        return set(self._servers.values())

    def waiting_uids(self) -> set[int]:
        return set(self._waiting.values())

    def _reset(self) -> None:
        self._servers.clear()
        self._waiting.clear()
