"""The plugin's one typed config: frozen dataclasses, loaded and validated in one place.

`load(path)` / `parse(data)` return a `Config` or raise `ConfigError` listing every bad field by
its path (`gpus[1].mode: …`). `SCHEMA` (schema.py) describes every key once: the parser
rejects keys it does not list and `hack/gen-config-docs.py` renders `docs/config.md` from it.
The per-value checks are in checks.py; this module assembles the sections from them and
is the one import path for the config's public names. Checks that need GPUs live in
`plan.validate_against`. Only this module reads config files. Over 400 lines on purpose: one
frozen dataclass per config section, under the one import path.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from deviceplugin.config import checks
from deviceplugin.config.checks import Problems
from deviceplugin.config.schema import (
    CEILING_CHOICES,
    DEFAULT_APPLICATION_XIDS,
    DEFAULT_REBOOT_XIDS,
    DEFAULT_RESET_XIDS,
    ENFORCEMENT_CHOICES,
    LAUNCHER_CHOICES,
    LAUNCHER_DIRECT,
    LAUNCHER_HOST_SYSTEMD,
    MAX_MPS_CLIENTS,
    MODE_CHOICES,
    SCHEMA,
    TAINT_EFFECT_CHOICES,
    Key,
)
from deviceplugin.model import GIB, MIB, Mode, ResourceName, ServingApi

__all__ = [
    "DEFAULT_APPLICATION_XIDS",
    "DEFAULT_REBOOT_XIDS",
    "DEFAULT_RESET_XIDS",
    "LAUNCHER_DIRECT",
    "LAUNCHER_HOST_SYSTEMD",
    "SCHEMA",
    "CdiConfig",
    "Config",
    "ConfigError",
    "DraConfig",
    "GpuMatch",
    "GpuRule",
    "HealthConfig",
    "Key",
    "MetricsConfig",
    "MpsConfig",
    "ResourceNames",
    "load",
    "parse",
    "with_control_binary",
    "with_spec_dirs",
]


class ConfigError(Exception):
    """A config that failed validation; `problems` holds one `path: message` per bad field."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


@dataclass(frozen=True)
class GpuMatch:
    index: int | None = None
    uuid: str | None = None
    product: str | None = None

    def matches(self, index: int, uuid: str, product: str) -> bool:
        """Exactly one field is set; product compares case-insensitively and whole."""
        if self.index is not None:
            return self.index == index
        if self.uuid is not None:
            return self.uuid == uuid
        return self.product is not None and self.product.casefold() == product.casefold()

    def describe(self) -> str:
        if self.index is not None:
            return f"index={self.index}"
        if self.uuid is not None:
            return f"uuid={self.uuid}"
        return f"product={self.product}"


@dataclass(frozen=True)
class GpuRule:
    match: GpuMatch
    mode: Mode
    slice_size: int | None = None  # bytes
    reserved_memory: int | None = None  # bytes
    api: ServingApi | None = None  # None: the top-level `api`


@dataclass(frozen=True)
class ResourceNames:
    # NewType calls are identity functions at run time; RUF009 does not know that.
    time_slicing: ResourceName = ResourceName("nvidia.com/gpu-fraction")  # noqa: RUF009
    sm_sharing: ResourceName = ResourceName("nvidia.com/gpu-fraction.sm-sharing")  # noqa: RUF009
    exclusive: ResourceName = ResourceName("nvidia.com/gpu")  # noqa: RUF009

    def for_mode(self, mode: Mode) -> ResourceName:
        return {
            Mode.TIME_SLICING: self.time_slicing,
            Mode.SM_SHARING: self.sm_sharing,
            Mode.EXCLUSIVE: self.exclusive,
        }[mode]


@dataclass(frozen=True)
class CdiConfig:
    driver_kind: str = "nvidia.com/gpu"
    nvidia_ctk_path: str = "/usr/bin/nvidia-ctk"
    driver_root: str = "/"
    # Where the driver's /dev is (`nvidia-ctk cdi generate --dev-root`, GPU Operator nodes).
    dev_root: str = "/"
    # Where the runtime reads CDI specs; a GPU is advertised under `cdi` only when the
    # driver's device for it resolves there.
    spec_dirs: tuple[str, ...] = ("/etc/cdi", "/var/run/cdi")


