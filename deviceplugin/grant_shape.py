"""What every Allocate answer of one shape shares, worked out once per shape.

A shape is `count` slices of one GPU (or a set of whole GPUs) under one plan, one config and
one ceiling decision. Its caps, annotations, the edits of its CDI device (checked against
the CDI rules once) and its ledger fields are the same for every device set of that shape,
so an Allocate only adds what names its devices: the CDI device name and the record. The
kubelet asks for the same few shapes over and over (one pod template's size), and on its
reply path every step counts (DESIGN section 7). The DRA planner (`dra/claim_plan.py`)
keeps its claim shapes in the same `ShapeCache` and checks its CDI edits with the same
`checked_cdi_edits`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from deviceplugin import caps
from deviceplugin.cdi import specs as cdi_specs
from deviceplugin.config.settings import Config
from deviceplugin.model import MIB, Delivery, Enforcement, GpuUuid, Mode
from deviceplugin.plan import GpuPlan, SlicePlan

DeviceSpec = tuple[str, str, str]  # (container path, host path, cgroup permissions)
# (request MiB, limit MiB, enforcement, ceiling source, ceiling policy) of the ledger record
RecordFields = tuple[int | None, int | None, tuple[Enforcement, ...], str | None, str | None]
# Shapes kept per plan and config: far more than one node's pod templates ask for.
MAX_SHAPES = 1024
S = TypeVar("S")


@dataclass(frozen=True, eq=False)
class Shape:
    """One shape's answer but for its devices' names. Shared by every grant of the shape:
    read only, and compared and hashed by identity (the Allocate front-end keeps each
    shape's encoded answer by it)."""

    gpus: tuple[GpuUuid, ...]
    mode: Mode
    record_fields: RecordFields
    delivery: Delivery
    envs: dict[str, str]  # env handed to the kubelet (`envvar` strategy), else empty
    mounts: list[caps.Mount]  # likewise
    device_specs: list[DeviceSpec]
    annotations: dict[str, str]  # with their prefix
    driver_devices: tuple[str, ...]  # the driver's CDI devices, qualified
    cdi_edits: dict[str, Any] | None  # our CDI device's containerEdits; None: no device of ours
    cdi_version: str
    spec_parts: tuple[str, str]  # the spec's JSON text before and after the device's name

    def spec(self, name: str) -> dict[str, Any] | None:
        """Our CDI spec for the device `name` (a `cdi_specs.device_name`), None without one."""
        if self.cdi_edits is None:
            return None
        return cdi_specs.device_spec(name, self.cdi_edits, version=self.cdi_version)

    def spec_text(self, name: str) -> str:
        """`cdi_specs.encode_spec(self.spec(name))`, the shape's text around the name: the edits
        are encoded once per shape, not once per answer."""
        head, tail = self.spec_parts
        return head + json.dumps(name) + tail


def driver_device(config: Config, gp: GpuPlan) -> str:
    """The driver's CDI device an answer for `gp` names: the one the node resolved for it
    (the toolkit's, or the plugin's generated one on GPU Operator nodes), else the
    toolkit's `<cdi.driverKind>=<uuid>`."""
    return gp.driver_device or cdi_specs.qualified(config.cdi.driver_kind, gp.uuid)


def fractional(
    config: Config,
    gp: GpuPlan,
    mps_root: Path,
    count: int,
    declared: int | None,
    source: str | None,
    name: str,
) -> Shape:
    """`count` slices of `gp` (as `caps.reclaimable` judged it) under a declared ceiling
    (bytes, or None) from `source`; `name`: a CDI device name of this shape."""
    request = count * gp.slice_size
    ceiling = caps.apply_ceiling(config, gp, request, declared, source)
    threads = caps.proportional_threads(
        config.mps.active_thread_percentage, count, len(gp.device_ids)
    )
    edits = caps.fractional_edits(config, gp, mps_root, request, ceiling, threads)
    fields: RecordFields = (
        request // MIB,
        ceiling.limit // MIB,
        gp.enforcement,
        ceiling.source,
        ceiling.policy,
    )
    return _shape(config, (gp,), edits, fields, name)


def exclusive(config: Config, plans: tuple[GpuPlan, ...], name: str) -> Shape:
    return _shape(
        config, plans, caps.exclusive_edits(list(plans)), (None, None, (), None, None), name
    )


def _shape(
    config: Config,
    plans: tuple[GpuPlan, ...],
    edits: caps.ContainerEdits,
    fields: RecordFields,
    name: str,
) -> Shape:
    strategies = config.device_list_strategy
    env, mounts, hooks = edits.env, edits.mounts, edits.hooks
    annotations = dict(edits.annotations)
    delivery = Delivery.CDI if "cdi" in strategies else Delivery.ENV
    driver_devices: tuple[str, ...] = ()
    cdi_edits: dict[str, Any] | None = None
    version = ""
    parts = ("", "")
    if delivery is Delivery.CDI:
        driver_devices = tuple(driver_device(config, gp) for gp in plans)
        # Whole GPUs need nothing beyond the driver's devices (an edit-less device of ours
        # would be refused by the runtime).
        if cdi_specs.without_visible_devices(env) or mounts or hooks:
            cdi_edits, version = checked_cdi_edits(edits, name)
            parts = _text_around_name(cdi_specs.device_spec(_NAME_MARK, cdi_edits, version=version))
    plain = delivery is Delivery.ENV or "envvar" in strategies
    device_specs: list[DeviceSpec] = []
    if "device-nodes" in strategies:
        nodes = [f"/dev/nvidia{gp.gpu.minor}" for gp in plans] + list(caps.CONTROL_DEVICE_NODES)
        device_specs = [(n, n, "rw") for n in nodes]
    if plans[0].mode is not Mode.EXCLUSIVE:
        annotations["delivery"] = delivery.value
    return Shape(
        gpus=tuple(gp.uuid for gp in plans),
        mode=plans[0].mode,
        record_fields=fields,
        delivery=delivery,
        envs=dict(env) if plain else {},
        mounts=list(mounts) if plain else [],
        device_specs=device_specs,
        annotations={caps.ANNOTATION_PREFIX + k: v for k, v in annotations.items()},
        driver_devices=driver_devices,
        cdi_edits=cdi_edits,
        cdi_version=version,
        spec_parts=parts,
    )


_NAME_MARK = "\x00name\x00"  # never in a CDI device name


def _text_around_name(spec: dict[str, Any]) -> tuple[str, str]:
    head, mark, tail = cdi_specs.encode_spec(spec).partition(json.dumps(_NAME_MARK))
    if not mark:
        raise AssertionError("the device name's marker is missing from the spec's text")
    return head, tail


def checked_cdi_edits(
    edits: caps.ContainerEdits, name: str, kind: str = cdi_specs.KIND
) -> tuple[dict[str, Any], str]:
    """`edits` as a CDI device's `containerEdits`, checked against the CDI rules in a spec
    of `kind` with the device `name`, and that spec's cdiVersion; raises CdiError. Both
    front-ends' CDI devices are built here, once per shape."""
    cdi_mounts = [cdi_specs.CdiMount(host, ctr, ro) for ctr, host, ro in edits.mounts]
    cdi_edits = cdi_specs.container_edits(edits.env, cdi_mounts, edits.hooks)
    spec = cdi_specs.device_spec(name, cdi_edits, kind)
    problems = cdi_specs.validate_spec(spec)
    if problems:
        raise cdi_specs.CdiError("; ".join(problems))
    return cdi_edits, spec["cdiVersion"]


class ShapeCache(Generic[S]):
    """Shapes by key for the plan and config they were worked out under: a new plan or
    config object (a reload, a health change that rebuilt the plan) starts afresh."""

    def __init__(self, limit: int = MAX_SHAPES) -> None:
        self._limit = limit
        self._plan: SlicePlan | None = None
        self._config: Config | None = None
        self._shapes: dict[Hashable, S] = {}

    def get(self, plan: SlicePlan, config: Config, key: Hashable, build: Callable[[], S]) -> S:
        if plan is not self._plan or config is not self._config:
            self._plan, self._config, self._shapes = plan, config, {}
        shape = self._shapes.get(key)
        if shape is None:
            shape = build()
            if len(self._shapes) >= self._limit:
                self._shapes = {}
            self._shapes[key] = shape
        return shape
