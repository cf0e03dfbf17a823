"""Fuzzing the DevicePlugin gRPC surface: hostile requests over a real unix socket.

An in-process DevicePluginService per resource, backed by the real Allocator, ledger, CDI
writer and a plan built from a simulated inventory, serves on its own event loop thread.
Every request must get OK or a documented status with a message, log no traceback, and
leave the server answering. Seeds are fixed so `make test` is reproducible.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deviceplugin._pb import deviceplugin_v1beta1_pb2 as pb
from deviceplugin._pb import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from deviceplugin.config.settings import Config, parse
from deviceplugin.dpapi.allocator import Allocator, Grant
from deviceplugin.dpapi.feed import DeviceFeed
from deviceplugin.dpapi.preferred import preferred
from deviceplugin.dpapi.server import DevicePluginService, ResourceServer
from deviceplugin.health.board import HealthBoard
from deviceplugin.ledger.store import Ledger
from deviceplugin.model import GpuUuid
from deviceplugin.plan import SlicePlan, build_plan
from tests.test_plan import inventory

TS = "nvidia.com/gpu-fraction"
SM = "nvidia.com/gpu-fraction.sm-sharing"
EX = "nvidia.com/gpu"
DOCUMENTED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
}
CONFIG = {
    "version": "v1",
    "sliceSize": "4Gi",
    "gpus": [
        {"match": {"index": 0}, "mode": "time-slicing"},
        {"match": {"index": 1}, "mode": "sm-sharing"},
        {"match": {"index": 2}, "mode": "exclusive"},
        {"match": {"index": 3}, "mode": "exclusive"},
    ],
}
FUZZ = settings(
    derandomize=True,
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class ReadyMps:
    """The MPS gate with every daemon up (the supervisor has its own tests)."""

    def ensure(self, gpu: GpuUuid) -> bool:
        return True

    def wait_ready(self, gpu: GpuUuid, timeout: float) -> bool:
        return True

    def memory_accounting(self, gpu: GpuUuid) -> bool:
        return True


class Backend:
    """What daemon/backends.py hands the servers: the pure packer and the real Allocator."""

    def __init__(self, plan: SlicePlan, allocator: Allocator) -> None:
        self._plan = plan
        self._allocator = allocator

    def preferred(
        self, resource: str, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str]:
        return list(preferred(self._plan, resource, available, must_include, size))

    def allocate(self, resource: str, device_ids: Sequence[str]) -> Grant:
        return self._allocator.allocate(resource, device_ids)

    def wait_mps(self, gpu: GpuUuid, timeout: float) -> bool:
        return True


class Tracebacks(logging.Handler):
    """Collects records that carry a traceback (expected errors must not)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.records.append(record)


@dataclass
class Served:
    plan: SlicePlan
    stubs: dict[str, Any]  # generated stubs are untyped
    tracebacks: Tracebacks
    cdi_dir: Path


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    root = Path(tempfile.mkdtemp(prefix="gf-fz-", dir="/tmp"))  # short unix socket paths
    config: Config = parse(CONFIG)
    plan = build_plan(inventory("mixed"), config)
    board = HealthBoard()
    ledger = Ledger(root / "state")
    allocator = Allocator(
        lambda: plan, lambda: config, root / "cdi", root / "mps", ledger, board, ReadyMps()
    )
    feed = DeviceFeed(lambda: plan, board, ledger.used_ids)
    backend = Backend(plan, allocator)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fuzz-grpc", daemon=True)
    thread.start()
    servers = [
        ResourceServer(DevicePluginService(r, feed, backend), root, f"fz{i}")
        for i, r in enumerate(plan.resources)
    ]
    paths = [asyncio.run_coroutine_threadsafe(s.start(), loop).result(30) for s in servers]
    channels = [grpc.insecure_channel(f"unix://{p}") for p in paths]
    stubs: dict[str, Any] = {
        s.resource: pb_grpc.DevicePluginStub(c)  # type: ignore[no-untyped-call]
        for s, c in zip(servers, channels, strict=True)
    }
    tracebacks = Tracebacks()
    logging.getLogger("gpu-fraction").addHandler(tracebacks)
    try:
        yield Served(plan, stubs, tracebacks, root / "cdi")
    finally:
        logging.getLogger("gpu-fraction").removeHandler(tracebacks)
        for c in channels:
            c.close()
        for s in servers:
            asyncio.run_coroutine_threadsafe(s.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        shutil.rmtree(root, ignore_errors=True)


def _plan_ids(plan: SlicePlan) -> list[str]:
    return [d for gp in plan.gpus for d in gp.device_ids]


PLAN_IDS = _plan_ids(build_plan(inventory("mixed"), parse(CONFIG)))
UUIDS = sorted({d.partition("::")[0] for d in PLAN_IDS})
hostile_ids = st.one_of(
    st.sampled_from(PLAN_IDS),  # real IDs of every resource
    st.text(max_size=40),  # unicode, empty strings
    st.builds(lambda u, n: f"{u}::{n}", st.sampled_from(UUIDS), st.integers(-5, 10**6)),
    st.builds(lambda s: f"GPU-{s}::0", st.text(max_size=20)),
    st.sampled_from(["", "::", "::0", "GPU-../../etc::1", "a\x00b", "GPU-x::1::2", "😀::1"]),
)
id_lists = st.lists(hostile_ids, max_size=12)
resources = st.sampled_from([TS, SM, EX])


def _answered(served: Served, resource: str, call: str, request: object) -> object | None:
    """Call and return the response, or None after a documented refusal with a message."""
    stub = served.stubs[resource]
    try:
        response: object = getattr(stub, call)(request, timeout=30)
    except grpc.RpcError as exc:
        assert exc.code() in DOCUMENTED, (exc.code(), exc.details())
        assert exc.details(), "a refusal must say why"
        response = None
    options = stub.GetDevicePluginOptions(pb.Empty(), timeout=30)  # still serving
    assert options.get_preferred_allocation_available
    assert not served.tracebacks.records, served.tracebacks.records[0].getMessage()
    return response


@FUZZ
@given(resource=resources, containers=st.lists(id_lists, min_size=1, max_size=3))
def test_allocate_answers_or_refuses(
    served: Served, resource: str, containers: list[list[str]]
) -> None:
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=ids) for ids in containers]
    )
    response = _answered(served, resource, "Allocate", request)
    if response is None:
        return
    assert isinstance(response, pb.AllocateResponse)
    assert len(response.container_responses) == len(containers)
    for ids, answer in zip(containers, response.container_responses, strict=True):
        # An answer only ever names GPUs the container asked for.
        gpus = {d.partition("::")[0] for d in ids}
        named = answer.annotations["gpu-fraction.dev/gpu"].split(",")
        assert set(named) <= gpus
        assert set(ids) <= set(PLAN_IDS) and len(set(ids)) == len(ids)


