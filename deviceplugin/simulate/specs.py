"""Simulated node descriptions: built-in presets and validated YAML spec files.

A `SimSpec` is everything the fake NVML, the driver CDI spec and the node facts need to
pretend to be a real node; in simulation those facts come from here, never from the host.
The YAML schema is documented in docs/simulate-spec.md; every bad field is named.
Over 400 lines on purpose: most of it is the presets, which are data.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from deviceplugin.inventory.gpus import (
    MEMORY_LIMITS_BRANCH,
    Gpu,
    Inventory,
    NodeFacts,
    sysfs_pci_name,
)
from deviceplugin.model import MIB, GpuUuid

# NVML_COMPUTEMODE_* by the names users write in a spec.
COMPUTE_MODES: dict[str, int] = {"Default": 0, "Prohibited": 2, "ExclusiveProcess": 3}

# Driver branch from which field 230 (GPU recovery action) answers [inf: r550-era drivers].
RECOVERY_ACTION_BRANCH = 550

# Toolkit release that added `nvidia-ctk hook apply-cuda-memory-limits`.
HOOK_TOOLKIT = (1, 20, 1)
_TOOLKIT_RE = re.compile(r"^\d+\.\d+\.\d+$")

# Where the driver and toolkit come from: installed on the host (the toolkit's spec has a
# device per GPU), or the GPU Operator's containers (the driver under /run/nvidia/driver; the
# toolkit container writes only the management spec, `management.nvidia.com/gpu=all`).
LAYOUT_HOST = "host"
LAYOUT_GPU_OPERATOR = "gpu-operator"
LAYOUTS = (LAYOUT_HOST, LAYOUT_GPU_OPERATOR)
OPERATOR_DRIVER_ROOT = "/run/nvidia/driver"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


_UUID_RE = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_DRIVER_RE = re.compile(r"^\d+\.\d+(\.\d+)?$")
_BUS_ID_RE = re.compile(r"^[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.[0-7]$")


class SpecError(Exception):
    """A spec that failed validation; `problems` holds one `path: message` per bad field."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems))


@dataclass(frozen=True)
class SimGpu:
    index: int
    uuid: GpuUuid
    name: str
    memory_total: int  # bytes
    memory_reserved: int  # bytes the driver keeps (memory info v2 `reserved`)
    minor: int
    pci_bus_id: str  # NVML form "%08X:%02X:%02X.0"
    pci_device_id: int  # device id << 16 | 0x10DE
    numa_node: int | None
    compute_capability: tuple[int, int]
    mig_capable: bool
    mig_enabled: bool
    compute_mode: int
    ecc: bool


@dataclass(frozen=True)
class SimSpec:
    name: str
    gpus: tuple[SimGpu, ...]
    driver_version: str
    cuda_driver_version: int  # e.g. 13040
    cgroup_version: int
    nvidia_ctk: bool
    privileged: bool
    toolkit_version: str = "1.20.1"  # NVIDIA container toolkit; the memory-limit hook: 1.20.1+
    layout: str = LAYOUT_HOST  # LAYOUTS

    @property
    def driver_root(self) -> str:
        """Where the simulated driver's files are (its libraries under it)."""
        return OPERATOR_DRIVER_ROOT if self.layout == LAYOUT_GPU_OPERATOR else "/"

    @property
    def dev_root(self) -> str:
        """Where its /dev is: the host's, in both layouts (the operator's driver container
        creates the nodes in the host's /dev)."""
        return "/"

    @property
    def memory_limits_hook(self) -> bool:
        """Whether the simulated `nvidia-ctk` has `hook apply-cuda-memory-limits`."""
        return self.nvidia_ctk and _version(self.toolkit_version) >= HOOK_TOOLKIT

    @property
    def driver_branch(self) -> int:
        return int(self.driver_version.split(".", 1)[0])

    @property
    def memory_limits_symbol(self) -> bool:
        return self.driver_branch >= MEMORY_LIMITS_BRANCH

    def node_facts(self) -> NodeFacts:
        return NodeFacts(
            driver_version=self.driver_version,
            cuda_driver_version=self.cuda_driver_version,
            cuda_memory_limits=self.memory_limits_symbol,
            cgroup_v2=self.cgroup_version == 2,
            nvidia_ctk_present=self.nvidia_ctk,
            memory_limits_hook=self.memory_limits_hook,
        )

    def inventory(self) -> Inventory:
        """The node's GPUs as inventory records, the facts the fake NVML serves (for code that
        plans without running NVML: tests, the pilot)."""
        gpus = tuple(
            Gpu(
                index=g.index,
                uuid=g.uuid,
                name=g.name,
                memory_total=g.memory_total,
                minor=g.minor,
                pci_bus_id=g.pci_bus_id,
                numa_node=g.numa_node,
                compute_capability=g.compute_capability,
                mig_enabled=g.mig_enabled,
                compute_mode=g.compute_mode,
            )
            for g in self.gpus
        )
        return Inventory(gpus, self.node_facts())

    def write_sysfs(self, root: Path) -> Path:
        """A sysfs tree for the simulated node (NUMA nodes, cgroup v2 marker) under `root`.

        The real inventory code then reads it as it reads /sys on a node.
        """
        for g in self.gpus:
            dev = root / "bus" / "pci" / "devices" / sysfs_pci_name(g.pci_bus_id)
            dev.mkdir(parents=True, exist_ok=True)
            numa = -1 if g.numa_node is None else g.numa_node
            (dev / "numa_node").write_text(f"{numa}\n")
        cgroup = root / "fs" / "cgroup"
        cgroup.mkdir(parents=True, exist_ok=True)
        marker = cgroup / "cgroup.controllers"
        if self.cgroup_version == 2:
            marker.write_text("cpuset cpu io memory pids\n")
        elif marker.exists():
            marker.unlink()
        return root

    def gpu(self, ref: str) -> SimGpu:
        """The GPU named by index ("0") or UUID; KeyError naming the choices otherwise."""
        for g in self.gpus:
            if ref == g.uuid or (ref.isdigit() and int(ref) == g.index):
                return g
        raise KeyError(f"no GPU {ref!r} on simulated node {self.name} (0..{len(self.gpus) - 1})")


