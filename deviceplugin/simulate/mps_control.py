"""A fake `nvidia-cuda-mps-control` that speaks the real command protocol.

Run as `python -m deviceplugin.simulate.mps_control` (or through `write_launcher`), it behaves
like the real binary (reference/nvml-mps-xid.md section 3): `-d` daemonizes and serves the
pipe dir's `control` socket; without `-d` it forwards stdin to that daemon, whose state and
command protocol live in mps_daemon.py. Like the real daemon it needs its clients to share
its pipe directory (same path string) and its `/dev/shm`: it publishes a marker file in its
own `/dev/shm` that `simulate/mps_client.py` must find. With `-p 3` it keeps per-client
memory accounting (unless started refusing it, `write_launcher(refuse=...)`). Test-only
commands (`simulate_*`) add fake clients, inject or clear a server FAULT, and force a status
line; `inject_fault`/`recover`/`connect_client` wrap them.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
from pathlib import Path

from deviceplugin.plumbing.process import pid_alive
from deviceplugin.simulate.mps_daemon import LOG_NAME, Daemon

PID_FILE = "nvidia-cuda-mps-control.pid"
CONTROL = "control"
PRIVILEGED = "control_privileged"
REFUSE_MEMACCT_ENV = "SIM_MPS_REFUSE_MEMORY_ACCOUNTING"
ALREADY_RUNNING = "An instance of this daemon is already running"
NOT_FOUND = "Cannot find MPS control daemon process"


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
    daemon = Daemon(
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


def _serve(daemon: Daemon, listener: socket.socket) -> None:
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
