"""Pure: what a GPU's fault domains (DESIGN section 5) mean for its DRA device.

One cause per device, the most severe domain first: `xid-<n>` / `gpu-lost` (or another GPU
cause) for the GPU domain, `unmonitored`, `mps-down`, `mps-fault` (sm-sharing GPUs only).
The cause is the value of the device's taint `gpu-fraction.dev/unhealthy` in its slice and
the message of the health stream; `timeAdded` is when the fault began, so a republish of
the same fault writes the same taint.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

from deviceplugin.health.board import Fault
from deviceplugin.model import FaultDomain, Mode

TAINT_KEY = "gpu-fraction.dev/unhealthy"
LABEL_VALUE_MAX = 63  # a taint value is a label value

# Most severe first; CLIENT_LIMIT is capacity, not a fault: prepare refuses past maxClients.
_ORDER = (FaultDomain.GPU, FaultDomain.MONITOR, FaultDomain.MPS_DAEMON, FaultDomain.MPS_SERVER)
_FIXED = {
    FaultDomain.MONITOR: "unmonitored",
    FaultDomain.MPS_DAEMON: "mps-down",
    FaultDomain.MPS_SERVER: "mps-fault",
}
_XID = re.compile(r"(?:^|\s)xid=(\d+)")
_NOT_LABEL = re.compile(r"[^a-z0-9._-]+")


@dataclass(frozen=True)
class Cause:
    """Why one device is unhealthy: `value` for the taint, `detail` the board's own words."""

    value: str
    domain: FaultDomain
    detail: str
    since: float  # wall-clock seconds


def gpu_cause_value(cause: str) -> str:
    """`xid=79 class=reboot` → `xid-79`; `gpu-lost …`, `gpu-unavailable` → `gpu-lost`;
    anything else: its first word as a label value (`double-bit-ecc`, `recovery-action-reset`)."""
    xid = _XID.search(cause)
    if xid:
        return f"xid-{int(xid[1])}"
    first = cause.split(" ", 1)[0].lower()
    if first.startswith(("gpu-lost", "gpu-unavailable")):
        return "gpu-lost"
    value = _NOT_LABEL.sub("-", first.replace("=", "-")).strip("-._")[:LABEL_VALUE_MAX]
    return value.strip("-._") or "gpu-fault"


def device_cause(mode: Mode, faults: Mapping[FaultDomain, Fault]) -> Cause | None:
    """The cause that makes a device of a GPU in `mode` unhealthy, or None when healthy."""
    for domain in _ORDER:
        fault = faults.get(domain)
        if fault is None:
            continue
        if domain in (FaultDomain.MPS_DAEMON, FaultDomain.MPS_SERVER) and (
            mode is not Mode.SM_SHARING
        ):
            continue  # another mode's device does not depend on MPS
        value = gpu_cause_value(fault.cause) if domain is FaultDomain.GPU else _FIXED[domain]
        return Cause(value, domain, fault.cause, fault.since)
    return None


def time_added(since: float) -> str:
    """RFC 3339 at seconds precision (what the API server stores for a metav1.Time)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since))


def taint(cause: Cause, effect: str) -> dict[str, str]:
    return {
        "key": TAINT_KEY,
        "value": cause.value,
        "effect": effect,
        "timeAdded": time_added(cause.since),
    }


def cause_class(value: str) -> str:
    """A bounded metric label for a taint value: `xid-79` → `xid`; the fixed causes as they
    are; any other GPU cause → `gpu-other`."""
    if value.startswith("xid-"):
        return "xid"
    if value in ("gpu-lost", *_FIXED.values()):
        return value
    return "gpu-other"
