"""SlicePlan: a pure function of (Inventory, Config) saying what each GPU advertises.

`build_plan` decides per GPU: mode, slices, resource name, enforcement, reclaimability, or why
it is not advertised. `merge_reload` keeps a GPU's old plan while it has live allocations;
`validate_against` runs the config checks that need GPUs. Everything else reads the plan.
Lost GPUs stay in the plan (health marks their slices Unhealthy), so IDs never vanish under
a running pod.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from functools import cached_property

from deviceplugin.config.settings import Config, GpuRule
from deviceplugin.inventory.gpus import Gpu, Inventory, NodeFacts
from deviceplugin.model import (
    MAX_LIST_AND_WATCH_BYTES,
    Enforcement,
    GpuUuid,
    Health,
    Mode,
    ResourceName,
    ServingApi,
    SliceId,
    slice_id,
)
from deviceplugin.quantity import format_quantity

# Reasons named by their first word in `skipped` and in enforcement failures.
NO_DRIVER_CDI_DEVICE = "no-driver-cdi-device"
HOOK_UNSUPPORTED = "hook-unsupported"


@dataclass(frozen=True)
class GpuPlan:
    gpu: Gpu
    mode: Mode
    resource: ResourceName
    slice_size: int  # bytes; for exclusive GPUs the usable memory
    reserved: int  # bytes held back
    usable: int  # bytes = total - reserved
    device_ids: tuple[SliceId, ...]  # empty when not advertised
    enforcement: tuple[Enforcement, ...]
    reclaimable: bool  # borrowed memory above a request can be reclaimed (DESIGN section 4)
    skipped: str | None = None  # why the GPU is not advertised, or None
    api: ServingApi = ServingApi.DEVICE_PLUGIN  # the one front-end that hands it out
    # The driver's CDI device answers name for it (qualified), once resolved on the node;
    # "": the toolkit's `<cdi.driverKind>=<uuid>`.
    driver_device: str = ""

    @property
    def advertised(self) -> bool:
        """Planned and handed out by its front-end (either API)."""
        return self.skipped is None and bool(self.device_ids)

    @property
    def device_plugin(self) -> bool:
        """Advertised through the device-plugin API (the dpapi servers, feed and Allocate)."""
        return self.advertised and self.api is ServingApi.DEVICE_PLUGIN

    @property
    def dra(self) -> bool:
        """Advertised through DRA (ResourceSlices, NodePrepareResources)."""
        return self.advertised and self.api is ServingApi.DRA

    @property
    def uuid(self) -> GpuUuid:
        return self.gpu.uuid

    @cached_property
    def id_set(self) -> frozenset[str]:
        """The device IDs as a set, for fast membership (computed once per plan)."""
        return frozenset(self.device_ids)


@dataclass(frozen=True)
class SlicePlan:
    gpus: tuple[GpuPlan, ...]
    resources: tuple[ResourceName, ...]  # device-plugin resource names served, stable order

    def for_resource(self, resource: str) -> tuple[GpuPlan, ...]:
        """The device-plugin GPUs serving `resource` (DRA GPUs never have a resource)."""
        return tuple(p for p in self.gpus if p.device_plugin and p.resource == resource)

    @property
    def dra_gpus(self) -> tuple[GpuPlan, ...]:
        return tuple(p for p in self.gpus if p.dra)

    def for_gpu(self, uuid: str) -> GpuPlan | None:
        return self._by_uuid.get(uuid)

    @cached_property
    def _by_uuid(self) -> dict[str, GpuPlan]:
        # Allocate looks up each requested ID's GPU: a dict, not a scan of every GPU.
        return {p.uuid: p for p in reversed(self.gpus)}  # the first of a UUID wins, as before

    def numa_node(self, uuid: str) -> int | None:
        """The GPU's NUMA node for device topology, or None for every GPU when any lacks one."""
        if any(p.gpu.numa_node is None for p in self.gpus):
            return None
        plan = self.for_gpu(uuid)
        return plan.gpu.numa_node if plan is not None else None


def rule_index(gpu: Gpu, config: Config) -> int | None:
    """Index of the first `gpus` entry matching `gpu`, or None (then defaultMode applies)."""
    for i, rule in enumerate(config.gpus):
        if rule.match.matches(gpu.index, gpu.uuid, gpu.name):
            return i
    return None


