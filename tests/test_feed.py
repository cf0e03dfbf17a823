"""DeviceFeed: the encoded device lists follow plan, faults and (under a client limit) use."""

from __future__ import annotations

import time

from pytest import MonkeyPatch

from deviceplugin._pb import deviceplugin_v1beta1_pb2 as pb
from deviceplugin.dpapi import feed as feed_module
from deviceplugin.dpapi.feed import DeviceFeed
from deviceplugin.health.board import HealthBoard
from deviceplugin.health.verdicts import STARTING
from deviceplugin.model import FaultDomain, Mode, SliceId
from tests.planfixtures import RESOURCES, small_plan

SM = RESOURCES[Mode.SM_SHARING]


def decode(feed: DeviceFeed, resource: str) -> dict[str, tuple[str, list[int]]]:
    msg = pb.ListAndWatchResponse.FromString(feed.encoded(resource))
    return {d.ID: (d.health, [n.ID for n in d.topology.nodes]) for d in msg.devices}


def test_client_limit_marks_only_free_slices_and_pieces_follow_faults() -> None:
    plan = small_plan(Mode.SM_SHARING, Mode.SM_SHARING)
    board = HealthBoard()
    used: set[SliceId] = {plan.gpus[0].device_ids[1]}
    feed = DeviceFeed(lambda: plan, board, lambda r: used)
    first = decode(feed, SM)
    assert len(first) == 8 and {h for h, _ in first.values()} == {"Healthy"}
    assert first[plan.gpus[1].device_ids[0]][1] == [1]  # NUMA node of GPU 1

    board.set(plan.gpus[0].uuid, FaultDomain.CLIENT_LIMIT, "clients=48 max=48")
    limited = decode(feed, SM)
    gpu0 = plan.gpus[0].device_ids
    assert [limited[d][0] for d in gpu0] == ["Unhealthy", "Healthy", "Unhealthy", "Unhealthy"]
    assert {limited[d][0] for d in plan.gpus[1].device_ids} == {"Healthy"}

    used.add(gpu0[2])  # a change of use under the limit shows on the next encoding
    assert decode(feed, SM)[gpu0[2]][0] == "Healthy"

    board.clear(plan.gpus[0].uuid, FaultDomain.CLIENT_LIMIT)
    board.set(plan.gpus[1].uuid, FaultDomain.MPS_DAEMON, "daemon-dead")
    after = decode(feed, SM)
    assert {after[d][0] for d in gpu0} == {"Healthy"}
    assert {after[d][0] for d in plan.gpus[1].device_ids} == {"Unhealthy"}


def test_a_fault_and_its_recovery_are_sent_without_encoding(monkeypatch: MonkeyPatch) -> None:
    """Both uniform pieces of a GPU are encoded when it is first listed: the update a fault
    makes (the Xid to ListAndWatch latency) joins bytes, it encodes no device."""
    plan = small_plan(Mode.TIME_SLICING, Mode.TIME_SLICING)
    board = HealthBoard()
    feed = DeviceFeed(lambda: plan, board, lambda r: set())
    resource = plan.gpus[0].resource
    decode(feed, resource)
    encoded: list[int] = []
    real = feed_module._encode_health
    monkeypatch.setattr(
        feed_module,
        "_encode_health",
        lambda gp, healths: encoded.append(len(healths)) or real(gp, healths),
    )
    board.set(plan.gpus[0].uuid, FaultDomain.GPU, "xid=79 class=reboot")
    down = decode(feed, resource)
    assert {down[d][0] for d in plan.gpus[0].device_ids} == {"Unhealthy"}
    assert {down[d][0] for d in plan.gpus[1].device_ids} == {"Healthy"}
    board.clear(plan.gpus[0].uuid, FaultDomain.GPU)
    assert {h for h, _ in decode(feed, resource).values()} == {"Healthy"}
    assert encoded == []


def test_the_version_moves_on_every_board_change() -> None:
    plan = small_plan(Mode.TIME_SLICING)
    board = HealthBoard()
    feed = DeviceFeed(lambda: plan, board, lambda r: set())
    before = feed.version
    board.set(plan.gpus[0].uuid, FaultDomain.GPU, "xid=79")
    assert feed.version == before + 1
    feed.poke()
    assert feed.version == before + 2


def test_a_daemon_not_yet_judged_is_not_unhealthy_until_its_bound() -> None:
    """The real kubelet refuses a pod placed on devices it last heard were Unhealthy
    (`UnexpectedAdmissionError`), so a daemon still starting, or being adopted after a
    restart, must not turn its slices Unhealthy; past the bound it does (the verdict)."""
    plan = small_plan(Mode.SM_SHARING, Mode.SM_SHARING)
    board = HealthBoard()
    feed = DeviceFeed(lambda: plan, board, lambda r: set(), verdict_bound=0.3)
    try:
        gpu0, gpu1 = (gp.uuid for gp in plan.gpus)
        board.set(gpu0, FaultDomain.MPS_DAEMON, STARTING)
        board.set(gpu1, FaultDomain.MPS_DAEMON, "daemon-dead")  # a verdict: at once
        seen = decode(feed, SM)
        assert {seen[d][0] for d in plan.gpus[0].device_ids} == {"Healthy"}
        assert {seen[d][0] for d in plan.gpus[1].device_ids} == {"Unhealthy"}
        version = feed.version
        deadline = time.monotonic() + 5
        while feed.version == version and time.monotonic() < deadline:
            time.sleep(0.05)  # the bound's expiry asks the streams to send again
        assert feed.version != version
        expired = decode(feed, SM)
        assert {expired[d][0] for d in plan.gpus[0].device_ids} == {"Unhealthy"}
        board.clear(gpu0, FaultDomain.MPS_DAEMON)  # judged: healthy
        assert {decode(feed, SM)[d][0] for d in plan.gpus[0].device_ids} == {"Healthy"}
    finally:
        feed.close()