@dataclass(frozen=True)
class HealthConfig:
    ignored_xids: tuple[int, ...] = ()
    application_xids: tuple[int, ...] = DEFAULT_APPLICATION_XIDS
    reset_xids: tuple[int, ...] = DEFAULT_RESET_XIDS
    reboot_xids: tuple[int, ...] = DEFAULT_REBOOT_XIDS
    quiet_period: float = 30.0  # seconds


@dataclass(frozen=True)
class MpsConfig:
    control_binary: str = "nvidia-cuda-mps-control"
    protocol_version: int = 2
    set_compute_mode: bool = True
    # 1..100, or None for "proportional" (the container's share of the GPU's slices)
    active_thread_percentage: int | None = 100
    max_clients: int = 48
    launcher: str = "direct"  # LAUNCHER_CHOICES
    host_binary: str | None = None  # host-systemd: the binary's path on the host; None = same
    shm_size: int = 8 * GIB  # the per-GPU tmpfs that is the daemon's and its clients' /dev/shm
    probe_interval: float = 5.0  # seconds between liveness probes
    probe_failures: int = 3  # failed probes in a row that make a wedge
    max_log_bytes: int = 8 * MIB  # per GPU, under <mps-root>/<uuid>/log
    # The daemon's default pinned limit in bytes; None = largest-share (the usable memory)
    default_pinned_memory_limit: int | None = None


@dataclass(frozen=True)
class DraConfig:
    # The effect of the taint an unhealthy DRA device carries (DESIGN section 10).
    unhealthy_taint_effect: str = "NoSchedule"


@dataclass(frozen=True)
class MetricsConfig:
    pod_labels: bool = False  # namespace/pod/container on the allocation gauges


@dataclass(frozen=True)
class Config:
    version: str = "v1"
    slice_size: int = GIB
    reserved_memory: int = GIB
    default_mode: Mode = Mode.TIME_SLICING
    resource_names: ResourceNames = field(default_factory=ResourceNames)
    gpus: tuple[GpuRule, ...] = ()
    enforcement: str = "required"  # required | best-effort
    ceilings: str = "reclaimable-only"  # reclaimable-only | allow-overcommit
    device_list_strategy: tuple[str, ...] = ("cdi",)  # cdi | envvar | device-nodes
    cdi: CdiConfig = field(default_factory=CdiConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    mps: MpsConfig = field(default_factory=MpsConfig)
    api: ServingApi = ServingApi.DEVICE_PLUGIN
    dra: DraConfig = field(default_factory=DraConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)


# ---------------------------------------------------------------------------------------------
# Loading.


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML silently keeps the last)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if isinstance(key, str) and key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,
)