def cuda_limit_failures(node: NodeFacts, config: Config, ctk_present: bool) -> list[str]:
    """Unmet conditions for `cuda-memory-limits` (DESIGN section 2); empty when all hold."""
    failed: list[str] = []
    if not node.cuda_memory_limits:
        failed.append(f"driver {node.driver_version} has no CUDA memory limits (needs r615+)")
    if "cdi" not in config.device_list_strategy:
        failed.append("deviceListStrategy lacks cdi (the caps and hook need a CDI edit)")
    if not node.cgroup_v2:
        failed.append("node runs cgroup v1 (needs cgroup v2)")
    if not ctk_present:
        failed.append(f"no nvidia-ctk at {config.cdi.nvidia_ctk_path}")
    elif not node.memory_limits_hook:
        failed.append(
            f"{HOOK_UNSUPPORTED}: nvidia-ctk at {config.cdi.nvidia_ctk_path} has no "
            "`hook apply-cuda-memory-limits` (needs toolkit 1.20.1+)"
        )
    return failed


def build_plan(
    inventory: Inventory, config: Config, nvidia_ctk_present: bool | None = None
) -> SlicePlan:
    """Plan every GPU; `nvidia_ctk_present` overrides the inventory's node fact when given."""
    ctk = inventory.node.nvidia_ctk_present if nvidia_ctk_present is None else nvidia_ctk_present
    failures = cuda_limit_failures(inventory.node, config, ctk)
    plans = tuple(_plan_gpu(gpu, config, failures) for gpu in inventory.gpus)
    return SlicePlan(plans, _resources(plans))


def _resources(plans: tuple[GpuPlan, ...]) -> tuple[ResourceName, ...]:
    """Device-plugin resource names in mode order (time-slicing, sm-sharing, exclusive)."""
    modes = list(Mode)
    served = {(modes.index(p.mode), p.resource) for p in plans if p.device_plugin}
    return tuple(name for _, name in sorted(served))


def _plan_gpu(gpu: Gpu, config: Config, cuda_failures: list[str]) -> GpuPlan:
    i = rule_index(gpu, config)
    rule: GpuRule | None = config.gpus[i] if i is not None else None
    mode = rule.mode if rule is not None else config.default_mode
    api = rule.api if rule is not None and rule.api is not None else config.api
    resource = config.resource_names.for_mode(mode)
    if mode is Mode.EXCLUSIVE:
        # The whole GPU goes to one container: nothing is held back, nothing capped.
        total = gpu.memory_total
        ids: tuple[SliceId, ...] = () if gpu.mig_enabled else (SliceId(gpu.uuid),)
        skipped = "MIG enabled (MIG GPUs are not shared)" if gpu.mig_enabled else None
        return GpuPlan(gpu, mode, resource, total, 0, total, ids, (), False, skipped, api)

    size = (
        rule.slice_size if rule is not None and rule.slice_size is not None else config.slice_size
    )
    reserved = config.reserved_memory
    if rule is not None and rule.reserved_memory is not None:
        reserved = rule.reserved_memory
    usable = max(gpu.memory_total - reserved, 0)
    enforcement, reclaimable, skipped = _enforcement(mode, config, cuda_failures)
    if gpu.mig_enabled:
        skipped = "MIG enabled (MIG GPUs are not sliced)"
    elif usable < size and skipped is None:
        skipped = (
            f"sliceSize {format_quantity(size)} is larger than usable memory "
            f"{format_quantity(usable)} (total {format_quantity(gpu.memory_total)} - "
            f"reserved {format_quantity(reserved)})"
        )
    count = usable // size if skipped is None else 0
    ids = tuple(slice_id(gpu.uuid, n) for n in range(count))
    return GpuPlan(
        gpu, mode, resource, size, reserved, usable, ids, enforcement, reclaimable, skipped, api
    )


