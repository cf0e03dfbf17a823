"""This plugin's own CDI specs: one file and one device per allocation.

The device (kind `gpu-fraction.dev/gpu`) carries the caps and MPS variables as env edits
(applied after the pod's own env), the MPS mounts, and the toolkit's
`apply-cuda-memory-limits` hook when that enforcement applies. The driver's own device
(libraries, device nodes) comes from the NVIDIA toolkit's spec, whose `NVIDIA_VISIBLE_DEVICES=void`
our device never overrides (`without_visible_devices`). `validate_spec` checks
the field rules of reference/cdi-facts.md; tests and the writer both use it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deviceplugin.plumbing import fsutil

KIND = "gpu-fraction.dev/gpu"
SPEC_PREFIX = "gpu-fraction.dev-gpu_"
# DRA: one spec file per prepared claim, one device per allocation result (DESIGN section 10).
CLAIM_KIND = "gpu-fraction.dev/claim"
CLAIM_SPEC_PREFIX = "gpu-fraction.dev-claim_"
HOOK_NAMES = (
    "prestart",
    "createRuntime",
    "createContainer",
    "startContainer",
    "poststart",
    "poststop",
)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
_KIND = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]*[A-Za-z0-9]/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_UNSAFE_IN_NAME = re.compile(r"[^A-Za-z0-9_.:-]")


class CdiError(ValueError):
    """A spec that breaks a CDI field rule."""


@dataclass(frozen=True)
class CdiMount:
    host_path: str
    container_path: str
    read_only: bool = False


@functools.lru_cache(maxsize=4096)  # the same sets come back (an app container after its init)
def device_name(key: tuple[str, ...]) -> str:
    """Stable, unique, CDI-valid device name for an allocation key (sorted device IDs):
    the first ID's GPU, CDI-safe, then a digest of the key."""
    digest = hashlib.sha256("\n".join(key).encode()).hexdigest()[:16]  # hex: CDI-safe
    return f"{_name_head(key[0].split('::', 1)[0])}-{digest}"


@functools.lru_cache(maxsize=256)  # one per GPU: a new key's name costs no regex
def _name_head(gpu: str) -> str:
    head = _UNSAFE_IN_NAME.sub("-", gpu)
    return head if head[:1].isalnum() else f"a{head}"


def qualified(kind: str, name: str) -> str:
    return f"{kind}={name}"


@functools.lru_cache(maxsize=4096)  # pathlib joins cost more than the lookup
def spec_path(cdi_dir: Path, name: str) -> Path:
    return cdi_dir / f"{SPEC_PREFIX}{name}.json"


def claim_spec_path(cdi_dir: Path, claim_uid: str) -> Path:
    return cdi_dir / f"{CLAIM_SPEC_PREFIX}{claim_uid}.json"


def memory_limit_hook(nvidia_ctk_path: str, driver_root: str, gpu: str) -> dict[str, Any]:
    """The toolkit's createRuntime hook applying NVIDIA_GPU_MEMORY_REQUEST/LIMIT for `gpu`."""
    return {
        "hookName": "createRuntime",
        "path": nvidia_ctk_path,
        "args": [
            "nvidia-ctk",
            "hook",
            "apply-cuda-memory-limits",
            "--driver-root",
            driver_root,
            "--gpu-id",
            gpu,
        ],
    }


# The toolkit's spec sets it to `void` so the legacy runtime hook stays out; a value from us
# would (depending on merge order) name the GPU and have that hook inject it a second time.
VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"


def without_visible_devices(env: Mapping[str, str]) -> dict[str, str]:
    """`env` as our CDI device may carry it: everything but NVIDIA_VISIBLE_DEVICES."""
    return {k: v for k, v in env.items() if k != VISIBLE_DEVICES}


def build_spec(
    name: str,
    env: Mapping[str, str],
    mounts: Iterable[CdiMount] = (),
    hooks: Iterable[Mapping[str, Any]] = (),
    kind: str = KIND,
) -> dict[str, Any]:
    return device_spec(name, container_edits(env, mounts, hooks), kind)


