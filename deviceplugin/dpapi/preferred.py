"""GetPreferredAllocation's choice of IDs, without gRPC or NVML.

`preferred` is a pure function of the plan and the kubelet's request: must_include first,
then best fit on one GPU (exclusive GPUs: by NUMA node), lowest slices first. Allocate's
answers are `allocator.py`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from deviceplugin.model import Mode, SliceId, gpu_of, split_slice_id
from deviceplugin.plan import GpuPlan, SlicePlan

__all__ = ["preferred"]


def preferred(
    plan: SlicePlan,
    resource: str,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
) -> list[SliceId]:
    """Pack `size` IDs: must_include first, then best fit on one GPU, lowest slices first.

    Returns exactly `size` IDs whenever available ∪ must_include has that many (fewer only
    when it has fewer); on one GPU whenever one GPU can hold them, else over the fewest GPUs.
    Exclusive GPUs prefer the NUMA node of must_include, then one node that holds them all.
    """
    must = list(dict.fromkeys(must_include))
    if size <= len(must):
        return [SliceId(d) for d in must[: max(size, 0)]]  # a negative size picks nothing
    free = set(available)  # the request's repeated field itself: no list of it first
    free.difference_update(must)  # in place: a second set of ~4,450 IDs is a copy too many
    need = size - len(must)
    must_gpus = list(dict.fromkeys(gpu_of(d) for d in must))
    plans = plan.for_resource(resource)
    if any(p.mode is Mode.EXCLUSIVE for p in plans):
        groups = _group(sorted(free))
        chosen = _pick_exclusive(plan, groups, must_gpus, need)
    else:
        chosen = _pick_fractional(_Groups(plans, free), must_gpus, need)
    return [SliceId(d) for d in must + chosen]


class _Groups:
    """Free IDs counted per GPU, the request's one set kept whole.

    The request brings ~4,450 IDs as fresh strings: one set of them is the floor. Each GPU's
    count is a membership test per planned ID run in C (no set per GPU), and only the GPU a
    pick takes from is walked, in plan order.
    """

    def __init__(self, plans: Sequence[GpuPlan], free: set[str]) -> None:
        self._free = free
        self._order: dict[str, tuple[str, ...]] = {}
        self._stray: dict[str, list[str]] = {}
        self.count: dict[str, int] = {}
        known = 0
        for gp in plans:
            n = sum(map(free.__contains__, gp.device_ids))
            known += n
            if n:
                self.count[gp.uuid] = n
                self._order[gp.uuid] = gp.device_ids
        if known != len(free):  # IDs the plan does not know: still returned, after the rest
            stray = free.difference(*(gp.id_set for gp in plans))
            for gpu, members in _group(stray).items():
                self._stray[gpu] = members
                self.count[gpu] = self.count.get(gpu, 0) + len(members)

    def take(self, gpu: str, n: int) -> list[str]:
        left = self.count.pop(gpu, 0)
        order = self._order.get(gpu, ())
        stray = self._stray.pop(gpu, [])
        if left <= n:
            return _lowest([d for d in order if d in self._free] + stray, n)
        out: list[str] = []
        for d in order:  # plan order is slice order; stop as soon as n are found
            if d in self._free:
                out.append(d)
                if len(out) == n:
                    return out
        return out + _lowest(stray, n - len(out))


def _group(ids: Iterable[str]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for d in ids:
        groups.setdefault(gpu_of(d), []).append(d)
    return groups


def _slice_order(device_id: str) -> tuple[int, int, str]:
    try:
        _, index = split_slice_id(device_id)
    except ValueError:
        return (1, 0, device_id)  # malformed IDs last, still deterministic
    return (0, -1 if index is None else index, device_id)


def _lowest(ids: list[str], n: int) -> list[str]:
    return sorted(ids, key=_slice_order)[:n]


def _pick_fractional(groups: _Groups, must_gpus: list[str], need: int) -> list[str]:
    chosen: list[str] = []
    # Top up the must_include GPU first so the request stays on as few GPUs as possible.
    for gpu in must_gpus:
        take = groups.take(gpu, need)
        chosen += take
        need -= len(take)
        if need == 0:
            return chosen
    count = groups.count
    while need > 0 and count:
        fits = [g for g, n in count.items() if n >= need]
        if fits:
            # Best fit: the fullest GPU that still holds the rest (fights fragmentation).
            gpu = min(fits, key=lambda g: (count[g], g))
        else:
            gpu = min(count, key=lambda g: (-count[g], g))
        take = groups.take(gpu, need)
        chosen += take
        need -= len(take)
    return chosen


def _pick_exclusive(
    plan: SlicePlan, groups: dict[str, list[str]], must_gpus: list[str], need: int
) -> list[str]:
    candidates = sorted(
        (d for ids in groups.values() for d in ids), key=lambda d: _gpu_key(plan, d)
    )
    by_node: dict[int | None, list[str]] = {}
    for d in candidates:
        by_node.setdefault(plan.numa_node(gpu_of(d)), []).append(d)
    order: list[int | None] = []
    for gpu in must_gpus:
        node = plan.numa_node(gpu)
        if node not in order:
            order.append(node)
    rest = [n for n in by_node if n not in order]
    # Then the node that holds the whole remainder with least to spare, then the fullest ones.
    whole = sorted((n for n in rest if len(by_node[n]) >= need), key=lambda n: len(by_node[n]))
    others = sorted(
        (n for n in rest if n not in whole), key=lambda n: (-len(by_node[n]), n is None, n or 0)
    )
    chosen: list[str] = []
    for node in order + whole + others:
        chosen += by_node.get(node, [])[: need - len(chosen)]
        if len(chosen) == need:
            break
    return chosen


def _gpu_key(plan: SlicePlan, device_id: str) -> tuple[int, str]:
    gp = plan.for_gpu(gpu_of(device_id))
    return (gp.gpu.index if gp is not None else 1 << 30, device_id)