def load(path: Path) -> Config:
    """Read and validate a YAML config file; raises ConfigError (also for I/O and YAML errors)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError([f"{path}: cannot read: {e.strerror or e}"]) from None
    except UnicodeDecodeError:
        raise ConfigError([f"{path}: not UTF-8 text"]) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigError([f"{path}: invalid YAML: {_one_line(str(e))}"]) from None
    return parse(data)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def parse(data: object) -> Config:
    """Validate decoded YAML; raises ConfigError naming every bad field."""
    problems = Problems()
    top = problems.mapping(data, "", SCHEMA)
    if top is None:
        raise ConfigError(problems.items)
    if "version" not in top:
        problems.add("version", "required; set `version: v1`")
    elif top["version"] != "v1":
        problems.add("version", f"must be v1, not {top['version']!r}")

    slice_size = problems.get(top, "sliceSize", GIB, checks.slice_size)
    reserved = problems.get(top, "reservedMemory", GIB, checks.reserved)
    default_mode = problems.get(top, "defaultMode", Mode.TIME_SLICING, checks.mode)
    names = _resource_names(problems, top.get("resourceNames"))
    gpus = _gpu_rules(problems, top.get("gpus", []))
    enforcement = problems.get(top, "enforcement", "required", checks.choice(ENFORCEMENT_CHOICES))
    ceilings = problems.get(top, "ceilings", "reclaimable-only", checks.choice(CEILING_CHOICES))
    strategy: tuple[str, ...] = problems.get(top, "deviceListStrategy", ("cdi",), checks.strategies)
    cdi = _cdi(problems, top.get("cdi"))
    health = _health(problems, top.get("health"))
    mps = _mps(problems, top.get("mps"))
    api = problems.get(top, "api", ServingApi.DEVICE_PLUGIN, checks.api)
    dra = _dra(problems, top.get("dra"))
    metrics = _metrics(problems, top.get("metrics"))
    if problems.items:
        raise ConfigError(problems.items)
    return Config(
        version="v1",
        slice_size=slice_size,
        reserved_memory=reserved,
        default_mode=default_mode,
        resource_names=names,
        gpus=gpus,
        enforcement=enforcement,
        ceilings=ceilings,
        device_list_strategy=strategy,
        cdi=cdi,
        health=health,
        mps=mps,
        api=api,
        dra=dra,
        metrics=metrics,
    )


def _section(problems: Problems, value: object, name: str) -> dict[str, Any] | None:
    keys = next(k.children for k in SCHEMA if k.name == name)
    return problems.mapping(value, name, keys)


def _resource_names(problems: Problems, value: object) -> ResourceNames:
    d = ResourceNames()
    section = _section(problems, value, "resourceNames")
    if section is None:
        return d
    p = "resourceNames."
    names = ResourceNames(
        time_slicing=problems.check(
            section, "timeSlicing", d.time_slicing, checks.resource_name, p
        ),
        sm_sharing=problems.check(section, "smSharing", d.sm_sharing, checks.resource_name, p),
        exclusive=problems.check(section, "exclusive", d.exclusive, checks.resource_name, p),
    )
    seen: dict[str, str] = {}
    for key, name in (
        ("timeSlicing", names.time_slicing),
        ("smSharing", names.sm_sharing),
        ("exclusive", names.exclusive),
    ):
        if name in seen:
            problems.add(f"{p}{key}", f"same name as {p}{seen[name]}; the three must differ")
        seen.setdefault(name, key)
    return names


def _cdi(problems: Problems, value: object) -> CdiConfig:
    d = CdiConfig()
    section = _section(problems, value, "cdi")
    if section is None:
        return d
    p = "cdi."
    return CdiConfig(
        driver_kind=problems.check(section, "driverKind", d.driver_kind, checks.cdi_kind, p),
        nvidia_ctk_path=problems.check(
            section, "nvidiaCtkPath", d.nvidia_ctk_path, checks.abs_path, p
        ),
        driver_root=problems.check(section, "driverRoot", d.driver_root, checks.abs_path, p),
        dev_root=problems.check(section, "devRoot", d.dev_root, checks.abs_path, p),
        spec_dirs=problems.check(section, "specDirs", d.spec_dirs, checks.abs_paths, p),
    )


def _dra(problems: Problems, value: object) -> DraConfig:
    d = DraConfig()
    section = _section(problems, value, "dra")
    if section is None:
        return d
    effect = checks.choice(TAINT_EFFECT_CHOICES)
    return DraConfig(
        unhealthy_taint_effect=problems.check(
            section, "unhealthyTaintEffect", d.unhealthy_taint_effect, effect, "dra."
        ),
    )


def _metrics(problems: Problems, value: object) -> MetricsConfig:
    d = MetricsConfig()
    section = _section(problems, value, "metrics")
    if section is None:
        return d
    return MetricsConfig(
        pod_labels=problems.check(section, "podLabels", d.pod_labels, checks.boolean, "metrics."),
    )


def _health(problems: Problems, value: object) -> HealthConfig:
    d = HealthConfig()
    section = _section(problems, value, "health")
    if section is None:
        return d
    p = "health."
    return HealthConfig(
        ignored_xids=problems.check(section, "ignoredXids", d.ignored_xids, checks.xid_list, p),
        application_xids=problems.check(
            section, "applicationXids", d.application_xids, checks.xid_list, p
        ),
        reset_xids=problems.check(section, "resetXids", d.reset_xids, checks.xid_list, p),
        reboot_xids=problems.check(section, "rebootXids", d.reboot_xids, checks.xid_list, p),
        quiet_period=problems.check(section, "quietPeriod", d.quiet_period, checks.duration, p),
    )


def _mps(problems: Problems, value: object) -> MpsConfig:
    d = MpsConfig()
    section = _section(problems, value, "mps")
    if section is None:
        return d
    p = "mps."

    def protocol(v: object) -> int:
        if v not in (2, 3) or isinstance(v, bool):
            raise ValueError("must be 2 or 3")
        return int(v)

    return MpsConfig(
        control_binary=problems.check(section, "controlBinary", d.control_binary, checks.string, p),
        protocol_version=problems.check(
            section, "protocolVersion", d.protocol_version, protocol, p
        ),
        set_compute_mode=problems.check(
            section, "setComputeMode", d.set_compute_mode, checks.boolean, p
        ),
        active_thread_percentage=problems.check(
            section, "activeThreadPercentage", d.active_thread_percentage, checks.active_threads, p
        ),
        max_clients=problems.check(
            section, "maxClients", d.max_clients, checks.integer(1, MAX_MPS_CLIENTS), p
        ),
        launcher=problems.check(
            section, "launcher", d.launcher, checks.choice(LAUNCHER_CHOICES), p
        ),
        host_binary=problems.check(section, "hostBinary", d.host_binary, checks.string, p),
        shm_size=problems.check(section, "shmSize", d.shm_size, checks.positive_quantity, p),
        probe_interval=problems.check(
            section, "probeInterval", d.probe_interval, checks.positive_duration, p
        ),
        probe_failures=problems.check(
            section, "probeFailures", d.probe_failures, checks.integer(1, 100), p
        ),
        max_log_bytes=problems.check(
            section, "maxLogBytes", d.max_log_bytes, checks.positive_quantity, p
        ),
        default_pinned_memory_limit=problems.check(
            section,
            "defaultPinnedMemoryLimit",
            d.default_pinned_memory_limit,
            checks.pinned_default,
            p,
        ),
    )


_GPU_KEYS = next(k.children for k in SCHEMA if k.name == "gpus")
_MATCH_KEYS = (Key("index", "", None, ""), Key("uuid", "", None, ""), Key("product", "", None, ""))


def _gpu_rules(problems: Problems, value: object) -> tuple[GpuRule, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        problems.add("gpus", "must be a list of {match, mode, sliceSize?, reservedMemory?, api?}")
        return ()
    rules: list[GpuRule] = []
    seen: dict[GpuMatch, int] = {}
    for i, item in enumerate(value):
        p = f"gpus[{i}]"
        entry = problems.mapping(item, p, _GPU_KEYS)
        if entry is None:
            continue
        match = _gpu_match(problems, entry.get("match"), f"{p}.match")
        if "mode" not in entry:
            problems.add(f"{p}.mode", f"required; one of {', '.join(MODE_CHOICES)}")
        mode = problems.check(entry, "mode", Mode.TIME_SLICING, checks.mode, f"{p}.")
        slice_size = problems.check(entry, "sliceSize", None, checks.slice_size, f"{p}.")
        reserved = problems.check(entry, "reservedMemory", None, checks.reserved, f"{p}.")
        api = problems.check(entry, "api", None, checks.api, f"{p}.")
        if match is None:
            continue
        if match in seen:
            problems.add(f"{p}.match", f"same match as gpus[{seen[match]}].match")
        seen.setdefault(match, i)
        rules.append(GpuRule(match, mode, slice_size, reserved, api))
    return tuple(rules)


def _gpu_match(problems: Problems, value: object, path: str) -> GpuMatch | None:
    if value is None:
        problems.add(path, "required; one of index, uuid, product")
        return None
    section = problems.mapping(value, path, _MATCH_KEYS)
    if section is None:
        return None
    if len(section) != 1:
        if len(value) == len(section):  # type: ignore[arg-type]
            problems.add(path, "must name exactly one of index, uuid, product")
        return None
    ((key, item),) = section.items()
    if key == "index":
        try:
            return GpuMatch(index=checks.integer(0, 1023)(item))
        except ValueError as e:
            problems.add(f"{path}.index", str(e))
            return None
    try:
        text = checks.string(item)
    except ValueError as e:
        problems.add(f"{path}.{key}", str(e))
        return None
    return GpuMatch(uuid=text) if key == "uuid" else GpuMatch(product=text)


def with_spec_dirs(config: Config, dirs: tuple[str, ...]) -> Config:
    """`config` reading CDI specs from `dirs` (a simulated node's own directories)."""
    return replace(config, cdi=replace(config.cdi, spec_dirs=dirs))


def with_control_binary(config: Config, binary: str) -> Config:
    """`config` with MPS control commands run through `binary` (a simulated node's fake), and
    daemons started from it directly, unless `host-systemd` names the host's own binary
    (`hostBinary`): a simulated node with an init system (the cluster suite's) starts that."""
    host = config.mps.launcher == LAUNCHER_HOST_SYSTEMD and config.mps.host_binary is not None
    launcher = config.mps.launcher if host else LAUNCHER_DIRECT
    mps = replace(config.mps, control_binary=binary, launcher=launcher)
    return replace(config, mps=mps)
