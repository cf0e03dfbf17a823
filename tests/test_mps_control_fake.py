"""The simulated nvidia-cuda-mps-control, run as a real binary, and the output parsers."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from deviceplugin.model import GpuUuid
from deviceplugin.mps import layout
from deviceplugin.mps.control import (
    AlreadyRunning,
    DaemonNotFound,
    MpsControl,
    ServerState,
    mem_limit_matches,
    parse_mem_limit,
    parse_pids,
    parse_ps,
    parse_server_status,
)
from deviceplugin.plumbing.process import pid_alive
from deviceplugin.simulate import mps_control as fake

UUID = GpuUuid("GPU-aaaaaaaa-2222-3333-4444-555555555555")
LOG_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} Control \d+\] \S")


@dataclass
class Rig:
    root: Path
    binary: Path
    ctl: MpsControl

    def run(self, stdin: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.binary), *args],
            input=stdin,
            env=self.ctl.env(),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    @property
    def pipe(self) -> Path:
        return layout.pipe_dir(self.root, UUID)


def kill_daemon(root: Path, uuid: str) -> None:
    pid = layout.read_pid(root, uuid)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def rig(short_tmp: Path) -> Iterator[Rig]:
    root = short_tmp / "mps"
    layout.prepare(root, UUID)
    binary = fake.write_launcher(short_tmp / "nvidia-cuda-mps-control")
    try:
        yield Rig(root, binary, MpsControl(str(binary), root, UUID))
    finally:
        kill_daemon(root, UUID)


def test_launcher_is_an_executable_with_this_interpreter(rig: Rig) -> None:
    assert os.access(rig.binary, os.X_OK)
    assert rig.binary.read_text().splitlines()[0].startswith("#!/")


def test_no_daemon_message_and_exit_1(rig: Rig) -> None:
    result = rig.run("get_server_list")
    assert result.returncode == 1
    assert result.stdout.strip() == "Cannot find MPS control daemon process"
    with pytest.raises(DaemonNotFound):
        rig.ctl.server_list(timeout=10)


def test_daemonizes_writes_pid_file_and_refuses_a_second(rig: Rig) -> None:
    first = rig.run("", "-d")
    assert first.returncode == 0, first.stdout
    pid = layout.read_pid(rig.root, UUID)
    assert pid is not None and pid != os.getpid()
    os.kill(pid, 0)
    assert (rig.pipe / "control").exists()
    assert (rig.pipe / "control_privileged").exists()
    second = rig.run("", "-d")
    assert second.returncode == 1
    assert "An instance of this daemon is already running" in second.stdout
    with pytest.raises(AlreadyRunning):
        rig.ctl.start(timeout=10)
    assert layout.read_pid(rig.root, UUID) == pid


def test_daemon_is_in_its_own_session(rig: Rig) -> None:
    rig.ctl.start(timeout=10)
    pid = layout.read_pid(rig.root, UUID)
    assert pid is not None
    assert os.getsid(pid) != os.getsid(0)
    assert os.getpgid(pid) != os.getpgid(0)


def test_stale_pid_file_is_reclaimed(rig: Rig) -> None:
    rig.ctl.start(timeout=10)
    old = layout.read_pid(rig.root, UUID)
    assert old is not None
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pid_alive(old) and time.monotonic() < deadline:
        time.sleep(0.02)
    rig.ctl.start(timeout=10)
    new = layout.read_pid(rig.root, UUID)
    assert new is not None and new != old
    assert rig.ctl.server_list(timeout=10) == []


@pytest.mark.parametrize("newline", ["", "\n"])
def test_commands_answer_in_real_formats(rig: Rig, newline: str) -> None:
    rig.ctl.start(timeout=10)
    assert rig.run("set_default_active_thread_percentage 25" + newline).stdout == "25.0\n"
    silent = rig.run("set_default_device_pinned_mem_limit 0 4096M" + newline)
    assert (silent.returncode, silent.stdout) == (0, "")
    assert rig.run("get_default_device_pinned_mem_limit 0" + newline).stdout == "4G\n"
    rig.run("set_default_device_pinned_mem_limit 0 512M")
    assert rig.run("get_default_device_pinned_mem_limit 0").stdout == "512M\n"
    assert rig.run("get_default_active_thread_percentage").stdout == "25.0\n"
    assert rig.ctl.read_defaults(timeout=10) == (512, 25.0)
    bad = rig.run("no_such_command")
    assert bad.returncode == 0 and bad.stdout.strip()


def test_quit_stops_it_and_forgets_defaults(rig: Rig) -> None:
    rig.ctl.start(timeout=10)
    pid = layout.read_pid(rig.root, UUID)
    assert pid is not None
    rig.ctl.set_defaults(2048, 40, timeout=10)
    rig.ctl.quit(timeout=10)
    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not pid_alive(pid)
    assert not layout.pid_file(rig.root, UUID).exists()
    rig.ctl.start(timeout=10)
    assert rig.ctl.read_defaults(timeout=10) == (None, 100.0)


def test_control_log_lines_in_real_format(rig: Rig) -> None:
    rig.ctl.start(timeout=10)
    rig.run("get_default_active_thread_percentage")
    lines = layout.control_log(rig.root, UUID).read_text().splitlines()
    assert lines and all(LOG_LINE.match(line) for line in lines), lines
    text = "\n".join(lines)
    assert f"Starting control daemon using socket {rig.pipe}/control" in text
    assert "Cmd:get_default_active_thread_percentage" in text
    assert "NEW UI" in text and "UI closed" in text


def test_servers_per_uid_and_queueing(rig: Rig) -> None:
    rig.ctl.start(timeout=10)
    assert fake.connect_client(rig.pipe, 501, 1000) == ""
    [first] = rig.ctl.server_list(timeout=10)
    assert fake.connect_client(rig.pipe, 502, 1000) == ""
    assert fake.connect_client(rig.pipe, 601, 1001) == ""  # waits behind uid 1000
    assert rig.ctl.server_list(timeout=10) == [first]
    assert rig.ctl.client_count([first], timeout=10) == 2
    ps = rig.ctl.ps(timeout=10)
    assert sorted(r.pid for r in ps) == [501, 502] and {r.server for r in ps} == {first}
    assert rig.run(f"terminate_client {first} 501").stdout == "0\n"
    fake.disconnect_client(rig.pipe, 502)
    [second] = rig.ctl.server_list(timeout=10)
    assert second != first
    assert parse_pids(rig.run(f"get_client_list {second}").stdout) == [601]
    log = layout.control_log(rig.root, UUID).read_text()
    assert f"Starting new server {second} for user 1001" in log
    assert f"Server {first} exited with status 0" in log


def test_multiuser_server_serves_every_uid(rig: Rig) -> None:
    rig.ctl.start(multiuser=True, timeout=10)
    fake.connect_client(rig.pipe, 501, 1000)
    fake.connect_client(rig.pipe, 601, 1001)
    [server] = rig.ctl.server_list(timeout=10)
    assert rig.ctl.client_count([server], timeout=10) == 2


def test_fault_until_recover_with_and_without_clients(rig: Rig) -> None:
    rig.ctl.start(timeout=10)
    fake.inject_fault(rig.pipe)  # no server yet: one is started so the FAULT is visible
    servers = rig.ctl.server_list(timeout=10)
    assert rig.ctl.server_statuses(servers, timeout=10) == {servers[0]: ServerState.FAULT}
    assert fake.connect_client(rig.pipe, 700, os.getuid()) == "807"
    fake.recover(rig.pipe)
    assert rig.ctl.server_statuses(servers, timeout=10) == {servers[0]: ServerState.ACTIVE}
    assert fake.connect_client(rig.pipe, 700, os.getuid()) == ""
    fake.inject_fault(rig.pipe)
    fake.disconnect_client(rig.pipe, 700)  # clients leaving do not end an injected fault
    assert rig.ctl.server_statuses(servers, timeout=10)[servers[0]] is ServerState.FAULT
    fake.recover(rig.pipe)
    assert rig.ctl.server_statuses(servers, timeout=10)[servers[0]] is ServerState.ACTIVE


def test_command_times_out_on_a_stopped_daemon(rig: Rig) -> None:
    rig.ctl.start(timeout=10)
    pid = layout.read_pid(rig.root, UUID)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(Exception, match="timed out"):
            rig.ctl.server_list(timeout=0.5)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert rig.ctl.server_list(timeout=10) == []


# --- parsers ---


@pytest.mark.parametrize(
    ("text", "mib"), [("3G", 3072), ("4096M", 4096), ("512M\n", 512), ("", None), ("  \n", None)]
)
def test_parse_mem_limit(text: str, mib: int | None) -> None:
    assert parse_mem_limit(text) == mib


@pytest.mark.parametrize("text", ["3", "3GB", "-1G", "abc"])
def test_parse_mem_limit_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        parse_mem_limit(text)


def test_mem_limit_matches_at_display_precision() -> None:
    assert mem_limit_matches(4096, 4096)
    assert mem_limit_matches(4096, 4500)  # read back as floor 4G
    assert not mem_limit_matches(5120, 4500)
    assert not mem_limit_matches(None, 4096)
    assert not mem_limit_matches(500, 512)


def test_parse_server_status_and_pids() -> None:
    assert parse_server_status("ACTIVE\n") is ServerState.ACTIVE
    assert parse_server_status("FAULT") is ServerState.FAULT
    assert parse_server_status("INITIALIZING") is ServerState.INITIALIZING
    assert parse_server_status("") is ServerState.UNKNOWN
    assert parse_pids("13929\n14001\n") == [13929, 14001]
    assert parse_pids("") == []


def test_parse_ps() -> None:
    out = (
        "PID ID SERVER DEVICE NAMESPACE COMMAND\n"
        "9741 0 6472 GPU-cb1213a3-d6a4-be7f 4026531836 ./nbody\n"
        "9743 1 6472 GPU-cb1213a3-d6a4-be7f 4026531836 python serve.py --port 80\n"
    )
    rows = parse_ps(out)
    assert [(r.pid, r.id, r.server) for r in rows] == [(9741, 0, 6472), (9743, 1, 6472)]
    assert rows[0].device == "GPU-cb1213a3-d6a4-be7f"
    assert rows[1].command == "python serve.py --port 80"