def fake_uuid(seed: str, index: int) -> GpuUuid:
    """A deterministic, well-formed GPU UUID for GPU `index` of the node named `seed`."""
    h = hashlib.sha256(f"{seed}/{index}".encode()).hexdigest()
    return GpuUuid(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}")


# Products the presets use: name, MiB, compute capability, PCI device id, MIG-capable.
_H200 = ("NVIDIA H200", 143771, (9, 0), 0x2335, True)
_A100 = ("NVIDIA A100-SXM4-80GB", 81920, (8, 0), 0x20B2, True)
_L4 = ("NVIDIA L4", 23034, (8, 9), 0x27B8, False)
# PCI buses of an 8-GPU HGX board; the first half sits on NUMA node 0.
_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)


def _preset_gpus(
    seed: str, products: list[tuple[str, int, tuple[int, int], int, bool]]
) -> list[dict[str, Any]]:
    half = max(1, len(products) // 2)
    return [
        {
            "name": name,
            "uuid": fake_uuid(seed, i),
            "memoryMiB": mib,
            "computeCapability": f"{cc[0]}.{cc[1]}",
            "pciBusId": f"00000000:{_BUSES[i % len(_BUSES)]:02X}:00.0",
            "pciDeviceId": dev_id,
            "numaNode": 0 if i < half else 1,
            "migCapable": mig,
        }
        for i, (name, mib, cc, dev_id, mig) in enumerate(products)
    ]


def _r615(seed: str, products: list[tuple[str, int, tuple[int, int], int, bool]]) -> dict[str, Any]:
    return {
        "name": seed,
        "driverVersion": "615.43.02",
        "cudaDriverVersion": 13040,
        "cgroupVersion": 2,
        "nvidiaCtk": True,
        "privileged": True,
        "gpus": _preset_gpus(seed, products),
    }


def _presets() -> dict[str, dict[str, Any]]:
    a100 = _r615("a100x4-r580", [_A100] * 4)
    a100.update(driverVersion="580.95.05", cudaDriverVersion=13000)
    operator = _r615("h200x2-operator", [_H200] * 2)
    operator.update(layout=LAYOUT_GPU_OPERATOR)
    return {
        "h200x2": _r615("h200x2", [_H200] * 2),
        "h200x2-operator": operator,
        "h200x8": _r615("h200x8", [_H200] * 8),
        "a100x4-r580": a100,
        "mixed": _r615("mixed", [_H200, _H200, _L4, _L4]),
    }


PRESETS: tuple[str, ...] = tuple(_presets())


def load_spec(name_or_path: str | Path) -> SimSpec:
    """A preset by name, or a YAML spec file by path; raises SpecError naming bad fields."""
    presets = _presets()
    if isinstance(name_or_path, str) and name_or_path in presets:
        return parse_spec(presets[name_or_path], source=f"preset {name_or_path}")
    path = Path(name_or_path)
    if not path.is_file():
        raise SpecError(
            str(name_or_path),
            [f"not a preset ({', '.join(presets)}) and not a readable file"],
        )
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise SpecError(str(path), [f"cannot read YAML: {err}"]) from err
    return parse_spec(data, source=str(path), default_name=path.stem)


_TOP_KEYS = {
    "name",
    "driverVersion",
    "cudaDriverVersion",
    "cgroupVersion",
    "nvidiaCtk",
    "toolkitVersion",
    "privileged",
    "layout",
    "gpus",
}
_GPU_KEYS = {
    "name",
    "uuid",
    "count",
    "memoryMiB",
    "reservedMiB",
    "minor",
    "pciBusId",
    "pciDeviceId",
    "numaNode",
    "computeCapability",
    "migCapable",
    "migEnabled",
    "computeMode",
    "ecc",
}


class _Checker:
    """Collects `path: message` problems while reading typed values out of a mapping."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def bad(self, path: str, msg: str) -> None:
        self.problems.append(f"{path}: {msg}")

    def unknown(self, data: Mapping[str, Any], allowed: set[str], prefix: str) -> None:
        for key in data:
            if key not in allowed:
                self.bad(f"{prefix}{key}", "unknown field")

    def typed(self, data: Mapping[str, Any], key: str, typ: type, path: str, default: Any) -> Any:
        if key not in data or (data[key] is None and default is None):
            return default
        value = data[key]
        # bool is an int in Python; refuse it where a number is meant.
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            self.bad(path, f"must be {typ.__name__}, got {value!r}")
            return default
        return value


def _cuda_version(c: _Checker, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1000:
        return value
    if isinstance(value, str) and re.fullmatch(r"\d+\.\d+", value):
        major, minor = value.split(".")
        return int(major) * 1000 + int(minor) * 10
    c.bad("cudaDriverVersion", f'must be like 13040 or "13.4", got {value!r}')
    return 0


def parse_spec(data: Any, source: str, default_name: str = "sim") -> SimSpec:
    """Validate a decoded spec mapping; raises SpecError listing every bad field."""
    c = _Checker()
    if not isinstance(data, Mapping):
        raise SpecError(source, ["spec must be a mapping"])
    c.unknown(data, _TOP_KEYS, "")
    name = c.typed(data, "name", str, "name", default_name)
    driver = c.typed(data, "driverVersion", str, "driverVersion", None)
    if driver is None:
        c.bad("driverVersion", 'required, e.g. "615.43.02"')
        driver = "0.0"
    elif not _DRIVER_RE.match(driver):
        c.bad("driverVersion", f'must be like "615.43.02", got {driver!r}')
        driver = "0.0"
    cuda = _cuda_version(c, data.get("cudaDriverVersion", 13040))
    cgroup = c.typed(data, "cgroupVersion", int, "cgroupVersion", 2)
    if cgroup not in (1, 2):
        c.bad("cgroupVersion", f"must be 1 or 2, got {cgroup!r}")
    ctk = c.typed(data, "nvidiaCtk", bool, "nvidiaCtk", True)
    toolkit = c.typed(data, "toolkitVersion", str, "toolkitVersion", "1.20.1")
    if not _TOOLKIT_RE.match(toolkit):
        c.bad("toolkitVersion", f'must be like "1.20.1", got {toolkit!r}')
        toolkit = "0.0.0"
    privileged = c.typed(data, "privileged", bool, "privileged", True)
    layout = c.typed(data, "layout", str, "layout", LAYOUT_HOST)
    if layout not in LAYOUTS:
        c.bad("layout", f"must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    raw_gpus = data.get("gpus")
    gpus: list[SimGpu] = []
    if not isinstance(raw_gpus, list) or not raw_gpus:
        c.bad("gpus", "required: a non-empty list of GPUs")
    else:
        for i, raw in enumerate(raw_gpus):
            gpus.extend(_parse_gpu_entry(c, raw, f"gpus[{i}]", name, len(gpus)))
    _check_unique(c, gpus)
    if c.problems:
        raise SpecError(source, c.problems)
    return SimSpec(
        name=name,
        gpus=tuple(gpus),
        driver_version=driver,
        cuda_driver_version=cuda,
        cgroup_version=cgroup,
        nvidia_ctk=ctk,
        privileged=privileged,
        toolkit_version=toolkit,
        layout=layout,
    )


def _parse_gpu_entry(c: _Checker, raw: Any, path: str, seed: str, first: int) -> list[SimGpu]:
    if not isinstance(raw, Mapping):
        c.bad(path, "must be a mapping")
        return []
    c.unknown(raw, _GPU_KEYS, f"{path}.")
    count = c.typed(raw, "count", int, f"{path}.count", 1)
    if count < 1:
        c.bad(f"{path}.count", f"must be >= 1, got {count}")
        count = 1
    name = c.typed(raw, "name", str, f"{path}.name", None)
    if name is None:
        c.bad(f"{path}.name", 'required, e.g. "NVIDIA H200"')
    mib = c.typed(raw, "memoryMiB", int, f"{path}.memoryMiB", None)
    if mib is None or mib <= 0:
        c.bad(
            f"{path}.memoryMiB", f"required, a positive number of MiB, got {raw.get('memoryMiB')!r}"
        )
        mib = 1
    reserved = c.typed(raw, "reservedMiB", int, f"{path}.reservedMiB", 512)
    if not 0 <= reserved < mib:
        c.bad(f"{path}.reservedMiB", f"must be in 0..memoryMiB-1, got {reserved}")
        reserved = 0
    cc = _compute_capability(c, raw.get("computeCapability", "9.0"), f"{path}.computeCapability")
    mig_capable = c.typed(raw, "migCapable", bool, f"{path}.migCapable", False)
    mig_enabled = c.typed(raw, "migEnabled", bool, f"{path}.migEnabled", False)
    if mig_enabled and not mig_capable:
        c.bad(f"{path}.migEnabled", "needs migCapable: true")
    mode_name = c.typed(raw, "computeMode", str, f"{path}.computeMode", "Default")
    if mode_name not in COMPUTE_MODES:
        c.bad(
            f"{path}.computeMode", f"must be one of {', '.join(COMPUTE_MODES)}, got {mode_name!r}"
        )
        mode_name = "Default"
    numa = c.typed(raw, "numaNode", int, f"{path}.numaNode", None)
    ecc = c.typed(raw, "ecc", bool, f"{path}.ecc", True)
    dev_id = c.typed(raw, "pciDeviceId", int, f"{path}.pciDeviceId", 0x2335)
    per_gpu = _per_gpu_fields(c, raw, path, count)
    out = []
    for k in range(count):
        index = first + k
        uuid, minor, bus = per_gpu(k, index, seed)
        out.append(
            SimGpu(
                index=index,
                uuid=uuid,
                name=name or "?",
                memory_total=mib * MIB,
                memory_reserved=reserved * MIB,
                minor=minor,
                pci_bus_id=bus,
                pci_device_id=(dev_id << 16) | 0x10DE,
                numa_node=numa,
                compute_capability=cc,
                mig_capable=mig_capable,
                mig_enabled=mig_enabled,
                compute_mode=COMPUTE_MODES[mode_name],
                ecc=ecc,
            )
        )
    return out


def _per_gpu_fields(c: _Checker, raw: Mapping[str, Any], path: str, count: int) -> Any:
    """UUID, minor and bus id: given ones only make sense for a single GPU (count 1)."""
    uuid = c.typed(raw, "uuid", str, f"{path}.uuid", None)
    minor = c.typed(raw, "minor", int, f"{path}.minor", None)
    bus = c.typed(raw, "pciBusId", str, f"{path}.pciBusId", None)
    if uuid is not None and not _UUID_RE.match(uuid):
        c.bad(
            f"{path}.uuid", f"must look like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, got {uuid!r}"
        )
    if bus is not None and not _BUS_ID_RE.match(bus):
        c.bad(f"{path}.pciBusId", f'must look like "00000000:3B:00.0", got {bus!r}')
    for key, value in (("uuid", uuid), ("minor", minor), ("pciBusId", bus)):
        if value is not None and count > 1:
            c.bad(f"{path}.{key}", "cannot be set together with count > 1")

    def fields(k: int, index: int, seed: str) -> tuple[GpuUuid, int, str]:
        return (
            GpuUuid(uuid) if uuid is not None and count == 1 else fake_uuid(seed, index),
            minor if minor is not None and count == 1 else index,
            bus if bus is not None and count == 1 else f"00000000:{0x10 + index:02X}:00.0",
        )

    return fields


def _compute_capability(c: _Checker, value: Any, path: str) -> tuple[int, int]:
    text = str(value) if isinstance(value, str | float) else ""
    m = re.fullmatch(r"(\d+)\.(\d+)", text)
    if not m:
        c.bad(path, f'must be like "9.0", got {value!r}')
        return (0, 0)
    return (int(m.group(1)), int(m.group(2)))


def _check_unique(c: _Checker, gpus: list[SimGpu]) -> None:
    for attr, label in (("uuid", "uuid"), ("minor", "minor"), ("pci_bus_id", "pciBusId")):
        seen: set[object] = set()
        for g in gpus:
            value = getattr(g, attr)
            if value in seen:
                c.bad(f"gpus[{g.index}].{label}", f"duplicate {value!r}")
            seen.add(value)