def _enforcement(
    mode: Mode, config: Config, cuda_failures: list[str]
) -> tuple[tuple[Enforcement, ...], bool, str | None]:
    """(enforcement, reclaimable, skipped reason) for a fractional GPU."""
    cuda_ok = not cuda_failures
    if mode is Mode.SM_SHARING:
        # Memory limits bind (and borrowed memory is reclaimable) only with protocol 3.
        with_cuda = cuda_ok and config.mps.protocol_version == 3
        enforcement: tuple[Enforcement, ...] = (Enforcement.MPS_PINNED_LIMIT,)
        if with_cuda:
            enforcement = (Enforcement.CUDA_MEMORY_LIMITS, Enforcement.MPS_PINNED_LIMIT)
        return enforcement, with_cuda, None
    if cuda_ok:
        return (Enforcement.CUDA_MEMORY_LIMITS,), False, None
    if config.enforcement == "required":
        reason = "enforcement required but cuda-memory-limits unavailable: " + "; ".join(
            cuda_failures
        )
        return (Enforcement.NONE,), False, reason
    return (Enforcement.NONE,), False, None


def serving_none_message(plan: SlicePlan) -> str | None:
    """Why the plan advertises nothing on this node (None when it advertises something)."""
    if any(g.advertised for g in plan.gpus):
        return None
    if not plan.gpus:
        return "serving no GPU slices: no GPU found on this node"
    reasons: dict[str, list[str]] = {}
    for g in plan.gpus:
        why = g.skipped or "no slices fit"
        reasons.setdefault(why, []).append(str(g.gpu.index))
    parts = [f"GPU {','.join(idx)}: {why}" for why, idx in reasons.items()]
    message = "serving no GPU slices: " + "; ".join(parts)
    if any(why.startswith("enforcement required") for why in reasons):
        message += (
            "; on drivers before r615 (e.g. r580) use sm-sharing or `enforcement: best-effort`"
            " (examples/r580.yaml)"
        )
    return message


def skip_gpus(plan: SlicePlan, reasons: Mapping[GpuUuid, str]) -> SlicePlan:
    """`plan` with the GPUs in `reasons` not advertised, for facts found after planning
    (an sm-sharing GPU whose shm dir cannot be mounted: `mps-shm-unavailable`)."""
    if not reasons:
        return plan
    gpus = tuple(
        replace(gp, device_ids=(), skipped=reasons[gp.uuid]) if gp.uuid in reasons else gp
        for gp in plan.gpus
    )
    return SlicePlan(gpus, _resources(gpus))


def missing_driver_devices(
    plan: SlicePlan, config: Config, known: Collection[str]
) -> dict[GpuUuid, str]:
    """Advertised GPUs whose `<cdi.driverKind>=<uuid>` is not among the `known` CDI devices,
    with the reason; under `cdi` an answer naming it would fail the container's start."""
    return resolve_driver_devices(plan, config, known)[1]


def resolve_driver_devices(
    plan: SlicePlan,
    config: Config,
    known: Collection[str],
    generated_kind: str = "",
    generation_error: str | None = None,
) -> tuple[SlicePlan, dict[GpuUuid, str]]:
    """Under `cdi`, the driver device each advertised GPU's answers name: the toolkit's
    `<cdi.driverKind>=<uuid>` where `known` has it, else the plugin's own
    `<generated_kind>=<uuid>` (GPU Operator nodes); the plan with each named, and the GPUs
    with neither, with the reason (and why generation failed, when it did)."""
    if "cdi" not in config.device_list_strategy:
        return plan, {}
    names: dict[GpuUuid, str] = {}
    missing: dict[GpuUuid, str] = {}
    for gp in plan.gpus:
        if not gp.advertised:
            continue
        toolkit = f"{config.cdi.driver_kind}={gp.uuid}"
        ours = f"{generated_kind}={gp.uuid}" if generated_kind else ""
        if toolkit in known:
            names[gp.uuid] = toolkit
        elif ours and ours in known:
            names[gp.uuid] = ours
        else:
            where = ", ".join(config.cdi.spec_dirs)
            why = f"{NO_DRIVER_CDI_DEVICE}: {toolkit} resolves in none of {where}"
            if generation_error is not None:
                why += f"; generating {generated_kind} failed: {generation_error}"
            elif ours:
                why += f"; nor does the generated {ours}"
            missing[gp.uuid] = why
    gpus = tuple(replace(gp, driver_device=names[gp.uuid]) if gp.uuid in names else gp
                 for gp in plan.gpus)  # fmt: skip
    return SlicePlan(gpus, plan.resources), missing


