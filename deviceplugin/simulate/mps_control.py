"""A fake `nvidia-cuda-mps-control` that speaks the real command protocol.

Run as `python -m deviceplugin.simulate.mps_control` (or through `write_launcher`), it behaves
like the real binary (reference/nvml-mps-xid.md section 3): `-d` daemonizes and serves the
pipe dir's `control` socket; without `-d` it forwards stdin to that daemon. Servers are kept
per UID as the legacy daemon keeps them. Like the real daemon it needs its clients to share
its pipe directory (same path string) and its `/dev/shm`: it publishes a marker file in its
own `/dev/shm` that `simulate/mps_client.py` must find. Every control session and client is
logged as the real daemon logs them, so log growth can be measured. With `-p 3` it keeps
per-client memory accounting (unless started refusing it, `write_launcher(refuse=...)`).
Test-only commands (`simulate_*`) add fake clients, inject or clear a server FAULT, and
force a status line; `inject_fault`/`recover`/`connect_client` wrap them.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import select
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from deviceplugin.process import pid_alive

PID_FILE = "nvidia-cuda-mps-control.pid"
CONTROL = "control"
PRIVILEGED = "control_privileged"
LOG_NAME = "control.log"
SERVER_LOG = "server.log"
SHM = Path("/dev/shm")
SHM_PREFIX = "gpu-fraction-sim-mps."
REFUSE_MEMACCT_ENV = "SIM_MPS_REFUSE_MEMORY_ACCOUNTING"
UNRECOGNIZED = "Unrecognized command"
ALREADY_RUNNING = "An instance of this daemon is already running"
NOT_FOUND = "Cannot find MPS control daemon process"
_MEM_RE = re.compile(r"^(\d+)([GM])$")


@dataclass
class _Server:
    pid: int
    uid: int
    pinned: dict[str, int]  # device → MiB, copied from the defaults at creation
    active_thread_percentage: float
    state: str = "ACTIVE"
    clients: set[int] = field(default_factory=set)


@dataclass
class _Daemon:
    pipe: Path
    log_path: Path
    multiuser: bool
    pid: int = field(default_factory=os.getpid)
    pinned_defaults: dict[str, int] = field(default_factory=dict)
    atp_default: float = 100.0
    servers: list[_Server] = field(default_factory=list)
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

    def _new_server(self, uid: int) -> _Server:
        self.next_server_pid += 1
        server = _Server(
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

    def _server_for(self, uid: int) -> _Server | None:
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

    def _shutdown(self, server: _Server) -> None:
        self.servers.remove(server)
        self.log(f"Server {server.pid} exited with status 0")

    def find(self, pid_text: str) -> _Server | None:
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


def _dirs() -> tuple[Path, Path]:
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    logs = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))
    return pipe, logs


def _running(pipe: Path) -> bool:
    try:
        pid = int((pipe / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return False
    if not pid_alive(pid):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(pipe / CONTROL))
        except OSError:
            return False
    return True


def _daemonize(pipe: Path, logs: Path, multiuser: bool, protocol: int = 2) -> int:
    if _running(pipe):
        print(ALREADY_RUNNING)
        return 1
    read_end, write_end = os.pipe()
    if os.fork() > 0:
        os.close(write_end)
        status = b""
        ready, _, _ = select.select([read_end], [], [], 10.0)
        if ready:
            status = os.read(read_end, 4096)
        if status == b"ok":
            return 0
        print(status.decode() or "MPS control daemon failed to start")
        return 1
    os.close(read_end)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    try:
        listener = _bind(pipe)
    except OSError as exc:
        os.write(write_end, f"Failed to start control daemon: {exc}".encode())
        os._exit(1)
    daemon = _Daemon(
        pipe=pipe,
        log_path=logs / LOG_NAME,
        multiuser=multiuser,
        protocol=protocol,
        refuse_memacct=os.environ.get(REFUSE_MEMACCT_ENV) == "1",
    )
    try:
        # The segments clients map: in whatever /dev/shm this process sees.
        daemon.shm_marker.write_text(daemon.token)
    except OSError as exc:
        os.write(write_end, f"Failed to start control daemon: {exc}".encode())
        os._exit(1)
    (pipe / PID_FILE).write_text(f"{daemon.pid}\n")
    daemon.log(f"Starting control daemon using socket {pipe / CONTROL}")
    daemon.log(
        f"To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY={pipe}"
    )
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.write(write_end, b"ok")
    os.close(write_end)
    _serve(daemon, listener)
    os._exit(0)


def _bind(pipe: Path) -> socket.socket:
    for name in (CONTROL, PRIVILEGED, "control_lock"):
        with contextlib.suppress(FileNotFoundError):
            (pipe / name).unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(pipe / CONTROL))
    privileged = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    privileged.bind(str(pipe / PRIVILEGED))  # bound for the path-length check, never served
    (pipe / "control_lock").touch()
    listener.listen(16)
    return listener


def _serve(daemon: _Daemon, listener: socket.socket) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while not daemon.quitting:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(5.0)
                daemon.log("Accepting connection...")
                daemon.log("NEW UI")
                try:
                    text = _recv_all(conn).decode(errors="replace")
                    out = "".join(daemon.run(line.strip()) for line in text.split("\n"))
                    conn.sendall(out.encode())
                except OSError:
                    daemon.log("Unable to read new connection type information")
                daemon.log("UI closed")
    finally:
        for path in [daemon.pipe / n for n in (CONTROL, PRIVILEGED, "control_lock", PID_FILE)]:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        with contextlib.suppress(OSError):
            daemon.shm_marker.unlink()


def _recv_all(conn: socket.socket) -> bytes:
    chunks = []
    while chunk := conn.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def send(pipe_dir: Path, text: str, timeout: float = 5.0) -> str:
    """Send commands to the daemon of `pipe_dir` and return its answer (raises OSError)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(pipe_dir / CONTROL))
        s.sendall(text.encode())
        s.shutdown(socket.SHUT_WR)
        return _recv_all(s).decode()


