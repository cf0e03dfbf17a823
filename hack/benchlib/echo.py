"""The baseline: a bare grpc.aio unary server on a unix socket, in its own process.

Run as `python echo.py SOCKET`. `/bench.Echo/Echo` returns the request bytes untouched and
`/bench.Echo/Sink` returns nothing; neither parses protobuf, so a client call measures the
transport and the client's own (de)serialization only, which is what the plugin adds work to.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc

SERVICE = "bench.Echo"


async def _echo(request: bytes, context: Any) -> bytes:
    return request


async def _sink(request: bytes, context: Any) -> bytes:
    return b""


async def serve(socket: str) -> None:
    # the same server construction as the plugin's ResourceServer
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Echo": grpc.unary_unary_rpc_method_handler(_echo),
            "Sink": grpc.unary_unary_rpc_method_handler(_sink),
        },
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix://{socket}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(0)


def channel(socket: Path) -> grpc.Channel:
    """A client channel to the echo server on `socket` (a unix target needs an authority)."""
    return grpc.insecure_channel(
        f"unix://{socket}", options=[("grpc.default_authority", "localhost")]
    )


def echo_call(channel: grpc.Channel, message: Any) -> Any:
    """`/bench.Echo/Echo` on `channel`, sending and reading back a `message` type."""
    return channel.unary_unary(
        f"/{SERVICE}/Echo",
        request_serializer=message.SerializeToString,
        response_deserializer=message.FromString,
    )


def start(socket: Path) -> subprocess.Popen[bytes]:
    """Start the echo server process; the caller waits for the channel to be ready."""
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), str(socket)],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1]))
