"""Running `nvidia-cuda-mps-control` for one GPU, with timeouts, and parsing its answers.

Always an argument list, never a shell. The daemon is started through a `Launcher` (launch.py):
directly in its own session, so killing the plugin's process group leaves it running, or as a
host systemd unit. Output formats follow reference/nvml-mps-xid.md section 3.2 (`25.0`,
`3G`/`4096M`, one PID per line, `ps`).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from deviceplugin.model import GpuUuid
from deviceplugin.mps import layout
from deviceplugin.mps.launch import DirectLauncher, Launcher, LaunchError

NOT_FOUND = "Cannot find MPS control daemon process"
ALREADY_RUNNING = "An instance of this daemon is already running"
# The daemon sees only its own GPU (CUDA_VISIBLE_DEVICES=<uuid>), as ordinal 0; NVIDIA's
# plugin found limits set by UUID were not applied (reference nvidia-k8s-device-plugin 2).
DEVICE = "0"
_MEM_RE = re.compile(r"^(\d+)\s*([GM])$")
# Per-client memory accounting of a protocol-3 daemon (the kai mpsd's `memacct`); the r615
# spelling is not verified on hardware, so only an exact `on` readback counts as proof.
SET_MEMACCT = "set_memory_accounting"
GET_MEMACCT = "get_memory_accounting"


class ControlError(Exception):
    """A control command failed; the message names the GPU and the command."""


class ControlTimeout(ControlError):
    """The control binary did not answer in time: the daemon may be wedged."""


class DaemonNotFound(ControlError):
    """No daemon serves the pipe dir."""


class AlreadyRunning(ControlError):
    pass


class ServerState(StrEnum):
    INITIALIZING = "INITIALIZING"
    ACTIVE = "ACTIVE"
    FAULT = "FAULT"
    UNKNOWN = "UNKNOWN"


@dataclass(frozen=True)
class PsRow:
    pid: int
    id: int
    server: int
    device: str
    namespace: str
    command: str


def parse_mem_limit(text: str) -> int | None:
    """`3G` → 3072, `4096M` → 4096 (MiB); empty output (no limit) → None."""
    text = text.strip()
    if not text:
        return None
    match = _MEM_RE.match(text)
    if match is None:
        raise ValueError(f"unexpected pinned memory limit {text!r}")
    n = int(match.group(1))
    return n * 1024 if match.group(2) == "G" else n


def mem_limit_matches(readback_mib: int | None, wanted_mib: int) -> bool:
    """Some drivers print limits >= 1 GiB as whole `G` (floor), so compare at that precision."""
    if readback_mib is None:
        return False
    if readback_mib == wanted_mib:
        return True
    return (
        wanted_mib >= 1024
        and readback_mib % 1024 == 0
        and readback_mib == wanted_mib // 1024 * 1024
    )


def parse_percentage(text: str) -> float:
    return float(text.strip())


def parse_pids(text: str) -> list[int]:
    return [int(line) for line in text.split() if line.strip()]


def parse_server_status(text: str) -> ServerState:
    """Exactly one known word; anything else (an error line, a new format) is UNKNOWN."""
    try:
        return ServerState(text.strip())
    except ValueError:
        return ServerState.UNKNOWN


@dataclass(frozen=True)
class Probe:
    """One probe's answer: the servers listed, and the states of those asked about."""

    servers: list[int]
    states: dict[int, ServerState]
    raw: dict[int, str]  # the status line of each server asked about, verbatim