def inject_fault(pipe_dir: Path) -> None:
    """Put the daemon's servers in FAULT (one is started if none runs) until `recover`."""
    send(pipe_dir, "simulate_fault")


def recover(pipe_dir: Path) -> None:
    send(pipe_dir, "simulate_recover")


def force_server_status(pipe_dir: Path, text: str | None) -> None:
    """Every `get_server_status` of a listed server answers `text` (None: the real state)."""
    send(pipe_dir, f"simulate_server_status {text or ''}".rstrip())


def connect_client(pipe_dir: Path, pid: int, uid: int) -> str:
    """Register a fake client; returns "" or "807" when the server is in FAULT."""
    return send(pipe_dir, f"simulate_client_connect {pid} {uid}").strip()


def disconnect_client(pipe_dir: Path, pid: int) -> None:
    send(pipe_dir, f"simulate_client_exit {pid}")


def write_launcher(path: Path, *, refuse_memory_accounting: bool = False) -> Path:
    """Write an executable script that runs this fake exactly like the real binary; with
    `refuse_memory_accounting` its protocol-3 daemons cannot turn accounting on."""
    setting = (
        f"import os\nos.environ[{REFUSE_MEMACCT_ENV!r}] = '1'\n" if refuse_memory_accounting else ""
    )
    path.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"{setting}"
        "from deviceplugin.simulate.mps_control import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    path.chmod(0o755)
    return path


def main(argv: list[str]) -> int:
    pipe, logs = _dirs()
    if "-d" in argv:
        protocol = 3 if "-p" in argv and argv[argv.index("-p") + 1 :][:1] == ["3"] else 2
        return _daemonize(pipe, logs, multiuser="-multiuser-server" in argv, protocol=protocol)
    if argv:
        print(f"Unknown option {argv[0]}")
        return 1
    text = sys.stdin.read()
    try:
        sys.stdout.write(send(pipe, text, timeout=30.0))
    except OSError:
        print(NOT_FOUND)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
