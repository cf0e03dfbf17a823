"""What the last start saw of each GPU, kept so a GPU lost across a restart keeps its slices.

A GPU that fell off the bus answers nothing, not even its memory size; without the last known
record its device IDs would vanish from the plan instead of showing Unhealthy.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from deviceplugin.inventory.gpus import Gpu, Inventory
from deviceplugin.model import GpuUuid
from deviceplugin.plumbing import fsutil, logs

LOG = logs.get("inventory")
FILE = "inventory.json"


def _load(state_dir: Path) -> dict[str, dict[str, object]]:
    path = state_dir / FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logs.log(LOG, "inventory cache unreadable; rebuilt", level=logging.WARNING, error=str(exc))
        return {}
    return data if isinstance(data, dict) else {}


def _gpu(data: dict[str, object]) -> Gpu | None:
    try:
        fields = dict(data)
        fields["uuid"] = GpuUuid(str(fields["uuid"]))
        fields["compute_capability"] = tuple(fields["compute_capability"])  # type: ignore[arg-type]
        return Gpu(**fields)  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError):
        return None


def with_remembered(inventory: Inventory, state_dir: Path) -> Inventory:
    """Fill each lost GPU from the last record of it; remember the GPUs that answered."""
    known = _load(state_dir)
    gpus: list[Gpu] = []
    for gpu in inventory.gpus:
        cached = _gpu(known[gpu.uuid]) if gpu.lost and gpu.uuid in known else None
        if cached is not None:
            gpus.append(dataclasses.replace(cached, index=gpu.index, lost=True))
            logs.log(LOG, "lost GPU kept from last inventory", gpu=gpu.uuid)
        else:
            gpus.append(gpu)
        if not gpu.lost:
            known[gpu.uuid] = dataclasses.asdict(gpu)
    fsutil.atomic_write(
        state_dir / FILE, json.dumps(known, indent=1, sort_keys=True).encode(), 0o600
    )
    return dataclasses.replace(inventory, gpus=tuple(gpus))
