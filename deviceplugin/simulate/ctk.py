"""A stand-in for the node's `nvidia-ctk`, as strict as the real one where the plugin uses it.

`hook apply-cuda-memory-limits --help` answers only from toolkit 1.20.1 on (older toolkits
say there is no such command and exit non-zero); other hooks succeed doing nothing.
`cdi generate` prints (or writes with `--output`) a spec of the simulated node's GPUs the
way nvidia-container-toolkit's `cmd/nvidia-ctk/cdi/generate/generate.go` does: flags checked
in `validateFlags` (format, device-name strategy, vendor and class), devices named by the
strategy plus the merged `all`, device nodes under `--dev-root` (default: the driver root),
libraries and the driver's binaries (`nvidia-smi`) under `--driver-root`, hooks naming
`--nvidia-ctk-path`. A driver root without
the driver's libraries, or a /dev without its nodes, fails as the real one does when NVML
or a node cannot be found.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

from deviceplugin.plumbing import fsutil
from deviceplugin.simulate.cdi import driver_spec, gpu_devices
from deviceplugin.simulate.specs import SimGpu, SimSpec, parse_spec

_FLAGS = {
    "output": "output",
    "format": "format",
    "mode": "mode",
    "discovery-mode": "mode",
    "dev-root": "dev-root",
    "device-name-strategy": "device-name-strategy",
    "driver-root": "driver-root",
    "library-search-path": "library-search-path",
    "nvidia-ctk-path": "nvidia-ctk-path",
    "nvidia-cdi-hook-path": "nvidia-ctk-path",
    "vendor": "vendor",
    "cdi-vendor": "vendor",
    "class": "class",
    "cdi-class": "class",
}
# tags.cncf.io/container-device-interface pkg/parser ValidateVendorName / ValidateClassName
_VENDOR = re.compile(r"^[A-Za-z](?:[A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_CLASS = re.compile(r"^[A-Za-z](?:[A-Za-z0-9_-]*[A-Za-z0-9])?$")


class UsageError(Exception):
    pass


def _parse(args: Sequence[str]) -> dict[str, str]:
    """urfave/cli flags: `--name=value` or `--name value`; an unknown flag is refused."""
    out: dict[str, str] = {}
    it = iter(args)
    for arg in it:
        if not arg.startswith("-"):
            raise UsageError(f"unexpected argument {arg!r}")
        name, eq, value = arg.lstrip("-").partition("=")
        if name not in _FLAGS:
            raise UsageError(f"flag provided but not defined: -{name}")
        if not eq:
            following = next(it, None)
            if following is None:
                raise UsageError(f"flag needs an argument: -{name}")
            value = following
        out[_FLAGS[name]] = value
    return out


def _names(strategy: str) -> Callable[[SimGpu], list[str]]:
    """nvcdi.NewDeviceNamer: index | uuid | type-index."""
    namers: dict[str, Callable[[SimGpu], list[str]]] = {
        "index": lambda g: [str(g.index)],
        "uuid": lambda g: [g.uuid],
        "type-index": lambda g: [f"gpu{g.index}"],
    }
    if strategy not in namers:
        raise UsageError(f"invalid device name strategy: {strategy}")
    return namers[strategy]


def generate(spec: SimSpec, args: Sequence[str]) -> tuple[str, Path | None]:
    """The spec's text and where it goes (None: stdout); UsageError / RuntimeError as the
    real command fails."""
    flags = _parse(args)
    fmt = flags.get("format", "yaml").lower()
    output = flags.get("output", "")
    if fmt not in ("json", "yaml"):
        raise UsageError(f"invalid output format: {fmt}")
    suffix = Path(output).suffix.lower()
    if suffix in (".json", ".yaml", ".yml") and "format" not in flags:
        fmt = "json" if suffix == ".json" else "yaml"
    if flags.get("mode", "auto") not in ("auto", "nvml"):
        raise RuntimeError(f"mode {flags['mode']} is not simulated")
    namer = _names(flags.get("device-name-strategy", "index"))
    vendor, cls = flags.get("vendor", "nvidia.com"), flags.get("class", "gpu")
    if not _VENDOR.fullmatch(vendor):
        raise UsageError(f"invalid CDI vendor name: invalid vendor {vendor!r}")
    if not _CLASS.fullmatch(cls):
        raise UsageError(f"invalid CDI class name: invalid class {cls!r}")
    driver_root = flags.get("driver-root") or "/"
    # "--dev-root: If this is not specified, the driver-root is assumed."
    dev_root = flags.get("dev-root") or driver_root
    if driver_root.rstrip("/") != spec.driver_root.rstrip("/"):
        raise RuntimeError(
            "failed to generate CDI spec: failed to create CDI library: failed to load NVML: "
            f"libnvidia-ml.so.1 not found under driver root {driver_root}"
        )
    if dev_root.rstrip("/") != spec.dev_root.rstrip("/"):
        raise RuntimeError(
            "failed to generate CDI spec: failed to create device CDI specs: "
            f"failed to locate {dev_root.rstrip('/')}/dev/nvidiactl: no such file or directory"
        )
    hook = flags.get("nvidia-ctk-path") or "/usr/bin/nvidia-ctk"
    devices = gpu_devices(spec, namer, dev_root)
    body = driver_spec(spec, f"{vendor}/{cls}", hook, devices, driver_root, dev_root)
    text = json.dumps(body, indent=2) if fmt == "json" else yaml.safe_dump(body, sort_keys=False)
    return text, Path(output) if output else None


def main(argv: Sequence[str], spec_json: str) -> int:
    """`cdi generate` (the script answers `--version` and the hooks itself)."""
    args = list(argv)
    if args[:2] == ["cdi", "generate"]:
        spec = parse_spec(json.loads(spec_json), source="simulated node")
        try:
            text, output = generate(spec, args[2:])
        except UsageError as exc:
            print(f"Incorrect Usage: {exc}", file=sys.stderr)
            return 1
        except RuntimeError as exc:
            print(f'time="simulated" level=error msg="{exc}"', file=sys.stderr)
            return 1
        if output is None:
            sys.stdout.write(text)
        else:
            fsutil.atomic_write(output, text.encode(), 0o644)
        print('time="simulated" level=info msg="Generated CDI spec with version 0.5.0"',
              file=sys.stderr)  # fmt: skip
        return 0
    print(f"nvidia-ctk: unsupported in simulation: {' '.join(args)}", file=sys.stderr)
    return 1


def spec_document(spec: SimSpec) -> dict[str, object]:
    """`spec` as the YAML mapping `parse_spec` reads back (the stand-in's node)."""
    return {
        "name": spec.name,
        "driverVersion": spec.driver_version,
        "cudaDriverVersion": spec.cuda_driver_version,
        "cgroupVersion": spec.cgroup_version,
        "nvidiaCtk": spec.nvidia_ctk,
        "toolkitVersion": spec.toolkit_version,
        "privileged": spec.privileged,
        "layout": spec.layout,
        "gpus": [_gpu_document(g) for g in spec.gpus],
    }


def _gpu_document(g: SimGpu) -> dict[str, object]:
    return {
        "name": g.name,
        "uuid": g.uuid,
        "minor": g.minor,
        "pciBusId": g.pci_bus_id,
        "memoryMiB": g.memory_total >> 20,
        "reservedMiB": g.memory_reserved >> 20,
    }


_SCRIPT = """#!PYTHON
\"\"\"simulated nvidia-ctk, NVIDIA Container Toolkit TOOLKIT\"\"\"
import sys
args = sys.argv[1:]
# Answered without importing the package: the plugin probes the hook within a timeout.
if args[:1] == ["--version"]:
    print("NVIDIA Container Toolkit CLI version TOOLKIT")
    sys.exit(0)
if args[:2] == ["hook", "apply-cuda-memory-limits"]:
    if not HOOK_OK:
        print("No help topic for 'apply-cuda-memory-limits'", file=sys.stderr)
        sys.exit(3)
    if "--help" in args:
        print("apply CUDA memory limits to a container")
    sys.exit(0)
if args[:1] == ["hook"]:
    sys.exit(0)
from deviceplugin.simulate.ctk import main
sys.exit(main(args, SPEC))
"""


def write_nvidia_ctk(spec: SimSpec, path: Path) -> Path:
    """Write the stand-in for `spec`'s node at `path`: it answers `--version` and the hooks
    itself, and runs `main` with the node baked in for the rest."""
    script = (
        _SCRIPT.replace("PYTHON", sys.executable)
        .replace("TOOLKIT", spec.toolkit_version)
        .replace("HOOK_OK", repr(spec.memory_limits_hook))
        .replace("SPEC", repr(json.dumps(spec_document(spec))))
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fsutil.atomic_write(path, script.encode(), 0o755)
    return path
