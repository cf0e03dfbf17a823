"""Xid classification: which fault domain an Xid (or a recovery action) takes down.

Config `health` names the application, reset, reboot and ignored Xids; an Xid it does not name
follows the "immediate action" column of NVIDIA's catalog (reference nvml-mps-xid.md 4.2),
and an Xid the catalog does not know either (999, legacy codes) counts as reset-class.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from deviceplugin.config.settings import HealthConfig


class XidClass(StrEnum):
    APPLICATION = "application"  # the app's fault: only an MPS server's clients are poisoned
    RESET = "reset"  # the GPU needs a reset: every slice of it
    REBOOT = "reboot"  # the node needs a reboot (GPU lost): every slice of it
    FOLLOW_UP = "follow-up"  # Xid 154: re-read the recovery action and act on that
    IGNORED = "ignored"  # informational: no health change


UNKNOWN_XID = 999  # what NVML puts in eventData for an Xid it cannot name
FOLLOW_UP_XIDS = frozenset({154})

# The catalog's immediate action for the Xids config does not name (reference 4.2).
# RESTART_APP -> application; IGNORE -> ignored; RESTART_BM / RESTART_VM -> reboot;
# RESET_GPU and the ECC/NVLink workflows -> reset (conservative: they may need one).
_CATALOG_APPLICATION = frozenset(
    {8, 13, 31, 32, 39, 40, 41, 43, 45, 68, 69, 70, 71, 72, 75, 76, 77, 80, 82, 83, 84, 85, 86}
    | {88, 89, 94, 126, 127, 128, 129, 130, 131, 132, 133, 134, 135, 139}
    | set(range(96, 106))
)
_CATALOG_IGNORED = frozenset({38, 63, 92, 121, 157, 161})
_CATALOG_REBOOT = frozenset({79, 151, 160})
_CATALOG_RESET = frozenset(
    {46, 48, 62, 64, 74, 95, 109, 110, 119, 120, 136, 140, 143, 155, 156, 158, 159}
    | set(range(144, 151))
)

# NVML_GPU_RECOVERY_ACTION_* (field 230, reference 2.5).
RECOVERY_ACTION_NAMES: dict[int, str] = {
    0: "none",
    1: "gpu-reset",
    2: "node-reboot",
    3: "drain-p2p",
    4: "drain-and-reset",
    5: "recover-imex-domain",
    6: "bus-reset",
    7: "system-reboot",
}
RECOVERY_NONE = 0
_REBOOT_ACTIONS = frozenset({2, 7})


def catalog_class(xid: int) -> XidClass:
    """The catalog's bucket for `xid`; unknown Xids are reset-class (DESIGN section 5)."""
    if xid in FOLLOW_UP_XIDS:
        return XidClass.FOLLOW_UP
    if xid in _CATALOG_APPLICATION:
        return XidClass.APPLICATION
    if xid in _CATALOG_IGNORED:
        return XidClass.IGNORED
    if xid in _CATALOG_REBOOT:
        return XidClass.REBOOT
    return XidClass.RESET


@dataclass(frozen=True)
class XidPolicy:
    """The configured lists; `classify` tries them before the catalog."""

    ignored: frozenset[int]
    application: frozenset[int]
    reset: frozenset[int]
    reboot: frozenset[int]

    @classmethod
    def from_config(cls, health: HealthConfig) -> XidPolicy:
        return cls(
            ignored=frozenset(health.ignored_xids),
            application=frozenset(health.application_xids),
            reset=frozenset(health.reset_xids),
            reboot=frozenset(health.reboot_xids),
        )

    def classify(self, xid: int) -> XidClass:
        # An operator's ignore wins; then the named classes, then the catalog.
        if xid in self.ignored:
            return XidClass.IGNORED
        if xid in self.application:
            return XidClass.APPLICATION
        if xid in self.reset:
            return XidClass.RESET
        if xid in self.reboot:
            return XidClass.REBOOT
        return catalog_class(xid)


def classify_xid(xid: int, health: HealthConfig | None = None) -> XidClass:
    """Classify one Xid with the config's lists (defaults when `health` is None)."""
    return XidPolicy.from_config(health or HealthConfig()).classify(xid)


def recovery_action_class(action: int) -> XidClass | None:
    """What a recovery action asks for: None for NONE, reboot for the reboots, else reset."""
    if action == RECOVERY_NONE:
        return None
    return XidClass.REBOOT if action in _REBOOT_ACTIONS else XidClass.RESET


def recovery_action_name(action: int) -> str:
    return RECOVERY_ACTION_NAMES.get(action, f"unknown-{action}")


# A double-bit ECC event: uncorrectable memory error, the GPU needs a reset.
DOUBLE_BIT_ECC_CLASS = XidClass.RESET
