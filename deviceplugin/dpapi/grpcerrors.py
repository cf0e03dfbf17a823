"""The one place that maps the plugin's domain errors to gRPC status codes."""

from __future__ import annotations

import grpc


def status_for(code: str) -> grpc.StatusCode:
    """`code` is the name of a gRPC status (the allocator's error codes use those names)."""
    try:
        return grpc.StatusCode[code]
    except KeyError:
        return grpc.StatusCode.INTERNAL