def parse_probe(text: str, asked: list[int]) -> Probe:
    """`get_server_list` then one `get_server_status` per PID in `asked`, in one answer.

    The list comes first as digit-only lines; each remaining line answers one status query.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    n = 0
    while n < len(lines) and lines[n].strip().isdigit():
        n += 1
    servers = [int(line) for line in lines[:n]]
    rest = lines[n:]
    states: dict[int, ServerState] = {}
    raw: dict[int, str] = {}
    for i, pid in enumerate(asked):
        line = rest[i] if i < len(rest) else ""
        raw[pid] = line
        states[pid] = parse_server_status(line)
    return Probe(servers, states, raw)


def parse_ps(text: str) -> list[PsRow]:
    rows = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5 or not parts[0].isdigit():
            continue  # the header, or noise
        rows.append(
            PsRow(
                pid=int(parts[0]),
                id=int(parts[1]),
                server=int(parts[2]),
                device=parts[3],
                namespace=parts[4],
                command=parts[5] if len(parts) > 5 else "",
            )
        )
    return rows


def _accounting_on(out: str) -> bool:
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    return bool(lines) and lines[-1] == "on"


class MpsControl:
    """The control binary bound to one GPU's pipe and log directories."""

    def __init__(
        self,
        binary: str,
        root: Path,
        uuid: GpuUuid,
        base_env: Mapping[str, str] | None = None,
    ) -> None:
        self.binary = binary
        self.uuid = uuid
        self.pipe_dir = layout.pipe_dir(root, uuid)
        self.log_dir = layout.log_dir(root, uuid)
        self._base_env = dict(os.environ if base_env is None else base_env)

    def mps_env(self) -> dict[str, str]:
        """The variables that bind the daemon (and its clients) to this GPU's directories."""
        return {
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
            "CUDA_VISIBLE_DEVICES": self.uuid,
        }

    def env(self) -> dict[str, str]:
        return {**self._base_env, **self.mps_env()}

    def start(
        self,
        *,
        protocol_version: int = 2,
        multiuser: bool = False,
        timeout: float,
        launcher: Launcher | None = None,
        shm: Path | None = None,
    ) -> None:
        """`-d` (plus `-p 3`, `-multiuser-server`) through `launcher` (default: direct, in a new
        session), with `shm` as its /dev/shm when given; returns once the daemon forked."""
        launcher = launcher or DirectLauncher()
        args = ["-d"]
        if protocol_version == 3:
            args += ["-p", "3"]
        if multiuser:
            args.append("-multiuser-server")
        try:
            launch = launcher.launch(
                self.binary, args, self.mps_env(), self._base_env, self.uuid, shm
            )
        except LaunchError as exc:
            raise ControlError(str(exc)) from exc
        argv = list(launch.argv)
        # Output goes to a file, not a pipe: a daemon that keeps the pipe open would hang us.
        with tempfile.TemporaryFile() as out:
            try:
                proc = subprocess.Popen(
                    argv,
                    env=launch.env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as exc:
                raise ControlError(
                    f"gpu={self.uuid} cannot run {argv[0]}: {exc} {launcher.hint()}".rstrip()
                ) from exc
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise ControlTimeout(f"gpu={self.uuid} '{' '.join(argv)}' timed out") from None
            out.seek(0)
            text = out.read().decode(errors="replace").strip()
        if rc != 0:
            if ALREADY_RUNNING in text:
                raise AlreadyRunning(f"gpu={self.uuid} {ALREADY_RUNNING}")
            raise ControlError(
                f"gpu={self.uuid} '{' '.join(argv)}' exited {rc}: {text} {launcher.hint()}".rstrip()
            )

    def command(self, text: str, timeout: float) -> str:
        """Feed `text` on stdin (no trailing newline needed) and return stdout."""
        try:
            proc = subprocess.run(
                [self.binary],
                input=text.encode(),
                env=self.env(),
                capture_output=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise ControlTimeout(f"gpu={self.uuid} command {text!r} timed out") from None
        except OSError as exc:
            raise ControlError(f"gpu={self.uuid} cannot run {self.binary}: {exc}") from exc
        out = proc.stdout.decode(errors="replace")
        if proc.returncode != 0:
            if NOT_FOUND in out:
                raise DaemonNotFound(f"gpu={self.uuid} {NOT_FOUND}")
            err = (out + proc.stderr.decode(errors="replace")).strip()
            raise ControlError(f"gpu={self.uuid} command {text!r} exited {proc.returncode}: {err}")
        return out

    # --- typed commands ---

    def server_list(self, timeout: float) -> list[int]:
        return parse_pids(self.command("get_server_list", timeout))

    def server_statuses(self, pids: list[int], timeout: float) -> dict[int, ServerState]:
        if not pids:
            return {}
        out = self.command("\n".join(f"get_server_status {p}" for p in pids), timeout)
        lines = out.splitlines()
        return {
            pid: parse_server_status(lines[i]) if i < len(lines) else ServerState.UNKNOWN
            for i, pid in enumerate(pids)
        }

    def probe(self, known: list[int], timeout: float) -> Probe:
        """One run of the control client: the server list plus the states of `known` servers
        (the previous list; a server new to this list is asked about at the next probe)."""
        text = "\n".join(["get_server_list", *(f"get_server_status {p}" for p in known)])
        return parse_probe(self.command(text, timeout), known)

    def client_count(self, pids: list[int], timeout: float) -> int:
        return sum(len(parse_pids(self.command(f"get_client_list {p}", timeout))) for p in pids)

    def set_defaults(
        self, pinned_limit_mib: int, active_thread_percentage: int, timeout: float
    ) -> str:
        return self.command(
            f"set_default_device_pinned_mem_limit {DEVICE} {pinned_limit_mib}M\n"
            f"set_default_active_thread_percentage {active_thread_percentage}",
            timeout,
        )

    def read_defaults(self, timeout: float) -> tuple[int | None, float]:
        out = self.command(
            f"get_default_device_pinned_mem_limit {DEVICE}\nget_default_active_thread_percentage",
            timeout,
        )
        lines = [line for line in out.splitlines() if line.strip()]
        if len(lines) == 1:  # no pinned limit set: only the percentage came back
            return None, parse_percentage(lines[0])
        if len(lines) != 2:
            raise ControlError(f"gpu={self.uuid} unexpected defaults output {out!r}")
        return parse_mem_limit(lines[0]), parse_percentage(lines[1])

    def enable_memory_accounting(self, timeout: float) -> bool:
        """Protocol 3: turn per-client memory accounting on, then read it back.

        True only when the readback says exactly `on`; an older daemon that does not know
        the commands answers with an error line, which reads as no proof.
        """
        return _accounting_on(self.command(f"{SET_MEMACCT} on\n{GET_MEMACCT}", timeout))

    def memory_accounting(self, timeout: float) -> bool:
        """The readback alone (an adopted daemon)."""
        return _accounting_on(self.command(GET_MEMACCT, timeout))

    def ps(self, timeout: float) -> list[PsRow]:
        return parse_ps(self.command("ps", timeout))

    def quit(self, timeout: float) -> None:
        self.command("quit", timeout)
