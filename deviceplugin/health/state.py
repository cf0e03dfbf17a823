"""The health state file and the operator's clear requests, shared by the monitor and the CLI.

The running monitor keeps `<state-dir>/health.json` (rewritten atomically on every change) so
`gpu-fraction-plugin health` can show per-GPU, per-domain causes without talking to it.
`health clear --gpu UUID` drops a request file into `<state-dir>/health-clear/`; the monitor
consumes it at its next probe. No sockets: the state dir is the only contract.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deviceplugin.model import GpuUuid
from deviceplugin.plumbing import fsutil

STATE_FILE = "health.json"
CLEAR_DIR = "health-clear"
STATE_VERSION = 1

# A GPU UUID is also a file name here, so only its own alphabet passes.
_UUID_RE = re.compile(r"^GPU-[0-9A-Za-z-]{1,64}$")


class HealthStateError(Exception):
    """The state file is missing or unreadable, or a clear request is malformed."""


def state_path(state_dir: Path) -> Path:
    return state_dir / STATE_FILE


def clear_dir(state_dir: Path) -> Path:
    return state_dir / CLEAR_DIR


def write_health(state_dir: Path, data: Mapping[str, Any]) -> None:
    """Replace the state file; readers see the old or the new file, never a mix."""
    body = json.dumps(dict(data), indent=2, sort_keys=True).encode()
    # No fsync: the file describes the running process and is rewritten at every change.
    fsutil.atomic_write(state_path(state_dir), body, 0o600, durable=False)


def read_health(state_dir: Path) -> dict[str, Any]:
    """The state file as written by the running monitor; HealthStateError when absent or bad."""
    path = state_path(state_dir)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise HealthStateError(
            f"no health state at {path}: is the plugin running with --state-dir {state_dir}?"
        ) from None
    except OSError as err:
        raise HealthStateError(f"cannot read {path}: {err.strerror}") from None
    try:
        data = json.loads(text)
    except ValueError as err:
        raise HealthStateError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), dict):
        raise HealthStateError(f"{path} has no 'gpus' map")
    return data


def check_uuid(gpu: str) -> GpuUuid:
    if not _UUID_RE.fullmatch(gpu):  # fullmatch: `$` would let a trailing newline in
        raise HealthStateError(f"{gpu!r} is not a GPU UUID (GPU-xxxxxxxx-...)")
    return GpuUuid(gpu)


def request_clear(state_dir: Path, gpu_uuid: str, wall: float | None = None) -> None:
    """Ask the running monitor to accept `gpu_uuid` as recovered (where NVML cannot say).

    The monitor consumes the request at its next probe; the quiet period still applies.
    """
    uuid = check_uuid(gpu_uuid)
    directory = clear_dir(state_dir)
    if not state_dir.is_dir():
        raise HealthStateError(f"state dir {state_dir} does not exist")
    if directory.exists() and not directory.is_dir():
        directory.unlink()  # junk where the requests go must not block a clear
    directory.mkdir(mode=0o700, exist_ok=True)
    body = json.dumps({"gpu": uuid, "requestedAt": time.time() if wall is None else wall})
    fsutil.atomic_write(directory / f"{uuid}.json", body.encode(), 0o600, durable=False)


def pending_clears(state_dir: Path) -> list[GpuUuid]:
    """UUIDs with a clear request not yet consumed, in name order."""
    directory = clear_dir(state_dir)
    if not directory.is_dir():
        return []
    out: list[GpuUuid] = []
    for path in sorted(directory.glob("GPU-*.json")):
        name = path.name.removesuffix(".json")
        if _UUID_RE.fullmatch(name):
            out.append(GpuUuid(name))
    return out


def take_clears(state_dir: Path) -> list[GpuUuid]:
    """Consume every pending request (the monitor's side); malformed names are removed too."""
    directory = clear_dir(state_dir)
    if not directory.is_dir():
        return []
    taken: list[GpuUuid] = []
    for path in sorted(directory.iterdir()):
        if path.name.startswith("."):
            continue  # a writer's temp file
        name = path.name.removesuffix(".json")
        try:
            _remove(path)
        except FileNotFoundError:
            continue  # another reader took it
        except OSError:
            pass  # cannot be removed: still a request (a clear is idempotent), never a blocker
        if path.suffix == ".json" and _UUID_RE.fullmatch(name):
            taken.append(GpuUuid(name))
    return taken


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _when(wall: object) -> str:
    if not isinstance(wall, int | float):
        return "-"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))


def format_health_table(data: Mapping[str, Any]) -> str:
    """One row per GPU and faulted domain (one row for a GPU without faults)."""
    lines: list[str] = []
    monitor = data.get("monitor", {})
    running = monitor.get("running", False)
    status = f"running (pid {monitor.get('pid', '?')})" if running else "not running"
    lines.append(f"monitor: {status}, updated {_when(data.get('updatedAt'))}")
    rows: list[tuple[str, ...]] = [
        ("INDEX", "GPU", "MODE", "HEALTH", "DOMAIN", "CAUSE", "SINCE", "PHASE")
    ]
    gpus: Mapping[str, Any] = data.get("gpus", {})
    for uuid, gpu in sorted(gpus.items(), key=lambda kv: (kv[1].get("index", 0), kv[0])):
        head = (str(gpu.get("index", "-")), uuid, str(gpu.get("mode", "-")))
        health = str(gpu.get("health", "-"))
        faults: Mapping[str, Any] = gpu.get("faults", {})
        if not faults:
            rows.append((*head, health, "-", "-", "-", "-"))
        for domain, fault in sorted(faults.items()):
            phase = str(fault.get("phase", "-"))
            if fault.get("quietUntil") is not None:
                phase += f" until {_when(fault['quietUntil'])}"
            rows.append(
                (
                    *head,
                    health,
                    domain,
                    str(fault.get("cause", "")),
                    _when(fault.get("since")),
                    phase,
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines.extend(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )
    return "\n".join(lines) + "\n"