def merge_reload(
    old: SlicePlan, new: SlicePlan, allocated: Collection[GpuUuid]
) -> tuple[SlicePlan, list[GpuUuid]]:
    """The plan to serve after a reload, and the GPUs whose change waits for idle.

    A GPU with live allocations keeps its old plan when the new one would change its mode,
    resource, slice size or API, or drop any of its device IDs; the caller logs the held-back GPUs
    and merges again once they are idle.
    """
    held: list[GpuUuid] = []
    merged: list[GpuPlan] = []
    for plan in new.gpus:
        before = old.for_gpu(plan.uuid)
        if before is not None and plan.uuid in allocated and _disruptive(before, plan):
            held.append(plan.uuid)
            merged.append(replace(before, gpu=plan.gpu))
        else:
            merged.append(plan)
    gpus = tuple(merged)
    return SlicePlan(gpus, _resources(gpus)), held


# Kept under the brief's name too; the lead may call either.
devices_after_reload = merge_reload


def _disruptive(before: GpuPlan, after: GpuPlan) -> bool:
    if (before.mode, before.resource, before.slice_size, before.api) != (
        after.mode,
        after.resource,
        after.slice_size,
        after.api,
    ):
        return True
    return not set(before.device_ids) <= set(after.device_ids)


def list_and_watch_size(plan: SlicePlan, resource: ResourceName) -> int:
    """Bytes of the ListAndWatch message the plan's devices for `resource` make (all Healthy)."""
    from deviceplugin._pb import deviceplugin_v1beta1_pb2 as pb  # protobuf only for this check

    response = pb.ListAndWatchResponse()
    for gp in plan.for_resource(resource):
        numa = plan.numa_node(gp.uuid)
        for device_id in gp.device_ids:
            device = response.devices.add(ID=device_id, health=Health.HEALTHY.value)
            if numa is not None:
                device.topology.nodes.add(ID=numa)
    return int(response.ByteSize())


def validate_against(config: Config, inventory: Inventory) -> tuple[list[str], list[str]]:
    """(errors, warnings) for checks that need this node's GPUs, each `path: message`."""
    errors: list[str] = []
    warnings: list[str] = []
    for i, rule in enumerate(config.gpus):
        if not any(rule_index(g, config) == i for g in inventory.gpus):
            hit = any(rule.match.matches(g.index, g.uuid, g.name) for g in inventory.gpus)
            why = "an earlier entry matches first" if hit else "matches no GPU on this node"
            warnings.append(f"gpus[{i}].match: {rule.match.describe()} {why}")
    plan = build_plan(inventory, config)
    for gp in plan.gpus:
        if gp.mode is Mode.EXCLUSIVE or gp.gpu.mig_enabled:
            continue
        idx = rule_index(gp.gpu, config)
        own = config.gpus[idx] if idx is not None else None
        where = f"GPU {gp.gpu.index} ({gp.uuid}, {format_quantity(gp.gpu.memory_total)})"
        if gp.usable <= 0:
            path = _path(idx, "reservedMemory", own is not None and own.reserved_memory is not None)
            errors.append(f"{path}: {format_quantity(gp.reserved)} leaves nothing of {where}")
        elif gp.usable < gp.slice_size:
            path = _path(idx, "sliceSize", own is not None and own.slice_size is not None)
            errors.append(
                f"{path}: {format_quantity(gp.slice_size)} is larger than the usable memory "
                f"{format_quantity(gp.usable)} of {where}"
            )
        elif gp.skipped is not None:
            warnings.append(f"{where}: not advertised: {gp.skipped}")
    for resource in plan.resources:
        size = list_and_watch_size(plan, resource)
        if size > MAX_LIST_AND_WATCH_BYTES:
            count = sum(len(p.device_ids) for p in plan.for_resource(resource))
            errors.append(
                f"sliceSize: {resource} would advertise {count} devices in a {size}-byte "
                f"ListAndWatch message, over the {MAX_LIST_AND_WATCH_BYTES}-byte limit; "
                "use a larger sliceSize"
            )
    return errors, warnings


def _path(index: int | None, key: str, overridden: bool) -> str:
    """The config path that set a value: the matching `gpus` entry's override, or the top level."""
    return f"gpus[{index}].{key}" if overridden else key
