"""Allocate answers encoded from their shape's bytes read as the answer built field by field."""

from __future__ import annotations

from pathlib import Path

import pytest

from deviceplugin._pb import deviceplugin_v1beta1_pb2 as pb
from deviceplugin.dpapi.answers import AnswerCache, GrantLike, allocate_response
from deviceplugin.dpapi.preferred import preferred
from tests.test_allocator import EX, SM, TS, Rig


def built(grant: GrantLike) -> pb.ContainerAllocateResponse:
    """The answer as the generated classes build it from every field."""
    shape = grant.shape
    resp = pb.ContainerAllocateResponse(envs=dict(shape.envs), annotations=dict(shape.annotations))
    for ctr, host, ro in shape.mounts:
        resp.mounts.add(container_path=ctr, host_path=host, read_only=ro)
    for ctr, host, perms in shape.device_specs:
        resp.devices.add(container_path=ctr, host_path=host, permissions=perms)
    own = [] if grant.own_device is None else [grant.own_device]
    for name in [*shape.driver_devices, *own]:
        resp.cdi_devices.add(name=name)
    return resp


class Shape:
    def __init__(self, value: str, drivers: list[str]) -> None:
        self.envs = {"A": value, "B": "2"}
        self.mounts = [("/c", "/h", True), ("/c2", "/h2", False)]
        self.device_specs = [("/dev/nvidia0", "/dev/nvidia0", "rw")]
        self.annotations = {"gpu-fraction.dev/x": value[:10]}
        self.driver_devices = drivers


class Grant:
    def __init__(self, shape: Shape, own: str | None) -> None:
        self.shape = shape
        self.own_device = own


@pytest.mark.parametrize(
    ("cfg", "resource"),
    [
        ({}, TS),
        ({}, SM),
        ({}, EX),
        ({"deviceListStrategy": ["envvar"]}, SM),
        ({"deviceListStrategy": ["cdi", "envvar", "device-nodes"]}, TS),
    ],
)
def test_each_allocators_answer_reads_as_its_grant(
    tmp_path: Path, cfg: dict[str, object], resource: str
) -> None:
    rig = Rig(tmp_path, cfg)
    cache = AnswerCache()
    ids = [d for gp in rig.plan.for_resource(resource) for d in gp.device_ids]
    grants = [rig.allocator.allocate(resource, preferred(rig.plan, resource, ids, [], 1))]
    grants.append(rig.allocator.allocate(resource, preferred(rig.plan, resource, ids[1:], [], 1)))
    grants.append(rig.allocator.allocate(resource, preferred(rig.plan, resource, ids, [], 1)))
    if resource != EX:  # two slices of one GPU: one shape, its bytes reused
        assert grants[0].shape is grants[1].shape
    answer = pb.AllocateResponse.FromString(allocate_response([cache.container(g) for g in grants]))
    assert list(answer.container_responses) == [built(g) for g in grants]
    if resource != EX and "cdi" in rig.config.device_list_strategy:
        own = [c.cdi_devices[-1].name for c in answer.container_responses]
        assert own[0] != own[1] and own[0] == own[2]


@pytest.mark.parametrize("size", [1, 100, 200, 20_000])
def test_lengths_past_one_varint_byte_are_encoded_as_protobuf_does(size: int) -> None:
    cache = AnswerCache(limit=2)
    shapes = [Shape("v" * size, ["nvidia.com/gpu=GPU-1"]), Shape("w", [])]
    grants = [Grant(shapes[0], "gpu-fraction.dev/gpu=" + "n" * size), Grant(shapes[1], None)]
    grants += [Grant(Shape(str(i), []), f"k=n{i}") for i in range(3)]  # past the limit
    data = allocate_response([cache.container(g) for g in grants])
    expected = pb.AllocateResponse(container_responses=[built(g) for g in grants])
    assert pb.AllocateResponse.FromString(data) == expected
    assert len(data) == expected.ByteSize()  # no field written twice


def test_no_containers_is_an_empty_answer() -> None:
    assert allocate_response([]) == pb.AllocateResponse().SerializeToString() == b""
