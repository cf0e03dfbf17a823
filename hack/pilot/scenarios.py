"""The pilot's scenarios: the pods, the plugin caps they get, and what is compared.

Shared scenarios put both services on GPU 0 of the simulated `h200x2` node; the dedicated one
gives each its own GPU (`nvidia.com/gpu: 1`). Fault scenarios inject one Xid, classified by
the plugin's own Xid lists, and use the plugin's quiet period.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deviceplugin.config.settings import Config
from deviceplugin.model import Mode
from deviceplugin.plan import build_plan
from pilot.caps import CEILING_ANNOTATION, ServiceCaps, caps_for_pod, plugin_config_for
from pilot.caps import simulated_inventory as inventory
from pilot.sim import (
    ComputeModel,
    Fault,
    FaultKind,
    Policy,
    RecoveryModel,
    Scenario,
    ScenarioResult,
    Sharing,
    Tenant,
    simulate,
)
from pilot.workload import CHAT, RAG, ServiceSpec, Timeline

SERVICES: tuple[ServiceSpec, ...] = (CHAT, RAG)
SLICES = 64  # each service's reservation, in the plugin's default 1 GiB slices
CEILING = "96Gi"  # each service's declared ceiling


def pod(name: str, resource: str, count: int, ceiling: str | None) -> dict[str, Any]:
    """A pod manifest as a user writes it: one container with the plugin's resource limit."""
    annotations = {}
    if ceiling is not None:
        annotations[CEILING_ANNOTATION.format(container="server")] = ceiling
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations},
        "spec": {
            "containers": [
                {"name": "server", "resources": {"limits": {resource: count}}},
            ]
        },
    }


@dataclass(frozen=True)
class Arrangement:
    sharing: Sharing
    config: Config
    caps: tuple[ServiceCaps, ...]


def arrangement(sharing: Sharing, ceilings: str = "allow-overcommit") -> Arrangement:
    """Plugin config, plan and caps for the two services' pods under one way of sharing."""
    mode = {
        Sharing.DEDICATED: Mode.EXCLUSIVE,
        Sharing.SM_SHARING: Mode.SM_SHARING,
        Sharing.TIME_SLICING: Mode.TIME_SLICING,
    }[sharing]
    cfg = plugin_config_for(mode, ceilings)
    plan = build_plan(inventory(), cfg)
    resource = cfg.resource_names.for_mode(mode)
    if sharing is Sharing.DEDICATED:
        pods = [pod(s.name, resource, 1, None) for s in SERVICES]
    else:
        pods = [pod(s.name, resource, SLICES, CEILING) for s in SERVICES]
    return Arrangement(sharing, cfg, tuple(caps_for_pod(p, plan, cfg) for p in pods))


def classify_xid(xid: int, cfg: Config) -> FaultKind:
    """Application Xids stay in their own fault domain; everything else is reset-class."""
    if xid in cfg.health.application_xids:
        return FaultKind.APPLICATION
    return FaultKind.GPU_RESET  # reset, reboot and unknown Xids (DESIGN section 5)


def build(
    name: str,
    title: str,
    arr: Arrangement,
    policy: Policy,
    timeline: Timeline,
    xid: int | None = None,
    stress: float = 1.0,
    note: str = "",
) -> Scenario:
    dedicated = arr.sharing is Sharing.DEDICATED
    tenants = tuple(
        Tenant(spec, c.request_mib, c.limit_mib, gpu=i if dedicated else 0)
        for i, (spec, c) in enumerate(zip(SERVICES, arr.caps, strict=True))
    )
    gpus = len(tenants) if dedicated else 1
    fault = None
    if xid is not None:
        fault = Fault(timeline.fault_s, xid, classify_xid(xid, arr.config), 0)
    return Scenario(
        name=name,
        title=title,
        sharing=arr.sharing,
        policy=policy,
        tenants=tenants,
        gpu_usable_mib=(arr.caps[0].gpu_usable_mib,) * gpus,
        gpu_total_mib=arr.caps[0].gpu_total_mib,
        timeline=timeline,
        fault=fault,
        stress=stress,
        note=note,
    )


@dataclass(frozen=True)
class PilotRun:
    contention: tuple[ScenarioResult, ...]
    faults: tuple[ScenarioResult, ...]
    sweep: tuple[tuple[float, ScenarioResult, ScenarioResult], ...]  # (stress, dedicated, shared)
    arrangements: tuple[Arrangement, ...]
    compute: ComputeModel
    recovery: RecoveryModel
    seed: int


def run_pilot(
    seed: int = 7,
    timeline: Timeline | None = None,
    sweep: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0, 1.25),
    sweep_timeline: Timeline | None = None,
) -> PilotRun:
    tl = timeline or Timeline()
    compute = ComputeModel()
    ded = arrangement(Sharing.DEDICATED)
    mps = arrangement(Sharing.SM_SHARING)
    ts = arrangement(Sharing.TIME_SLICING)
    mps_default = arrangement(Sharing.SM_SHARING, ceilings="reclaimable-only")
    recovery = RecoveryModel(quiet_period_s=mps.config.health.quiet_period)

    def go(sc: Scenario) -> ScenarioResult:
        return simulate(sc, seed, compute, recovery)

    contention = tuple(
        go(sc)
        for sc in (
            build("dedicated", "Dedicated: one H200 per service", ded, Policy.QUEUE, tl),
            build("shared-shed", "Shared (MPS), policy shed", mps, Policy.SHED, tl),
            build("shared-queue", "Shared (MPS), policy queue", mps, Policy.QUEUE, tl),
            build("shared-refuse", "Shared (MPS), policy refuse", mps, Policy.REFUSE, tl),
            build("shared-ts-queue", "Shared (time-slicing), policy queue", ts, Policy.QUEUE, tl),
            build(
                "shared-nobor-queue",
                "Shared (MPS), plugin default ceilings (no borrowing), policy queue",
                mps_default,
                Policy.QUEUE,
                tl,
            ),
        )
    )
    faults = tuple(
        go(sc)
        for sc in (
            build(
                "fault79-dedicated", "Xid 79 on chat's GPU, dedicated", ded, Policy.QUEUE, tl, 79
            ),
            build("fault79-shared", "Xid 79 on the shared GPU (MPS)", mps, Policy.QUEUE, tl, 79),
            build("fault31-shared", "Xid 31 by chat, shared (MPS)", mps, Policy.QUEUE, tl, 31),
            build("fault31-ts", "Xid 31 by chat, shared (time-slicing)", ts, Policy.QUEUE, tl, 31),
        )
    )
    stl = sweep_timeline or tl
    points = tuple(
        (
            s,
            go(build(f"sweep-ded-{s}", "", ded, Policy.QUEUE, stl, stress=s)),
            go(build(f"sweep-mps-{s}", "", mps, Policy.QUEUE, stl, stress=s)),
        )
        for s in sweep
    )
    return PilotRun(
        contention, faults, points, (ded, mps, ts, mps_default), compute, recovery, seed
    )
