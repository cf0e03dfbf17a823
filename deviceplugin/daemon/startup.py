"""What the node agent starts from, and the steps startup (and a reload) runs before serving.

`RunOptions` and `Platform` are what the cli hands `Daemon`. `load_config` reads the config
file; `node_plan` makes the plan this node can serve (`checked_plan` against the inventory,
less the GPUs whose driver CDI device does not resolve and, by `with_mps_shm`, the sm-sharing
GPUs whose shm dir cannot be made), `log_plan` logs it; `restore_answers` makes what the
ledger's answers name exist again before the first Register; `freeze_heap` takes what startup
built out of the garbage collector's sight. `StartupError` is a runtime failure before
serving (exit 1).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deviceplugin.cdi import generated
from deviceplugin.cdi.generated import DriverSpecGenerator
from deviceplugin.cdi.registry import driver_devices
from deviceplugin.config import settings as config_mod
from deviceplugin.config.settings import Config, ConfigError
from deviceplugin.flags import DEFAULT_KUBELET_PLUGINS_DIR, DEFAULT_KUBELET_REGISTRY_DIR
from deviceplugin.inventory.gpus import Inventory, NodeFacts
from deviceplugin.ledger.replay import restore_cdi_specs
from deviceplugin.ledger.store import Ledger
from deviceplugin.model import GpuUuid, Mode
from deviceplugin.mps import shm
from deviceplugin.mps.layout import LayoutError
from deviceplugin.mps.shm import ShmState
from deviceplugin.plan import (
    SlicePlan,
    build_plan,
    missing_driver_devices,
    resolve_driver_devices,
    skip_gpus,
    validate_against,
)
from deviceplugin.plumbing import logs

LOG = logs.get("daemon")  # the daemon's lines, wherever their code lives


def freeze_heap() -> None:
    """Move what startup (or a reload) built, the plan's thousands of slice IDs above all,
    out of the garbage collector's sight: a full collection of that heap paused the event
    loop 25 ms (an Allocate's whole p99 budget many times over), and every later collection
    walked it again. What a reload makes garbage is unfrozen and collected first."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


class StartupError(Exception):
    """A runtime failure before serving (exit 1)."""


@dataclass(frozen=True)
class RunOptions:
    config_path: Path | None
    kubelet_dir: Path
    pod_resources_socket: Path
    state_dir: Path
    mps_root: Path
    cdi_dir: Path
    sysfs_root: Path
    node_name: str | None
    metrics_address: str
    environ: Mapping[str, str] = field(default_factory=dict)
    host_root: Path = Path("/")
    kubelet_plugins_dir: Path = Path(DEFAULT_KUBELET_PLUGINS_DIR)
    kubelet_registry_dir: Path = Path(DEFAULT_KUBELET_REGISTRY_DIR)
    dra_instance: str | None = None  # the pod's UID with rolling updates


@dataclass
class Platform:
    """What differs between a real node and a simulated one; the cli builds it.

    `node_facts` given: the simulation's spec (never the host's); `control_binary`: the MPS
    control binary to use instead of config's; `extras`: parts started after the daemon's own
    and stopped before them (the fault injector).
    """

    sysfs_root: Path | None = None
    node_facts: NodeFacts | None = None
    control_binary: str | None = None
    set_up: Callable[[Config], None] | None = None
    extras: Sequence[Any] = ()
    # The simulated node's CDI spec directories, used while the config keeps the default.
    spec_dirs: tuple[str, ...] | None = None
    # The simulated node's `nvidia-ctk`, run for `cdi generate` instead of cdi.nvidiaCtkPath.
    nvidia_ctk: str | None = None

    @property
    def simulated(self) -> bool:
        return self.node_facts is not None


def load_config(path: Path | None) -> Config:
    return Config() if path is None else config_mod.load(path)


def checked_plan(inventory: Inventory, config: Config) -> SlicePlan:
    errors, warnings = validate_against(config, inventory)
    for warning in warnings:
        logs.log(LOG, "config warning", level=logging.WARNING, problem=warning)
    if errors:
        raise ConfigError(errors)
    return build_plan(inventory, config)


def log_plan(plan: SlicePlan) -> None:
    for gp in plan.gpus:
        logs.log(
            LOG,
            "plan",
            gpu=gp.uuid,
            index=gp.gpu.index,
            mode=gp.mode.value,
            api=gp.api.value,
            resource=gp.resource,
            slices=len(gp.device_ids) if gp.advertised else 0,
            slice_mib=gp.slice_size // (1 << 20),
            enforcement=",".join(e.value for e in gp.enforcement) or "none",
            skipped=gp.skipped or "-",
        )


def node_plan(
    inventory: Inventory,
    config: Config,
    mps_root: Path,
    shm_states: dict[GpuUuid, ShmState],
    *,
    simulated: bool,
    generator: DriverSpecGenerator | None = None,
) -> tuple[SlicePlan, frozenset[str]]:
    """The plan less what this node cannot serve: GPUs whose driver CDI device does not
    resolve, sm-sharing GPUs without their shm dir; and the toolkit's CDI devices found.
    Where the toolkit's spec lacks a GPU's device, `generator` makes one of ours
    (`with_driver_devices`)."""
    plan = checked_plan(inventory, config)
    dirs = [Path(d) for d in config.cdi.spec_dirs]
    devices = driver_devices(dirs, config.cdi.driver_kind)
    plan, missing = with_driver_devices(plan, config, devices, inventory, generator)
    for gpu, why in missing.items():
        logs.log(LOG, "gpu not advertised", level=logging.WARNING, gpu=gpu, reason=why)
    plan = with_mps_shm(skip_gpus(plan, missing), config, mps_root, shm_states, simulated=simulated)
    return plan, devices


def with_driver_devices(
    plan: SlicePlan,
    config: Config,
    toolkit: frozenset[str],
    inventory: Inventory,
    generator: DriverSpecGenerator | None,
) -> tuple[SlicePlan, dict[GpuUuid, str]]:
    """`plan` with each GPU's driver device named, and the GPUs with none and why. The
    toolkit's devices first; only when some GPU lacks one does the generator run (GPU
    Operator nodes), so a host-installed toolkit's node never runs `cdi generate`."""
    if generator is None or not missing_driver_devices(plan, config, toolkit):
        return resolve_driver_devices(plan, config, toolkit)
    ours, error = generator.devices(
        config.cdi.nvidia_ctk_path,
        config.cdi.driver_root,
        config.cdi.dev_root,
        inventory.node.driver_version,
    )
    return resolve_driver_devices(plan, config, toolkit | ours, generated.KIND, error)


def with_mps_shm(
    plan: SlicePlan,
    config: Config,
    mps_root: Path,
    states: dict[GpuUuid, ShmState],
    *,
    simulated: bool,
) -> SlicePlan:
    """Make each sm-sharing GPU's pipe and shm dirs (mounting the shm tmpfs); a GPU whose
    shm cannot be mounted on a node is not advertised (`mps-shm-unavailable`). `states`
    holds each GPU's shm state (updated here; the MPS supervisor reads it)."""
    skipped: dict[GpuUuid, str] = {}
    for gp in plan.gpus:
        if gp.mode is not Mode.SM_SHARING or not gp.advertised:
            continue
        try:
            state, why = shm.ensure(
                mps_root,
                gp.uuid,
                config.mps.shm_size,
                simulated=simulated,
            )
        except (LayoutError, OSError) as exc:
            state, why = ShmState.UNAVAILABLE, str(exc)
        if states.get(gp.uuid) is not state:
            warn = state in (ShmState.HOST, ShmState.UNAVAILABLE)
            logs.log(LOG, "mps shm", level=logging.WARNING if warn else logging.INFO,
                     gpu=gp.uuid, state=state.value, detail=why)  # fmt: skip
        states[gp.uuid] = state
        if state is ShmState.UNAVAILABLE:
            skipped[gp.uuid] = shm.SKIP_REASON
    return skip_gpus(plan, skipped)


# ---- before the first Register: answers the kubelet may replay ----------------------------
def restore_answers(
    ledger: Ledger,
    plan: SlicePlan,
    cdi_dir: Path,
    wait_ready: Callable[[GpuUuid, float], bool],
    timeout: float = 60.0,
) -> None:
    """Make every answer the ledger still holds valid again, before the first Register.

    After a reboot the kubelet replays checkpointed Allocate answers without calling
    Allocate (DESIGN 3b), and /var/run/cdi is a tmpfs: what those answers name must exist
    before a container can start. Blocking; runs off the event loop.
    """
    _restore_cdi_specs(ledger, cdi_dir)
    _restore_mps(ledger, plan, wait_ready, timeout)


def _restore_cdi_specs(ledger: Ledger, cdi_dir: Path) -> None:
    """Rewrite the CDI spec of every allocation in the ledger (the ledger keeps each
    spec's body; the CDI dir may be a fresh tmpfs)."""
    restored, lost = restore_cdi_specs(ledger, cdi_dir)
    if restored or lost:
        logs.log(LOG, "cdi specs restored", count=restored, without_body=lost)


def _restore_mps(
    ledger: Ledger,
    plan: SlicePlan,
    wait_ready: Callable[[GpuUuid, float], bool],
    timeout: float = 60.0,
) -> None:
    """Recreate each sm-sharing GPU's pipe and shm directories and have the daemons of
    the GPUs that hold records serving.

    The dirs (and the shm tmpfs) were made when the plan was checked; the supervisor
    started its workers. Here: wait for the daemon of every sm-sharing GPU a record
    names, since a replayed container calls no Allocate that would start it.
    """
    in_use = ledger.gpus_in_use()
    deadline = time.monotonic() + timeout  # one wait for all: the daemons start in parallel
    for gp in plan.gpus:
        if gp.mode is not Mode.SM_SHARING or not gp.advertised or gp.uuid not in in_use:
            continue
        ready = wait_ready(gp.uuid, max(0.0, deadline - time.monotonic()))
        logs.log(
            LOG,
            "mps daemon restored" if ready else "mps daemon not ready before register",
            level=logging.INFO if ready else logging.WARNING,
            gpu=gp.uuid,
        )
