"""Xid classification: config lists first, then the catalog's immediate action, unknown = reset."""

from __future__ import annotations

import pytest

from deviceplugin.config.settings import (
    DEFAULT_APPLICATION_XIDS,
    DEFAULT_REBOOT_XIDS,
    DEFAULT_RESET_XIDS,
    HealthConfig,
)
from deviceplugin.health.xid import (
    UNKNOWN_XID,
    XidClass,
    XidPolicy,
    catalog_class,
    classify_xid,
    recovery_action_class,
    recovery_action_name,
)
from deviceplugin.simulate.nvml import XidClass as FakeXidClass
from deviceplugin.simulate.nvml import classify_xid as fake_classify


@pytest.mark.parametrize("xid", DEFAULT_APPLICATION_XIDS)
def test_default_application_xids(xid: int) -> None:
    assert classify_xid(xid) is XidClass.APPLICATION


@pytest.mark.parametrize("xid", DEFAULT_RESET_XIDS)
def test_default_reset_xids(xid: int) -> None:
    assert classify_xid(xid) is XidClass.RESET


@pytest.mark.parametrize("xid", DEFAULT_REBOOT_XIDS)
def test_default_reboot_xids(xid: int) -> None:
    assert classify_xid(xid) is XidClass.REBOOT


@pytest.mark.parametrize(
    ("xid", "expected"),
    [
        (154, XidClass.FOLLOW_UP),  # recovery action changed: re-read field 230
        (8, XidClass.APPLICATION),  # RESTART_APP, not named in config
        (32, XidClass.APPLICATION),
        (100, XidClass.APPLICATION),  # 96-105 decoder/JPEG
        (38, XidClass.IGNORED),  # IGNORE
        (63, XidClass.IGNORED),  # pending row remap
        (92, XidClass.IGNORED),
        (151, XidClass.REBOOT),  # RESTART_VM
        (74, XidClass.RESET),  # NVLink workflow: conservative
        (146, XidClass.RESET),
        (UNKNOWN_XID, XidClass.RESET),
        (1, XidClass.RESET),  # legacy "contact support"
        (4242, XidClass.RESET),
    ],
)
def test_catalog_for_xids_config_does_not_name(xid: int, expected: XidClass) -> None:
    assert classify_xid(xid) is expected


def test_config_lists_override_the_catalog() -> None:
    health = HealthConfig(
        ignored_xids=(13, 79),
        application_xids=(109,),
        reset_xids=(8,),
        reboot_xids=(48,),
    )
    policy = XidPolicy.from_config(health)
    assert policy.classify(13) is XidClass.IGNORED
    assert policy.classify(79) is XidClass.IGNORED  # ignore wins over the catalog's reboot
    assert policy.classify(109) is XidClass.APPLICATION
    assert policy.classify(8) is XidClass.RESET
    assert policy.classify(48) is XidClass.REBOOT
    # Not named: the catalog decides.
    assert policy.classify(31) is XidClass.APPLICATION
    assert policy.classify(62) is XidClass.RESET


def test_ignore_beats_other_lists() -> None:
    health = HealthConfig(ignored_xids=(48,), reset_xids=(48,))
    assert classify_xid(48, health) is XidClass.IGNORED


@pytest.mark.parametrize("xid", range(1, 170))
def test_catalog_agrees_with_the_fake_on_hardware_effects(xid: int) -> None:
    """The fake decides what NVML does after an Xid; the plugin must read it the same way."""
    fake = fake_classify(xid)
    ours = catalog_class(xid)
    expected = {
        FakeXidClass.APPLICATION: {XidClass.APPLICATION},
        FakeXidClass.RESET: {XidClass.RESET},
        FakeXidClass.REBOOT: {XidClass.REBOOT},
        FakeXidClass.LOST: {XidClass.REBOOT},
        FakeXidClass.IGNORE: {XidClass.IGNORED, XidClass.FOLLOW_UP},
    }[fake]
    assert ours in expected


@pytest.mark.parametrize(
    ("action", "cls", "name"),
    [
        (0, None, "none"),
        (1, XidClass.RESET, "gpu-reset"),
        (2, XidClass.REBOOT, "node-reboot"),
        (3, XidClass.RESET, "drain-p2p"),
        (4, XidClass.RESET, "drain-and-reset"),
        (6, XidClass.RESET, "bus-reset"),
        (7, XidClass.REBOOT, "system-reboot"),
        (99, XidClass.RESET, "unknown-99"),
    ],
)
def test_recovery_actions(action: int, cls: XidClass | None, name: str) -> None:
    assert recovery_action_class(action) is cls
    assert recovery_action_name(action) == name