@FUZZ
@given(
    resource=resources,
    available=id_lists,
    must=id_lists,
    size=st.one_of(st.integers(-(2**31), 2**31 - 1), st.integers(-3, 20)),
)
def test_preferred_answers_or_refuses(
    served: Served, resource: str, available: list[str], must: list[str], size: int
) -> None:
    request = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size
            )
        ]
    )
    response = _answered(served, resource, "GetPreferredAllocation", request)
    if response is None:
        return
    assert isinstance(response, pb.PreferredAllocationResponse)
    (answer,) = response.container_responses
    chosen = list(answer.deviceIDs)
    # Never more than asked, never a repeat, never an ID the kubelet did not offer.
    assert len(chosen) <= max(size, 0)
    assert len(set(chosen)) == len(chosen)
    assert set(chosen) <= set(available) | set(must)


@FUZZ
@given(resource=resources, ids=id_lists)
def test_prestart_answers(served: Served, resource: str, ids: list[str]) -> None:
    request = pb.PreStartContainerRequest(devices_ids=ids)
    response = _answered(served, resource, "PreStartContainer", request)
    assert isinstance(response, pb.PreStartContainerResponse)


def test_ten_thousand_ids(served: Served) -> None:
    junk = [f"GPU-{n:08d}::{n}" for n in range(10_000)]
    real = [d for d in PLAN_IDS if d.startswith(UUIDS[0])]
    for ids in (junk, real * (10_000 // max(len(real), 1)), [real[0]] * 10_000):
        request = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]
        )
        with pytest.raises(grpc.RpcError) as refused:
            served.stubs[TS].Allocate(request, timeout=60)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        preferred_request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=ids, must_include_deviceIDs=ids[:5000], allocation_size=7
                )
            ]
        )
        answer = served.stubs[TS].GetPreferredAllocation(preferred_request, timeout=60)
        chosen = list(answer.container_responses[0].deviceIDs)
        assert len(chosen) == min(7, len(set(ids))) and len(set(chosen)) == len(chosen)
    assert served.stubs[TS].GetDevicePluginOptions(pb.Empty(), timeout=30)


def test_refusal_names_the_problem(served: Served) -> None:
    sm_id = next(d for d in PLAN_IDS if served.plan.for_gpu(d.partition("::")[0]).resource == SM)  # type: ignore[union-attr]
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=[sm_id])]
    )
    with pytest.raises(grpc.RpcError) as refused:
        served.stubs[TS].Allocate(request, timeout=30)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "another resource" in (refused.value.details() or "")


@pytest.mark.parametrize("size", [-(2**31), -1, 0])
def test_preferred_size_zero_or_negative_picks_nothing(served: Served, size: int) -> None:
    ids = [d for d in PLAN_IDS if d.startswith(UUIDS[0])][:4]
    request = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=ids, must_include_deviceIDs=ids[:3], allocation_size=size
            )
        ]
    )
    answer = served.stubs[TS].GetPreferredAllocation(request, timeout=30)
    assert list(answer.container_responses[0].deviceIDs) == []
