"""The plugin's HTTP endpoints on `--metrics-address`: `/metrics`, `/healthz`, `/readyz`.

`MetricsServer(address, registry, ready)` serves the registry `PluginMetrics` fills, the
liveness answer and the readiness callback; `parse_address` checks `[host]:port` first.

Anyone who reaches the port is a client, so the server cannot be used against the agent: it
is one asyncio loop on one thread (an idle connection costs a few KiB, never a thread), a
request head must arrive whole within `read_timeout` seconds and `MAX_HEAD` bytes, at most
`max_connections` are open at once, and a new connection over the cap evicts the oldest one
still sending its head (so a flood of half-open connections cannot lock the probes out:
theirs arrive whole at once). One request per connection (`Connection: close`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import socket
import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from deviceplugin.plumbing import logs

_log = logs.get("metrics")


class MetricsAddressError(ValueError):
    """A `--metrics-address` that is not `[host]:port`."""


def parse_address(address: str) -> tuple[str, int]:
    """`:9447` → ("", 9447); `127.0.0.1:0`; `[::1]:9447` → ("::1", 9447)."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit():
        raise MetricsAddressError(f"metrics address {address!r}: expected [host]:port")
    port = int(port_text)
    if port > 65535:
        raise MetricsAddressError(f"metrics address {address!r}: port out of range")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise MetricsAddressError(f"metrics address {address!r}: write IPv6 hosts as [host]:port")
    return host, port


MAX_CONNECTIONS = 512
READ_TIMEOUT = 5.0  # seconds for a whole request head; the probes' own timeout is 5 s
MAX_HEAD = 8192  # bytes of request line and headers
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            503: "Service Unavailable"}  # fmt: skip
_TEXT = "text/plain; charset=utf-8"


class _Connections:
    """Open connections, oldest first, and which of them are still sending their head."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0
        self.reading: dict[asyncio.Transport, None] = {}  # insertion order: oldest first
        self.evicted = 0

    def admit(self, transport: asyncio.Transport) -> bool:
        if self.open >= self.limit:
            if not self.reading:
                return False  # every slot is answering: the newcomer waits for none
            oldest = next(iter(self.reading))
            del self.reading[oldest]
            oldest.abort()
            self.evicted += 1
        self.open += 1
        self.reading[transport] = None
        return True

    def head_read(self, transport: asyncio.Transport) -> None:
        self.reading.pop(transport, None)

    def closed(self, transport: asyncio.Transport) -> None:
        self.reading.pop(transport, None)
        self.open -= 1


class _Http:
    """The loop's side: one coroutine per connection, blocking work on a small pool."""

    def __init__(
        self,
        registry: CollectorRegistry,
        ready: Callable[[], bool],
        max_connections: int,
        read_timeout: float,
    ) -> None:
        self.registry = registry
        self.ready = ready
        self.read_timeout = read_timeout
        self.connections = _Connections(max_connections)
        # A scrape walks every collector and readiness may take locks: off the loop, and
        # never more than two at once whatever the number of clients.
        self.pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="metrics")

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        transport = writer.transport
        assert isinstance(transport, asyncio.Transport)
        if not self.connections.admit(transport):
            transport.abort()
            return
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.read_timeout)
            except asyncio.LimitOverrunError:
                head = b""  # answered 400 below
            self.connections.head_read(transport)
            code, body, content_type = await self._answer(head)
            writer.write(_response(code, body, content_type))
            await asyncio.wait_for(writer.drain(), self.read_timeout)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError):
            pass  # a slow, half-open or vanished client: dropped, nothing to say
        except Exception as exc:  # a bug of ours must cost this request only
            logs.log(_log, "metrics request failed", level=logging.ERROR, error=repr(exc))
        finally:
            self.connections.closed(transport)
            writer.close()

    async def _answer(self, head: bytes) -> tuple[int, bytes, str]:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return 400, b"bad request\n", _TEXT
        method, target = parts[0], parts[1]
        if method != "GET":
            return 405, b"method not allowed\n", _TEXT
        path = target.split("?", 1)[0]
        loop = asyncio.get_running_loop()
        if path == "/metrics":
            accept = ""
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "accept":
                    accept = value.strip()
            encoder, content_type = choose_encoder(accept)
            body = await loop.run_in_executor(self.pool, encoder, self.registry)
            return 200, body, content_type
        if path == "/healthz":
            return 200, b"ok\n", _TEXT
        if path == "/readyz":
            ready = await loop.run_in_executor(self.pool, self._ready)
            return (200, b"ready\n", _TEXT) if ready else (503, b"not ready\n", _TEXT)
        return 404, b"not found\n", _TEXT

    def _ready(self) -> bool:
        try:
            return self.ready()
        except Exception as exc:
            logs.log(_log, "readiness check failed", error=repr(exc))
            return False