def container_edits(
    env: Mapping[str, str],
    mounts: Iterable[CdiMount] = (),
    hooks: Iterable[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """One device's `containerEdits`: env (never NVIDIA_VISIBLE_DEVICES: the driver's spec
    sets it to `void` to keep the legacy runtime hook out, and ours would override it
    depending on device order, DESIGN 3b), then mounts and hooks when there are any."""
    own = without_visible_devices(env)
    edits: dict[str, Any] = {"env": [f"{k}={v}" for k, v in own.items()]}
    mount_list = [
        {
            "hostPath": m.host_path,
            "containerPath": m.container_path,
            "options": ["rbind", "ro" if m.read_only else "rw"],
        }
        for m in mounts
    ]
    if mount_list:
        edits["mounts"] = mount_list
    hook_list = [dict(h) for h in hooks]
    if hook_list:
        edits["hooks"] = hook_list
    return edits


def device_spec(
    name: str, edits: Mapping[str, Any], kind: str = KIND, version: str | None = None
) -> dict[str, Any]:
    """A spec of the one device `name` with `edits`; `version`: its cdiVersion when the
    caller worked it out for a spec of the same shape, else the lowest that fits."""
    spec: dict[str, Any] = {
        "cdiVersion": version or "",
        "kind": kind,
        "devices": [{"name": name, "containerEdits": edits}],
    }
    if version is None:
        spec["cdiVersion"] = required_version(spec)
    return spec


def required_version(spec: Mapping[str, Any]) -> str:
    """The lowest cdiVersion that has every field `spec` uses (CDI SPEC.md version table)."""
    devices = spec.get("devices", [])
    edits = [spec.get("containerEdits") or {}] + [d.get("containerEdits") or {} for d in devices]
    if any(e.get("additionalGids") or e.get("intelRdt") for e in edits):
        return "0.7.0"
    kind_class = str(spec.get("kind", "")).partition("/")[2]
    if spec.get("annotations") or any(d.get("annotations") for d in devices) or "." in kind_class:
        return "0.6.0"
    host_nodes = any(n.get("hostPath") for e in edits for n in e.get("deviceNodes", []))
    if host_nodes or any(str(d.get("name", "x"))[:1].isdigit() for d in devices):
        return "0.5.0"
    if any(m.get("type") for e in edits for m in e.get("mounts", [])):
        return "0.4.0"
    return "0.3.0"


def encode_spec(spec: Mapping[str, Any]) -> str:
    """The JSON text a spec file holds (compact: the C encoder; indent= takes the slow one)."""
    return json.dumps(spec, separators=(",", ":"))


def write_spec(
    cdi_dir: Path,
    spec: Mapping[str, Any],
    path: Path | None = None,
    known: Mapping[str, Any] | None = None,
    text: str | None = None,
    checked: bool = False,
    new: bool = False,
) -> Path:
    """Validate and atomically write `spec` into `cdi_dir`, mode 0644; the file is named for
    its first device unless `path` (inside `cdi_dir`) is given. `known`: the body this path
    was last written with, when the caller keeps it (the ledger): the same again, and the
    file still there, is neither validated again nor read back. `text`: `encode_spec(spec)`,
    when the caller has it already. `checked`: the caller validated a spec of this shape
    (same edits and version, a name that `device_name` made). `new`: the caller holds no
    record of a file at `path`, so none is read back to compare (one there is replaced)."""
    if path is None:
        path = spec_path(cdi_dir, spec["devices"][0]["name"])
    if known is not None and known == spec and os.path.isfile(path):
        return path  # the same allocation again (an app container after its init)
    problems = [] if checked else validate_spec(spec)
    if problems:
        raise CdiError("; ".join(problems))
    fsutil.ensure_dir(cdi_dir, 0o755)
    data = (encode_spec(spec) if text is None else text).encode() + b"\n"
    if not new:
        with contextlib.suppress(OSError):
            if path.read_bytes() == data:
                return path  # the same allocation again (an app container after its init)
    # /var/run/cdi is tmpfs: durability past a power loss is moot, latency is not. The temp
    # file must sit in the same directory: the CDI cache of containerd and CRI-O refreshes on
    # Rename, Remove and Write, and on Linux most releases ignore Create, so a spec renamed in
    # from elsewhere (a Create only) would stay unseen; the temp name's Rename is what it sees.
    fsutil.atomic_write(path, data, 0o644, durable=False)
    return path


def remove_spec(path: Path) -> bool:
    return fsutil.remove(path)


def version_tuple(text: str) -> tuple[int, ...]:
    """`0.6.0` as (0, 6, 0), to compare cdiVersions."""
    return tuple(int(p) for p in text.split("."))


def valid_name(name: str) -> bool:
    """A CDI device name: letters, digits, `_ - . :`, starting with a letter or digit."""
    return _NAME.fullmatch(name) is not None


def validate_spec(spec: Mapping[str, Any]) -> list[str]:
    """Every broken field rule of reference/cdi-facts.md, as `path: message`; empty when valid."""
    problems: list[str] = []
    version = spec.get("cdiVersion")
    if not isinstance(version, str) or not re.fullmatch(r"\d+\.\d+\.\d+", version):
        problems.append("cdiVersion: must be a version string such as 0.6.0")
    elif version_tuple(version) < version_tuple(required_version(spec)):
        problems.append(f"cdiVersion: {version} lacks fields used (needs {required_version(spec)})")
    kind = spec.get("kind")
    if not isinstance(kind, str) or not _KIND.fullmatch(kind):
        problems.append("kind: must be vendor.com/class")
    devices = spec.get("devices")
    if not isinstance(devices, list) or not devices:
        problems.append("devices: required, a non-empty list")
        devices = []
    names: set[str] = set()
    for i, device in enumerate(devices):
        p = f"devices[{i}]"
        name = device.get("name") if isinstance(device, Mapping) else None
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            problems.append(f"{p}.name: required; letters, digits, _ - . : only")
        elif name in names:
            problems.append(f"{p}.name: duplicate {name!r}")
        else:
            names.add(name)
        edits = device.get("containerEdits") if isinstance(device, Mapping) else None
        if not isinstance(edits, Mapping):
            problems.append(f"{p}.containerEdits: required")
            continue
        if not any(edits.get(k) for k in _EDIT_FIELDS):
            # The CDI library refuses the whole spec: "invalid device, empty device edits".
            problems.append(f"{p}.containerEdits: invalid device, empty device edits")
        problems.extend(_edit_problems(edits, f"{p}.containerEdits"))
    if "containerEdits" in spec:
        problems.extend(_edit_problems(spec["containerEdits"], "containerEdits"))
    return problems


_EDIT_FIELDS = ("env", "deviceNodes", "mounts", "hooks", "additionalGids", "intelRdt")


def _edit_problems(edits: Mapping[str, Any], p: str) -> list[str]:
    problems: list[str] = []
    problems += [f"{p}.{k}: unknown field" for k in edits if k not in _EDIT_FIELDS]
    for i, env in enumerate(edits.get("env", [])):
        if not isinstance(env, str) or not _ENV.match(env):
            problems.append(f"{p}.env[{i}]: must be NAME=value")
    for i, node in enumerate(edits.get("deviceNodes", [])):
        if not isinstance(node, Mapping) or not str(node.get("path", "")).startswith("/"):
            problems.append(f"{p}.deviceNodes[{i}].path: required, absolute")
    for i, mount in enumerate(edits.get("mounts", [])):
        q = f"{p}.mounts[{i}]"
        if not isinstance(mount, Mapping):
            problems.append(f"{q}: must be a mapping")
            continue
        for field in ("hostPath", "containerPath"):
            if not str(mount.get(field, "")).startswith("/"):
                problems.append(f"{q}.{field}: required, absolute")
        options = mount.get("options")
        if not isinstance(options, list) or not {"bind", "rbind"} & set(options):
            problems.append(f"{q}.options: a bind mount needs bind or rbind")
        elif not {"rw", "ro"} & set(options):
            problems.append(f"{q}.options: say rw or ro")
    for i, hook in enumerate(edits.get("hooks", [])):
        q = f"{p}.hooks[{i}]"
        if not isinstance(hook, Mapping) or hook.get("hookName") not in HOOK_NAMES:
            problems.append(f"{q}.hookName: must be one of {', '.join(HOOK_NAMES)}")
            continue
        if not str(hook.get("path", "")).startswith("/"):
            problems.append(f"{q}.path: required, absolute")
        args = hook.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            problems.append(f"{q}.args: must be a list of strings")
    return problems
