"""The plugin's one typed config: frozen dataclasses, loaded and validated in one place.

`load(path)` / `parse(data)` return a `Config` or raise `ConfigError` listing every bad field by
its path (`gpus[1].mode: …`). `SCHEMA` describes every key once: the parser rejects keys it
does not list and `hack/gen-config-docs.py` renders `docs/config.md` from it. Checks that need
GPUs live in `plan.validate_against`. Only this module reads config files.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import yaml

from deviceplugin.model import GIB, MIB, Mode, ResourceName, ServingApi
from deviceplugin.quantity import QuantityError, parse_quantity


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
    # Where the runtime reads CDI specs; a GPU is advertised under `cdi` only when the
    # driver's device for it resolves there.
    spec_dirs: tuple[str, ...] = ("/etc/cdi", "/var/run/cdi")


# Xid classes: reference/nvml-mps-xid.md section 4; DESIGN section 5.
DEFAULT_APPLICATION_XIDS: tuple[int, ...] = (13, 31, 43, 45, 68, 69, 94)
DEFAULT_RESET_XIDS: tuple[int, ...] = (
    46, 48, 62, 64, 95, 109, 110, 119, 120, 136, 140, 143, 155, 158,
)  # fmt: skip
DEFAULT_REBOOT_XIDS: tuple[int, ...] = (79, 160)


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


TAINT_EFFECT_CHOICES = ("NoSchedule", "NoExecute")


@dataclass(frozen=True)
class DraConfig:
    # The effect of the taint an unhealthy DRA device carries (DESIGN section 10).
    unhealthy_taint_effect: str = "NoSchedule"


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


ENFORCEMENT_CHOICES = ("required", "best-effort")
CEILING_CHOICES = ("reclaimable-only", "allow-overcommit")
STRATEGY_CHOICES = ("cdi", "envvar", "device-nodes")
MODE_CHOICES = tuple(m.value for m in Mode)
API_CHOICES = tuple(a.value for a in ServingApi)
MAX_MPS_CLIENTS = 48  # Volta and newer (reference/nvml-mps-xid.md)
LAUNCHER_DIRECT = "direct"
LAUNCHER_HOST_SYSTEMD = "host-systemd"
LAUNCHER_CHOICES = (LAUNCHER_DIRECT, LAUNCHER_HOST_SYSTEMD)


# ---------------------------------------------------------------------------------------------
# Schema: every key once, for the parser's unknown-key check and for docs/config.md.


@dataclass(frozen=True)
class Key:
    name: str
    type: str
    default: str | None  # the default as YAML text; None when there is none
    doc: str
    children: tuple[Key, ...] = ()


def _xids(values: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


SCHEMA: tuple[Key, ...] = (
    Key("version", "string", None, "Required. The config format version; only `v1` exists."),
    Key(
        "sliceSize",
        "quantity",
        "1Gi",
        "Memory per advertised slice. A whole number of MiB, greater than zero.",
    ),
    Key("reservedMemory", "quantity", "1Gi", "Memory held back per GPU; usable = total - this."),
    Key("defaultMode", "mode", "time-slicing", "Mode of GPUs no `gpus` entry matches."),
    Key(
        "resourceNames",
        "mapping",
        None,
        "Extended resource name per mode; the three must differ.",
        (
            Key("timeSlicing", "string", "nvidia.com/gpu-fraction", "Time-slicing slices."),
            Key(
                "smSharing",
                "string",
                "nvidia.com/gpu-fraction.sm-sharing",
                "Sm-sharing (MPS) slices.",
            ),
            Key("exclusive", "string", "nvidia.com/gpu", "Whole GPUs."),
        ),
    ),
    Key(
        "gpus",
        "list",
        "[]",
        "Per-GPU rules; the first entry whose `match` fits a GPU wins. An entry that matches "
        "no GPU of a node is a warning (one config serves nodes of different sizes).",
        (
            Key(
                "match",
                "mapping",
                None,
                "Required. Exactly one of `index` (integer), `uuid` (string) or `product` "
                "(the NVML product name, compared whole and case-insensitively).",
            ),
            Key("mode", "mode", None, "Required. `time-slicing`, `sm-sharing` or `exclusive`."),
            Key("sliceSize", "quantity", None, "Overrides the top-level `sliceSize`."),
            Key("reservedMemory", "quantity", None, "Overrides the top-level `reservedMemory`."),
            Key("api", "string", None, "Overrides the top-level `api` for this GPU."),
        ),
    ),
    Key(
        "api",
        "string",
        "device-plugin",
        "Which Kubernetes API hands GPUs out: `device-plugin` (extended resources through the "
        "kubelet's device-plugin API) or `dra` (ResourceSlices and claims through Dynamic "
        "Resource Allocation; needs API credentials and a node name). Each GPU is served by "
        "exactly one of them.",
    ),
    Key(
        "dra",
        "mapping",
        None,
        "DRA settings (GPUs with `api: dra`).",
        (
            Key(
                "unhealthyTaintEffect",
                "string",
                "NoSchedule",
                "Effect of the taint `gpu-fraction.dev/unhealthy` that an unhealthy device "
                "carries in its ResourceSlice (removed when it recovers): `NoSchedule` (new "
                "claims avoid it) or `NoExecute` (also evicts the pods of claims using it).",
            ),
        ),
    ),
    Key(
        "enforcement",
        "string",
        "required",
        "`required`: a time-slicing GPU whose caps nothing would enforce is not advertised "
        "(the failed condition is logged and shown by `inventory`). `best-effort`: it is "
        "advertised and every allocation records enforcement `none`.",
    ),
    Key(
        "ceilings",
        "string",
        "reclaimable-only",
        "`reclaimable-only`: a pod ceiling above its request is honoured only where borrowed "
        "memory can be reclaimed; `allow-overcommit`: honoured everywhere.",
    ),
    Key(
        "deviceListStrategy",
        "list of strings",
        "[cdi]",
        "How allocations reach containers: `cdi` (CDI devices; caps as CDI edits), `envvar` "
        "(plain env variables and mounts, overridable by the pod), `device-nodes` (also "
        "device specs for the GPU's device nodes). A single string is one entry.",
    ),
    Key(
        "cdi",
        "mapping",
        None,
        "CDI settings.",
        (
            Key(
                "driverKind",
                "string",
                "nvidia.com/gpu",
                "Kind of the NVIDIA container toolkit's CDI spec on the host.",
            ),
            Key(
                "nvidiaCtkPath",
                "path",
                "/usr/bin/nvidia-ctk",
                "Absolute path of the host's `nvidia-ctk` (mounted read-only there); the "
                "memory-limit hook runs it.",
            ),
            Key("driverRoot", "path", "/", "Absolute driver root passed to the hook."),
            Key(
                "specDirs",
                "list of paths",
                "[/etc/cdi, /var/run/cdi]",
                "The CDI spec directories the container runtime reads (mounted read-only). "
                "Under `cdi` a GPU is advertised only when `<driverKind>=<uuid>` resolves "
                "there (else skipped, `no-driver-cdi-device`); rechecked when they change.",
            ),
        ),
    ),
    Key(
        "health",
        "mapping",
        None,
        "Xid classes and recovery.",
        (
            Key("ignoredXids", "list of integers", "[]", "Xids that change no health."),
            Key(
                "applicationXids",
                "list of integers",
                _xids(DEFAULT_APPLICATION_XIDS),
                "Application Xids: fault an sm-sharing GPU's MPS server only.",
            ),
            Key(
                "resetXids",
                "list of integers",
                _xids(DEFAULT_RESET_XIDS),
                "Xids that need a GPU reset: the whole GPU is Unhealthy.",
            ),
            Key(
                "rebootXids",
                "list of integers",
                _xids(DEFAULT_REBOOT_XIDS),
                "Xids that need a node reboot: the whole GPU is Unhealthy.",
            ),
            Key(
                "quietPeriod",
                "duration",
                "30s",
                "How long a recovered GPU must stay quiet before its slices are Healthy again "
                "(`500ms`, `30s`, `2m`, `1h`, or seconds as a number).",
            ),
        ),
    ),
    Key(
        "mps",
        "mapping",
        None,
        "MPS control daemons of sm-sharing GPUs.",
        (
            Key("controlBinary", "string", "nvidia-cuda-mps-control", "The control binary."),
            Key(
                "protocolVersion",
                "integer",
                "2",
                "`2` (legacy server) or `3` (driver r615+; per-client memory accounting, "
                "which makes `cuda-memory-limits` apply and borrowed memory reclaimable).",
            ),
            Key(
                "setComputeMode",
                "boolean",
                "true",
                "Set EXCLUSIVE_PROCESS on sm-sharing GPUs and DEFAULT on time-slicing GPUs; "
                "`false` leaves compute modes alone.",
            ),
            Key(
                "activeThreadPercentage",
                "integer or string",
                "100",
                "An integer 1–100, or `proportional` (the container's share of the GPU's "
                "slices, rounded up, at least 1).",
            ),
            Key(
                "maxClients",
                "integer",
                "48",
                f"Most live sm-sharing allocations per GPU (1–{MAX_MPS_CLIENTS}).",
            ),
            Key(
                "launcher",
                "string",
                LAUNCHER_DIRECT,
                "How daemons start: `direct` (a session of their own; bare metal, simulation) "
                "or `host-systemd` (a transient unit of the host's systemd, so they outlive "
                "the plugin's container; needs `hostPID: true` and a privileged pod).",
            ),
            Key(
                "hostBinary",
                "string",
                None,
                "With `launcher: host-systemd`: the control binary's path on the host "
                "(default: `controlBinary`, looked up on the host's PATH). With a "
                "`cdi.driverRoot` other than `/` the unit runs inside that root: give the path "
                "inside it or the host path under it (both work).",
            ),
            Key(
                "shmSize",
                "quantity",
                "8Gi",
                "Size of the per-GPU tmpfs `<mps-root>/<uuid>/shm`, the daemon's and every "
                "client's `/dev/shm` (tmpfs uses only what is written).",
            ),
            Key(
                "probeInterval",
                "duration",
                "5s",
                "Time between liveness probes of a daemon (one control-client run each, "
                "5 s timeout).",
            ),
            Key(
                "probeFailures",
                "integer",
                "3",
                "Failed probes in a row that mark a daemon wedged (a dead daemon counts at once).",
            ),
            Key(
                "maxLogBytes",
                "quantity",
                "8Mi",
                "Bound on a GPU's daemon logs under `<mps-root>/<uuid>/log`; the plugin "
                "truncates them in place when they grow past it.",
            ),
        ),
    ),
)


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
    problems = _Problems()
    top = problems.mapping(data, "", SCHEMA)
    if top is None:
        raise ConfigError(problems.items)
    if "version" not in top:
        problems.add("version", "required; set `version: v1`")
    elif top["version"] != "v1":
        problems.add("version", f"must be v1, not {top['version']!r}")

    slice_size = problems.get(top, "sliceSize", GIB, _slice_size)
    reserved = problems.get(top, "reservedMemory", GIB, _reserved)
    default_mode = problems.get(top, "defaultMode", Mode.TIME_SLICING, _mode)
    names = _resource_names(problems, top.get("resourceNames"))
    gpus = _gpu_rules(problems, top.get("gpus", []))
    enforcement = problems.get(top, "enforcement", "required", _choice(ENFORCEMENT_CHOICES))
    ceilings = problems.get(top, "ceilings", "reclaimable-only", _choice(CEILING_CHOICES))
    strategy: tuple[str, ...] = problems.get(top, "deviceListStrategy", ("cdi",), _strategies)
    cdi = _cdi(problems, top.get("cdi"))
    health = _health(problems, top.get("health"))
    mps = _mps(problems, top.get("mps"))
    api = problems.get(top, "api", ServingApi.DEVICE_PLUGIN, _api)
    dra = _dra(problems, top.get("dra"))
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
    )


T = TypeVar("T")
Check = Callable[[object], T]  # returns the value or raises ValueError with the message


class _Problems:
    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, path: str, message: str) -> None:
        self.items.append(f"{path}: {message}" if path else message)

    def mapping(self, value: object, path: str, keys: tuple[Key, ...]) -> dict[str, Any] | None:
        """`value` as a mapping with only known keys (unknown ones are reported, then dropped)."""
        if value is None:  # an empty section, or an empty file (then `version` is missing)
            return {}
        if not isinstance(value, Mapping):
            self.add(path, "must be a mapping" if path else "the config must be a YAML mapping")
            return None
        known = {k.name for k in keys}
        out: dict[str, Any] = {}
        for key, item in value.items():
            sub = f"{path}.{key}" if path else str(key)
            if not isinstance(key, str) or key not in known:
                self.add(sub, f"unknown key (known: {', '.join(sorted(known))})")
                continue
            out[key] = item
        return out

    def get(self, mapping: Mapping[str, Any], key: str, default: T, check: Check[T]) -> T:
        return self.check(mapping, key, default, check, prefix="")

    def check(
        self, mapping: Mapping[str, Any], key: str, default: T, check: Check[T], prefix: str
    ) -> T:
        if key not in mapping:
            return default
        try:
            return check(mapping[key])
        except ValueError as e:
            self.add(f"{prefix}{key}", str(e))
            return default


def _slice_size(value: object) -> int:
    size = _quantity(value)
    if size <= 0:
        raise ValueError("must be greater than zero")
    if size % MIB:
        raise ValueError("must be a whole number of MiB (caps are passed in MiB)")
    return size


def _reserved(value: object) -> int:
    return _quantity(value)


def _quantity(value: object) -> int:
    try:
        return parse_quantity(value)
    except QuantityError as e:
        raise ValueError(str(e)) from None


def _mode(value: object) -> Mode:
    if not isinstance(value, str) or value not in MODE_CHOICES:
        raise ValueError(f"must be one of {', '.join(MODE_CHOICES)}")
    return Mode(value)


def _api(value: object) -> ServingApi:
    if not isinstance(value, str) or value not in API_CHOICES:
        raise ValueError(f"must be one of {', '.join(API_CHOICES)}")
    return ServingApi(value)


def _choice(choices: tuple[str, ...]) -> Check[str]:
    def check(value: object) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value

    return check


def _strategies(value: object) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise ValueError(f"must be a non-empty list of {', '.join(STRATEGY_CHOICES)}")
    bad = [repr(i) for i in items if not isinstance(i, str) or i not in STRATEGY_CHOICES]
    if bad:
        raise ValueError(f"{', '.join(bad)} not one of {', '.join(STRATEGY_CHOICES)}")
    if len(set(items)) != len(items):
        raise ValueError("lists a strategy twice")
    return tuple(str(i) for i in items)


def _int(lo: int, hi: int) -> Check[int]:
    def check(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"must be an integer from {lo} to {hi}")
        if not lo <= value <= hi:
            raise ValueError(f"must be from {lo} to {hi}, not {value}")
        return value

    return check


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


def _str(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError("must be a non-empty string")
    return value


def _abs_path(value: object) -> str:
    text = _str(value)
    if not text.startswith("/"):
        raise ValueError("must be an absolute path")
    return text


def _abs_paths(value: object) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise ValueError("must be a non-empty list of absolute paths")
    return tuple(_abs_path(i) for i in items)


_CDI_KIND = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]*[A-Za-z0-9]/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _cdi_kind(value: object) -> str:
    text = _str(value)
    if not _CDI_KIND.fullmatch(text):
        raise ValueError("must be a CDI kind such as nvidia.com/gpu")
    return text


_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def _resource_name(value: object) -> ResourceName:
    text = _str(value)
    domain, sep, name = text.partition("/")
    ok = (
        sep == "/"
        and len(domain) <= 253
        and bool(_DNS_SUBDOMAIN.fullmatch(domain))
        and 0 < len(name) <= 63
        and bool(_QUALIFIED_NAME.fullmatch(name))
    )
    if not ok:
        raise ValueError(f"{text!r} is not an extended resource name like vendor.com/name")
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        raise ValueError("the kubernetes.io domain is reserved")
    return ResourceName(text)


def _duration(value: object) -> float:
    if isinstance(value, bool):
        raise ValueError("must be a duration such as 30s")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _parse_duration(value)
    else:
        raise ValueError("must be a duration such as 30s")
    if seconds < 0:
        raise ValueError("must not be negative")
    return seconds


_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def _parse_duration(text: str) -> float:
    text = text.strip()
    pos, total = 0, 0.0
    while pos < len(text):
        m = _DURATION_PART.match(text, pos)
        if m is None:
            raise ValueError(f"{text!r} is not a duration (examples: 500ms, 30s, 2m, 1h30m)")
        total += float(m[1]) * _UNITS[m[2]]
        pos = m.end()
    if pos == 0:
        raise ValueError("must be a duration such as 30s")
    return total


def _xid_list(value: object) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError("must be a list of integers")
    bad = [repr(v) for v in value if isinstance(v, bool) or not isinstance(v, int) or v < 0]
    if bad:
        raise ValueError(f"{', '.join(bad)} not a non-negative integer")
    return tuple(int(v) for v in value)


def _active_threads(value: object) -> int | None:
    if value == "proportional":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100:
        raise ValueError("must be an integer from 1 to 100, or proportional")
    return value


def _section(problems: _Problems, value: object, name: str) -> dict[str, Any] | None:
    keys = next(k.children for k in SCHEMA if k.name == name)
    return problems.mapping(value, name, keys)


def _resource_names(problems: _Problems, value: object) -> ResourceNames:
    d = ResourceNames()
    section = _section(problems, value, "resourceNames")
    if section is None:
        return d
    p = "resourceNames."
    names = ResourceNames(
        time_slicing=problems.check(section, "timeSlicing", d.time_slicing, _resource_name, p),
        sm_sharing=problems.check(section, "smSharing", d.sm_sharing, _resource_name, p),
        exclusive=problems.check(section, "exclusive", d.exclusive, _resource_name, p),
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


def _cdi(problems: _Problems, value: object) -> CdiConfig:
    d = CdiConfig()
    section = _section(problems, value, "cdi")
    if section is None:
        return d
    p = "cdi."
    return CdiConfig(
        driver_kind=problems.check(section, "driverKind", d.driver_kind, _cdi_kind, p),
        nvidia_ctk_path=problems.check(section, "nvidiaCtkPath", d.nvidia_ctk_path, _abs_path, p),
        driver_root=problems.check(section, "driverRoot", d.driver_root, _abs_path, p),
        spec_dirs=problems.check(section, "specDirs", d.spec_dirs, _abs_paths, p),
    )


def _dra(problems: _Problems, value: object) -> DraConfig:
    d = DraConfig()
    section = _section(problems, value, "dra")
    if section is None:
        return d
    effect = _choice(TAINT_EFFECT_CHOICES)
    return DraConfig(
        unhealthy_taint_effect=problems.check(
            section, "unhealthyTaintEffect", d.unhealthy_taint_effect, effect, "dra."
        ),
    )


def _health(problems: _Problems, value: object) -> HealthConfig:
    d = HealthConfig()
    section = _section(problems, value, "health")
    if section is None:
        return d
    p = "health."
    return HealthConfig(
        ignored_xids=problems.check(section, "ignoredXids", d.ignored_xids, _xid_list, p),
        application_xids=problems.check(
            section, "applicationXids", d.application_xids, _xid_list, p
        ),
        reset_xids=problems.check(section, "resetXids", d.reset_xids, _xid_list, p),
        reboot_xids=problems.check(section, "rebootXids", d.reboot_xids, _xid_list, p),
        quiet_period=problems.check(section, "quietPeriod", d.quiet_period, _duration, p),
    )


def _mps(problems: _Problems, value: object) -> MpsConfig:
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
        control_binary=problems.check(section, "controlBinary", d.control_binary, _str, p),
        protocol_version=problems.check(
            section, "protocolVersion", d.protocol_version, protocol, p
        ),
        set_compute_mode=problems.check(section, "setComputeMode", d.set_compute_mode, _bool, p),
        active_thread_percentage=problems.check(
            section, "activeThreadPercentage", d.active_thread_percentage, _active_threads, p
        ),
        max_clients=problems.check(
            section, "maxClients", d.max_clients, _int(1, MAX_MPS_CLIENTS), p
        ),
        launcher=problems.check(section, "launcher", d.launcher, _choice(LAUNCHER_CHOICES), p),
        host_binary=problems.check(section, "hostBinary", d.host_binary, _str, p),
        shm_size=problems.check(section, "shmSize", d.shm_size, _positive_quantity, p),
        probe_interval=problems.check(
            section, "probeInterval", d.probe_interval, _positive_duration, p
        ),
        probe_failures=problems.check(section, "probeFailures", d.probe_failures, _int(1, 100), p),
        max_log_bytes=problems.check(
            section, "maxLogBytes", d.max_log_bytes, _positive_quantity, p
        ),
    )


def _positive_quantity(value: object) -> int:
    size = _quantity(value)
    if size <= 0:
        raise ValueError("must be greater than zero")
    return size


def _positive_duration(value: object) -> float:
    seconds = _duration(value)
    if seconds <= 0:
        raise ValueError("must be greater than zero")
    return seconds


_GPU_KEYS = next(k.children for k in SCHEMA if k.name == "gpus")
_MATCH_KEYS = (Key("index", "", None, ""), Key("uuid", "", None, ""), Key("product", "", None, ""))


def _gpu_rules(problems: _Problems, value: object) -> tuple[GpuRule, ...]:
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
        mode = problems.check(entry, "mode", Mode.TIME_SLICING, _mode, f"{p}.")
        slice_size = problems.check(entry, "sliceSize", None, _slice_size, f"{p}.")
        reserved = problems.check(entry, "reservedMemory", None, _reserved, f"{p}.")
        api = problems.check(entry, "api", None, _api, f"{p}.")
        if match is None:
            continue
        if match in seen:
            problems.add(f"{p}.match", f"same match as gpus[{seen[match]}].match")
        seen.setdefault(match, i)
        rules.append(GpuRule(match, mode, slice_size, reserved, api))
    return tuple(rules)


def _gpu_match(problems: _Problems, value: object, path: str) -> GpuMatch | None:
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
            return GpuMatch(index=_int(0, 1023)(item))
        except ValueError as e:
            problems.add(f"{path}.index", str(e))
            return None
    try:
        text = _str(item)
    except ValueError as e:
        problems.add(f"{path}.{key}", str(e))
        return None
    return GpuMatch(uuid=text) if key == "uuid" else GpuMatch(product=text)


def with_spec_dirs(config: Config, dirs: tuple[str, ...]) -> Config:
    """`config` reading CDI specs from `dirs` (a simulated node's own directories)."""
    return replace(config, cdi=replace(config.cdi, spec_dirs=dirs))


def with_control_binary(config: Config, binary: str) -> Config:
    """`config` with MPS daemons started from `binary`, directly (a simulated node's fake)."""
    mps = replace(config.mps, control_binary=binary, launcher=LAUNCHER_DIRECT)
    return replace(config, mps=mps)
