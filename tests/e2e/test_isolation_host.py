"""The host never sees the suite's world: while the namespace is live, the host's mount
table is what it was before the session, and its /dev, /run and /var/lib hold none of the
stand-ins that the namespace does. (The session's teardown checks the same after the end,
and that no container, image, process or cgroup is left.)"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import E2E, host_state

pytestmark = pytest.mark.e2e


def test_the_host_sees_nothing_of_the_namespace(e2e: E2E) -> None:
    inside = e2e.ns.run("sh", "-c", "ls /dev | grep '^nvidia'; test -d /run/cdi && echo cdi")
    minors = [g.minor for g in e2e.spec.gpus]
    assert {f"nvidia{m}" for m in minors} | {"nvidiactl", "cdi"} <= set(inside.split())
    # mount table, /dev/nvidia*, podman's default state dirs, /etc/cdi and /run/cdi
    assert host_state() == e2e.host_before
