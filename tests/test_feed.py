"""DeviceFeed: the encoded device lists follow plan, faults and (under a client limit) use."""

from __future__ import annotations

from deviceplugin._pb import deviceplugin_v1beta1_pb2 as pb
from deviceplugin.dpapi.feed import DeviceFeed
from deviceplugin.health.board import HealthBoard
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


def test_the_version_moves_on_every_board_change() -> None:
    plan = small_plan(Mode.TIME_SLICING)
    board = HealthBoard()
    feed = DeviceFeed(lambda: plan, board, lambda r: set())
    before = feed.version
    board.set(plan.gpus[0].uuid, FaultDomain.GPU, "xid=79")
    assert feed.version == before + 1
    feed.poke()
    assert feed.version == before + 2
