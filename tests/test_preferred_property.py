"""Property tests for GetPreferredAllocation packing (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from deviceplugin.config.settings import Config, parse
from deviceplugin.dpapi.preferred import preferred
from deviceplugin.model import split_slice_id
from deviceplugin.plan import SlicePlan, build_plan
from tests.test_plan import inventory

CFG = parse({"version": "v1", "sliceSize": "16Gi"})  # 8 slices per H200
PLAN: SlicePlan = build_plan(inventory("h200x8"), CFG)
ALL = [d for gp in PLAN.gpus for d in gp.device_ids]
TS = Config().resource_names.time_slicing
EX_PLAN: SlicePlan = build_plan(
    inventory("h200x8"), parse({"version": "v1", "defaultMode": "exclusive"})
)
EX_ALL = [gp.uuid for gp in EX_PLAN.gpus]
EX = Config().resource_names.exclusive


@st.composite
def requests(draw: st.DrawFn, pool: list[str]) -> tuple[list[str], list[str], int]:
    available = draw(st.lists(st.sampled_from(pool), unique=True, max_size=len(pool)))
    must = draw(st.lists(st.sampled_from(available), unique=True, max_size=3)) if available else []
    size = draw(st.integers(min_value=1, max_value=len(pool)))
    return draw(st.permutations(available)), must, size


def _gpu(device_id: str) -> str:
    return split_slice_id(device_id)[0]


@settings(max_examples=300, deadline=None)
@given(requests(ALL))
def test_fractional_properties(req: tuple[list[str], list[str], int]) -> None:
    available, must, size = req
    got = preferred(PLAN, TS, available, must, size)
    pool = set(available) | set(must)
    assert len(got) == len(set(got))
    assert set(got) <= pool
    assert len(got) == min(size, len(pool))
    if len(must) <= size:
        assert got[: len(must)] == must
    # all on one GPU whenever one GPU can hold them (with the must_include devices)
    must_gpus = {_gpu(d) for d in must}
    if len(must_gpus) <= 1 and len(must) <= size:
        per_gpu: dict[str, int] = {}
        for d in pool:
            per_gpu[_gpu(d)] = per_gpu.get(_gpu(d), 0) + 1
        holders = [g for g, n in per_gpu.items() if n >= size and (not must_gpus or g in must_gpus)]
        if holders:
            assert len({_gpu(d) for d in got}) == 1
    assert preferred(PLAN, TS, available, must, size) == got
    assert preferred(PLAN, TS, sorted(available), must, size) == got


@settings(max_examples=200, deadline=None)
@given(requests(EX_ALL))
def test_exclusive_properties(req: tuple[list[str], list[str], int]) -> None:
    available, must, size = req
    got = preferred(EX_PLAN, EX, available, must, size)
    pool = set(available) | set(must)
    assert len(got) == len(set(got)) == min(size, len(pool))
    assert set(got) <= pool
    assert preferred(EX_PLAN, EX, sorted(available), must, size) == got


# IDs of this plan's GPUs that the plan does not list (a stale ID after a plan change).
STRAY = [f"{gp.uuid}::{i}" for gp in PLAN.gpus[:2] for i in (90, 91)]


@settings(max_examples=300, deadline=None)
@given(requests(ALL + STRAY))
def test_fractional_takes_lowest_slices_and_unlisted_ids_last(
    req: tuple[list[str], list[str], int],
) -> None:
    available, _, size = req
    got = preferred(PLAN, TS, available, [], size)
    gpus = {_gpu(d) for d in got}
    if len(gpus) != 1:
        return
    (gpu,) = gpus
    on_gpu = [d for d in available if _gpu(d) == gpu]
    listed = sorted((d for d in on_gpu if d not in STRAY), key=lambda d: split_slice_id(d)[1] or 0)
    unlisted = sorted(d for d in on_gpu if d in STRAY)
    # the lowest free slices the plan lists, then (only to make up the size) the unlisted
    assert got[: len(listed)] == listed[:size]
    assert set(got[len(listed) :]) <= set(unlisted)
