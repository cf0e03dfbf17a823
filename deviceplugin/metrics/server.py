"""The plugin's HTTP endpoints on `--metrics-address`: `/metrics`, `/healthz`, `/readyz`.

`MetricsServer(address, registry, ready)` serves the registry `PluginMetrics` fills, the
liveness answer and the readiness callback; `parse_address` checks `[host]:port` first.
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

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


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily) -> None:
        self.address_family = family
        super().__init__(address, _Handler, bind_and_activate=False)
        self.registry: CollectorRegistry | None = None
        self.ready: Callable[[], bool] = lambda: False
        if family == socket.AF_INET6:
            # An empty host means every address, IPv4 included (dual stack).
            with contextlib.suppress(OSError):
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            self.server_bind()
            self.server_activate()
        except BaseException:
            self.server_close()
            raise

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's FQDN (a DNS lookup at start); skip it.
        socketserver.TCPServer.server_bind(self)
        self.server_name = str(self.server_address[0])
        self.server_port = int(self.server_address[1])


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            assert self.server.registry is not None
            self._reply(200, encoder(self.server.registry), content_type)
        elif path == "/healthz":
            self._reply(200, b"ok\n")
        elif path == "/readyz":
            try:
                ready = self.server.ready()
            except Exception as exc:
                logs.log(_log, "readiness check failed", error=repr(exc))
                ready = False
            self._reply(200, b"ready\n") if ready else self._reply(503, b"not ready\n")
        else:
            self._reply(404, b"not found\n")

    def _reply(
        self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8"
    ) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        # Probes hit this every few seconds; access logs would drown the event log.
        pass


class MetricsServer:
    """`/metrics`, `/healthz` (process alive) and `/readyz` (`ready()` true) over HTTP."""

    def __init__(
        self, address: str, registry: CollectorRegistry, ready: Callable[[], bool]
    ) -> None:
        self._host, self._port = parse_address(address)
        self._registry = registry
        self._ready = ready
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def port(self) -> int:
        """The bound port once started (useful with port 0), else the configured one."""
        if self._server is not None:
            return int(self._server.server_address[1])
        return self._port

    def start(self) -> None:
        with self._lock:
            if self._server is not None:
                return
            server = self._bind()
            server.registry = self._registry
            server.ready = self._ready
            self._server = server
            self._thread = threading.Thread(
                target=server.serve_forever, name="metrics-http", daemon=True
            )
            self._thread.start()
        logs.log(_log, "metrics serving", host=self._host or "*", port=self.port)

    def stop(self) -> None:
        with self._lock:
            server, thread = self._server, self._thread
            self._server, self._thread = None, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def _bind(self) -> _Server:
        if self._host == "":
            if socket.has_ipv6:
                with contextlib.suppress(OSError):
                    return _Server(("::", self._port), socket.AF_INET6)
            return _Server(("0.0.0.0", self._port), socket.AF_INET)
        infos = socket.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM)
        family, _, _, _, sockaddr = infos[0]
        return _Server((str(sockaddr[0]), self._port), family)