def _response(code: int, body: bytes, content_type: str) -> bytes:
    head = (
        f"HTTP/1.1 {code} {_REASONS[code]}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


class MetricsServer:
    """`/metrics`, `/healthz` (process alive) and `/readyz` (`ready()` true) over HTTP."""

    def __init__(
        self,
        address: str,
        registry: CollectorRegistry,
        ready: Callable[[], bool],
        *,
        max_connections: int = MAX_CONNECTIONS,
        read_timeout: float = READ_TIMEOUT,
    ) -> None:
        self._host, self._port = parse_address(address)
        self._registry = registry
        self._ready = ready
        self._max_connections = max_connections
        self._read_timeout = read_timeout
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._http: _Http | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def port(self) -> int:
        """The bound port once started (useful with port 0), else the configured one."""
        if self._sock is not None:
            return int(self._sock.getsockname()[1])
        return self._port

    @property
    def evicted(self) -> int:
        """Connections closed to make room for newer ones (tests and diagnostics)."""
        return self._http.connections.evicted if self._http is not None else 0

    def start(self) -> None:
        with self._lock:
            if self._sock is not None:
                return
            sock = self._bind()  # in the caller: a port in use fails start(), not a thread
            http = _Http(self._registry, self._ready, self._max_connections, self._read_timeout)
            loop = asyncio.new_event_loop()
            started = threading.Event()
            self._sock, self._loop, self._http = sock, loop, http
            self._thread = threading.Thread(
                target=self._run, args=(loop, sock, http, started), name="metrics-http",
                daemon=True,
            )  # fmt: skip
            self._thread.start()
            started.wait(10)
        logs.log(_log, "metrics serving", host=self._host or "*", port=self.port)

    @staticmethod
    def _run(
        loop: asyncio.AbstractEventLoop, sock: socket.socket, http: _Http, started: threading.Event
    ) -> None:
        asyncio.set_event_loop(loop)
        serving = asyncio.start_server(http.serve, sock=sock, limit=MAX_HEAD)
        server = loop.run_until_complete(serving)
        started.set()
        try:
            loop.run_forever()
        finally:
            server.close()
            for task in asyncio.all_tasks(loop):
                task.cancel()
            with contextlib.suppress(Exception):
                loop.run_until_complete(asyncio.sleep(0))
            loop.close()
            http.pool.shutdown(wait=False, cancel_futures=True)

    def stop(self) -> None:
        with self._lock:
            sock, loop, thread = self._sock, self._loop, self._thread
            self._sock, self._loop, self._thread, self._http = None, None, None, None
        if sock is None or loop is None:
            return
        with contextlib.suppress(RuntimeError):  # a loop already closed
            loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(timeout=5)
        sock.close()

    def _bind(self) -> socket.socket:
        if self._host == "":
            if socket.has_ipv6:
                with contextlib.suppress(OSError):
                    return _listen(("::", self._port), socket.AF_INET6)
            return _listen(("0.0.0.0", self._port), socket.AF_INET)
        infos = socket.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM)
        family, _, _, _, sockaddr = infos[0]
        return _listen((str(sockaddr[0]), self._port), family)


def _listen(address: tuple[str, int], family: socket.AddressFamily) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            # An empty host means every address, IPv4 included (dual stack).
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
