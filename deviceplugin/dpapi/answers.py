"""Allocate answers as bytes: what every grant of one shape shares is encoded once.

The kubelet asks for the same few shapes over and over (DESIGN section 7 holds Allocate to
1.5x a bare echo), and each answer differs from its shape's only in the allocation's own CDI
device. So the shared fields are serialized once per shape, and an answer is those bytes,
its own device's `cdi_devices` entry after them (protobuf parses concatenated fields of one
message as one message, a repeated field's entries in order) and the length prefix that
makes it an `AllocateResponse` entry. Nothing else of the wire format is written by hand.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from deviceplugin._pb import deviceplugin_v1beta1_pb2 as pb

__all__ = ["AnswerCache", "GrantLike", "SharedAnswer", "allocate_response"]

# Shapes kept: far more than one node's pod templates ask for (grant_shape.MAX_SHAPES).
MAX_SHARED = 1024

# Field numbers of deviceplugin/v1beta1/api.proto (protos/).
_ALLOCATE_RESPONSE_CONTAINER_RESPONSES = 1
_CONTAINER_RESPONSE_CDI_DEVICES = 5
_CDI_DEVICE_NAME = 1
_LENGTH_DELIMITED = 2


class SharedAnswer(Protocol):
    """The fields every Allocate answer of one shape shares (grant_shape.Shape). Hashed by
    identity: one object per shape, read only."""

    @property
    def envs(self) -> Mapping[str, str]: ...
    @property
    def mounts(self) -> Sequence[tuple[str, str, bool]]: ...
    @property
    def device_specs(self) -> Sequence[tuple[str, str, str]]: ...
    @property
    def annotations(self) -> Mapping[str, str]: ...
    @property
    def driver_devices(self) -> Sequence[str]: ...


class GrantLike(Protocol):
    """What an Allocate answer needs of the allocator's Grant."""

    @property
    def shape(self) -> SharedAnswer: ...
    @property
    def own_device(self) -> str | None: ...  # this allocation's CDI device, qualified


class AnswerCache:
    """Each shape's shared fields, serialized on first use."""

    def __init__(self, limit: int = MAX_SHARED) -> None:
        self._limit = limit
        self._shared: dict[SharedAnswer, bytes] = {}

    def container(self, grant: GrantLike) -> bytes:
        """The grant's serialized `ContainerAllocateResponse`."""
        shape = grant.shape
        shared = self._shared.get(shape)
        if shared is None:
            shared = _encode_shared(shape)
            if len(self._shared) >= self._limit:
                self._shared = {}  # shapes of an older plan or config: worked out again
            self._shared[shape] = shared
        own = grant.own_device
        if own is None:
            return shared
        return shared + _delimited(
            _CONTAINER_RESPONSE_CDI_DEVICES, _delimited(_CDI_DEVICE_NAME, own.encode())
        )


def allocate_response(containers: Sequence[bytes]) -> bytes:
    """A serialized `AllocateResponse` of serialized `ContainerAllocateResponse`s."""
    return b"".join(_delimited(_ALLOCATE_RESPONSE_CONTAINER_RESPONSES, c) for c in containers)


def _encode_shared(shape: SharedAnswer) -> bytes:
    resp = pb.ContainerAllocateResponse(envs=dict(shape.envs), annotations=dict(shape.annotations))
    for container_path, host_path, read_only in shape.mounts:
        resp.mounts.add(container_path=container_path, host_path=host_path, read_only=read_only)
    for container_path, host_path, permissions in shape.device_specs:
        resp.devices.add(
            container_path=container_path, host_path=host_path, permissions=permissions
        )
    for name in shape.driver_devices:
        resp.cdi_devices.add(name=name)
    encoded: bytes = resp.SerializeToString()
    return encoded


def _delimited(field: int, payload: bytes) -> bytes:
    """One length-delimited field: its key, the payload's length as a varint, the payload."""
    return _varint(field << 3 | _LENGTH_DELIMITED) + _varint(len(payload)) + payload


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))  # the common case: keys and short names
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
