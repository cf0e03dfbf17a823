"""The HTTP endpoint cannot be used against the agent: 2,000 half-open connections.

Any pod that reaches the metrics port is a client. Each connection here sends part of a
request head and then nothing; the real plugin process must keep answering its probes and
the kubelet, without a thread per connection, and close every such connection itself
(issue 33: ~1,000 aborted the thread-per-connection server, ~3,500 OOM-killed it).
"""

from __future__ import annotations

import contextlib
import resource
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from deviceplugin.metrics import server
from tests.conftest import MakePlugin
from tests.plugin_proc import PluginProcess

TS = "nvidia.com/gpu-fraction"
HALF_OPEN = 2000


def _status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


@pytest.fixture
def fds() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, HALF_OPEN + 1024))
    if want < HALF_OPEN + 256:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is too low for {HALF_OPEN} sockets")
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _half_open(port: int, count: int) -> list[socket.socket]:
    held = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: agent\r\n")  # the blank line never comes
        held.append(sock)
    return held


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False  # open, nothing sent
    except ConnectionError:
        return True


def test_half_open_connections_neither_exhaust_nor_stall_the_agent(
    make_plugin: MakePlugin, fds: None
) -> None:
    plugin: PluginProcess = make_plugin()
    plugin.start()
    plugin.wait_registered(1)
    port = plugin.metrics_port()
    assert plugin.proc is not None
    pid = plugin.proc.pid
    assert _get(port, "/healthz") == (200, b"ok\n")
    threads_before = _status(pid, "Threads")
    rss_before = _status(pid, "VmRSS")
    held = _half_open(port, HALF_OPEN)
    try:
        began = time.monotonic()
        # The probes and the kubelet are answered while every one of them is held.
        assert _get(port, "/healthz") == (200, b"ok\n")
        assert _get(port, "/readyz")[0] == 200
        code, body = _get(port, "/metrics")
        assert code == 200 and b"gpu_fraction_slices" in body
        answer = plugin.kubelet.allocate(TS, 2)
        assert answer.annotations["gpu-fraction.dev/mode"] == "time-slicing"
        threads = _status(pid, "Threads")
        rss = _status(pid, "VmRSS")
        assert threads <= threads_before + 2, (threads_before, threads)  # no thread per client
        assert rss - rss_before < 64 * 1024, (rss_before, rss)  # KiB
        # Each was closed by the agent: evicted by newer ones over the cap, or timed out.
        deadline = began + server.READ_TIMEOUT + 10
        while time.monotonic() < deadline:
            if all(_closed_by_peer(s) for s in held):
                break
            time.sleep(0.5)
        still = sum(not _closed_by_peer(s) for s in held)
        assert still == 0, f"{still} half-open connections still held by the agent"
        print(f"threads {threads_before}->{threads}, VmRSS {rss_before}->{rss} KiB")
    finally:
        for sock in held:
            with contextlib.suppress(OSError):
                sock.close()
    assert _get(port, "/healthz") == (200, b"ok\n")
    assert plugin.terminate() == 0
