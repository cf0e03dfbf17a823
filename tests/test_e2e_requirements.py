"""The runtime suite's requirements check: what `make test` prints when it skips the suite."""

from __future__ import annotations

import pytest

from tests.e2e import requirements


def test_not_root_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(requirements.os, "geteuid", lambda: 1000)
    assert "needs root" in (requirements.missing() or "")


def test_missing_tools_name_the_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(requirements.os, "geteuid", lambda: 0)
    monkeypatch.setattr(requirements.shutil, "which", lambda tool: None)
    why = requirements.missing() or ""
    assert why.startswith("podman, runc, unshare, nsenter")
    assert "`make e2e-deps` installs podman runc busybox-static" in why
