"""The state and command protocol of the fake MPS control daemon (mps_control.py runs it).

One `Daemon` per pipe directory: its servers per UID as the legacy daemon keeps them, their
clients, pinned-memory and thread defaults, the FAULT state, and `run`, which answers one
line of the real command protocol (reference/nvml-mps-xid.md section 3) or a test-only
`simulate_*` command. Every control session and client is logged as the real daemon logs
them, so log growth can be measured.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

LOG_NAME = "control.log"
SERVER_LOG = "server.log"
SHM = Path("/dev/shm")
SHM_PREFIX = "gpu-fraction-sim-mps."
UNRECOGNIZED = "Unrecognized command"
_MEM_RE = re.compile(r"^(\d+)([GM])$")


@dataclass
class Server:
    pid: int
    uid: int
    pinned: dict[str, int]  # device → MiB, copied from the defaults at creation
    active_thread_percentage: float
    state: str = "ACTIVE"
    clients: set[int] = field(default_factory=set)


@dataclass
class Daemon:
    pipe: Path
    log_path: Path
    multiuser: bool
    pid: int = field(default_factory=os.getpid)
    pinned_defaults: dict[str, int] = field(default_factory=dict)
    atp_default: float = 100.0
    servers: list[Server] = field(default_factory=list)
    queued: list[tuple[int, int]] = field(default_factory=list)  # (client pid, uid)
    faulted: bool = False
    next_server_pid: int = 0
    quitting: bool = False
    protocol: int = 2
    refuse_memacct: bool = False
    memacct: bool = False
    forced_status: str | None = None  # simulate_server_status: the line every query gets
    token: str = field(default_factory=lambda: secrets.token_hex(16))

    @property
    def shm_marker(self) -> Path:
        return SHM / f"{SHM_PREFIX}{self.pid}"

    def log(self, msg: str, tag: str = "Control", name: str = LOG_NAME) -> None:
        now = time.time()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
        line = f"[{stamp}.{int(now * 1000) % 1000:03d} {tag} {self.pid}] {msg}\n"
        path = self.log_path.with_name(name)
        # O_APPEND through a fresh open, as the real daemon appends: a truncation in place
        # by the plugin is followed, a rename would not be.
        with contextlib.suppress(OSError), path.open("a", encoding="utf-8") as f:
            f.write(line)

    def server_log(self, msg: str) -> None:
        self.log(msg, tag="Server", name=SERVER_LOG)

    # --- servers and clients (legacy: one active UID at a time unless multi-user) ---

    def _new_server(self, uid: int) -> Server:
        self.next_server_pid += 1
        server = Server(
            pid=self.pid * 100 + self.next_server_pid,
            uid=uid,
            pinned=dict(self.pinned_defaults),
            active_thread_percentage=self.atp_default,
            state="FAULT" if self.faulted else "ACTIVE",
        )
        self.servers.append(server)
        self.log(f"Starting new server {server.pid} for user {uid}")
        self.log(f"NEW SERVER {server.pid}: Ready")
        return server

    def _server_for(self, uid: int) -> Server | None:
        for server in self.servers:
            if self.multiuser or server.uid == uid:
                return server
        return None

    def connect(self, client: int, uid: int) -> str:
        server = self._server_for(uid)
        if server is not None and server.state == "FAULT":
            self.log(f"NEW CLIENT {client} from user {uid}: Server is not ready")
            return "807"  # cudaErrorMpsServerNotReady
        if server is not None:
            self.log(f"NEW CLIENT {client} from user {uid}: Server already exists")
            server.clients.add(client)
            self.server_log(f"New client {client} connected")
            return ""
        if any(s.clients for s in self.servers):
            # Another UID's server still has clients: this client waits (reference 3.1).
            self.log(f"NEW CLIENT {client} from user {uid}: Server busy, waiting")
            self.queued.append((client, uid))
            return ""
        for idle in list(self.servers):
            self._shutdown(idle)
        self.log(f"NEW CLIENT {client} from user {uid}: Starting server")
        self._new_server(uid).clients.add(client)
        self.server_log(f"New client {client} connected")
        return ""

    def disconnect(self, client: int) -> None:
        self.queued = [(c, u) for c, u in self.queued if c != client]
        for server in self.servers:
            if client in server.clients:
                server.clients.discard(client)
                self.server_log(f"Client {client} disconnected")
                if not server.clients and server.state == "FAULT" and not self.faulted:
                    server.state = "ACTIVE"
        if self.queued and not any(s.clients for s in self.servers):
            waiting, self.queued = self.queued, []
            for old in list(self.servers):
                self._shutdown(old)
            for c, u in waiting:
                self.connect(c, u)

    def _shutdown(self, server: Server) -> None:
        self.servers.remove(server)
        self.log(f"Server {server.pid} exited with status 0")

    def find(self, pid_text: str) -> Server | None:
        return next((s for s in self.servers if str(s.pid) == pid_text), None)

    # --- commands ---

    def run(self, line: str) -> str:
        words = line.split()
        if not words:
            return ""
        self.log(f"Cmd:{line}")
        out = self._dispatch(words[0], words[1:])
        if out:
            self.log(out.rstrip("\n"))
        return out

    def _dispatch(self, cmd: str, args: list[str]) -> str:  # noqa: C901 - one branch per command
        if cmd == "get_server_list":
            return "".join(f"{s.pid}\n" for s in self.servers)
        if cmd == "get_server_status" and len(args) == 1:
            server = self.find(args[0])
            if server is not None and self.forced_status is not None:
                return f"{self.forced_status}\n"
            return f"{server.state}\n" if server else f"Server {args[0]} not found\n"
        if cmd == "get_client_list" and len(args) == 1:
            server = self.find(args[0])
            return "".join(f"{c}\n" for c in sorted(server.clients)) if server else ""
        if cmd == "start_server" and len(args) == 2 and args[0] == "-uid":
            if self._server_for(int(args[1])) is None:
                self._new_server(int(args[1]))
            return ""
        if cmd == "shutdown_server" and args:
            server = self.find(args[0])
            if server is not None:
                self._shutdown(server)
            return ""
        if cmd == "quit":
            self.quitting = True
            for server in list(self.servers):
                self._shutdown(server)
            return ""
        if cmd == "set_default_active_thread_percentage" and len(args) == 1:
            self.atp_default = float(args[0])
            return f"{self.atp_default:.1f}\n"
        if cmd == "get_default_active_thread_percentage" and not args:
            return f"{self.atp_default:.1f}\n"
        if cmd == "set_active_thread_percentage" and len(args) == 2:
            server = self.find(args[0])
            if server is None:
                return f"Server {args[0]} not found\n"
            server.active_thread_percentage = float(args[1])
            return f"{server.active_thread_percentage:.1f}\n"
        if cmd == "get_active_thread_percentage" and len(args) == 1:
            server = self.find(args[0])
            return f"{server.active_thread_percentage:.1f}\n" if server else ""
        if cmd == "set_default_device_pinned_mem_limit" and len(args) == 2:
            mib = _parse_mem(args[1])
            if mib is None:
                return f"Invalid memory limit {args[1]}\n"
            self.pinned_defaults[args[0]] = mib
            return ""
        if cmd == "get_default_device_pinned_mem_limit" and len(args) == 1:
            value = self.pinned_defaults.get(args[0])
            return "" if value is None else _format_mem(value) + "\n"
        if cmd == "terminate_client" and len(args) == 2:
            self.disconnect(int(args[1]))
            return "0\n"
        if cmd == "ps":
            return self._ps()
        if cmd in ("set_memory_accounting", "get_memory_accounting") and self.protocol == 3:
            return self._memacct(cmd, args)
        return self._simulate(cmd, args)

    def _memacct(self, cmd: str, args: list[str]) -> str:
        if cmd == "set_memory_accounting" and args in (["on"], ["off"]):
            if self.refuse_memacct and args == ["on"]:
                return "Memory accounting is not supported on this system\n"
            self.memacct = args == ["on"]
            return ""
        if cmd == "get_memory_accounting" and not args:
            return "on\n" if self.memacct else "off\n"
        return f"{UNRECOGNIZED} {cmd}\n"

    def _simulate(self, cmd: str, args: list[str]) -> str:
        if cmd == "simulate_client_connect" and len(args) == 2:
            return self.connect(int(args[0]), int(args[1]))
        if cmd == "simulate_client_exit" and len(args) == 1:
            self.disconnect(int(args[0]))
            return ""
        if cmd == "simulate_fault":
            self.faulted = True
            if not self.servers:
                self._new_server(os.getuid())
            for server in self.servers:
                server.state = "FAULT"
            return ""
        if cmd == "simulate_recover":
            self.faulted = False
            for server in self.servers:
                server.state = "ACTIVE"
            return ""
        if cmd == "simulate_server_status":
            self.forced_status = " ".join(args) if args else None
            return ""
        if cmd == "simulate_client_hello" and not args:
            # What a real client learns over the pipe: the server's own pipe path and the
            # names of its segments in /dev/shm.
            return f"pipe={self.pipe} shm={self.shm_marker.name} token={self.token}\n"
        return f"{UNRECOGNIZED} {cmd}\n"

    def _ps(self) -> str:
        rows = ["PID ID SERVER DEVICE NAMESPACE COMMAND"]
        device = os.environ.get("CUDA_VISIBLE_DEVICES", "GPU-00000000")[:22]
        for server in self.servers:
            for i, client in enumerate(sorted(server.clients)):
                rows.append(f"{client} {i} {server.pid} {device} 4026531836 ./client")
        return "\n".join(rows) + "\n"


def _parse_mem(text: str) -> int | None:
    match = _MEM_RE.match(text)
    if match is None:
        return None
    n = int(match.group(1))
    return n * 1024 if match.group(2) == "G" else n


def _format_mem(mib: int) -> str:
    # Observed on 595.91.07 (reference 3.2, unverified): >= 1 GiB reads back as floor(GiB)G.
    return f"{mib // 1024}G" if mib >= 1024 else f"{mib}M"
