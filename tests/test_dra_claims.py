"""ClaimReader against the stand-in API server over real HTTP, and the Preparer on top of it:
only the claims the kubelet names are read, one GET each, several at once, nothing listed or
watched and nothing kept, so a claim allocated again under the same UID is prepared from its
new allocation."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.dra.claims import ClaimReader
from deviceplugin.dra.prepare import ClaimRef, ClaimsUnavailable
from deviceplugin.kube.client import Api, KubeError
from deviceplugin.simulate.apiserver import FakeApiServer
from tests.test_dra_prepare import Rig, claim, result


def gets(fake: FakeApiServer) -> int:
    """GETs of single claims (a list would be GET …/resourceclaims without a name)."""
    return len(fake.requests_for("GET", "/resourceclaims/"))


def lists(fake: FakeApiServer) -> int:
    return len([r for r in fake.requests if r.path.endswith("/resourceclaims")])


def test_reads_only_the_named_claims_one_get_each(fake: FakeApiServer, api: Api) -> None:
    for n in range(3):
        fake.dra.add_claim(claim(f"u{n}", name=f"c{n}"))
    fake.dra.add_claim(claim("other", name="not-ours"))
    reader = ClaimReader(api)
    try:
        got = reader.get_many([("default", "c0"), ("default", "c2"), ("default", "c0")])
        assert {k: v["metadata"]["uid"] for k, v in got.items()} == {  # type: ignore[index]
            ("default", "c0"): "u0",
            ("default", "c2"): "u2",
        }
        assert gets(fake) == 2 and lists(fake) == 0  # no list, no watch, no duplicate GET
        assert reader.get("default", "missing") is None
    finally:
        reader.stop()


def test_an_unreachable_server_is_unavailable_for_that_claim_only(
    fake: FakeApiServer, api: Api
) -> None:
    fake.dra.add_claim(claim("u1", name="c1"))
    reader = ClaimReader(api)
    fake.fail_next[("GET", "namespaces")] = [503]
    got = reader.get_many([("default", "c1")])
    assert isinstance(got[("default", "c1")], ClaimsUnavailable)
    assert reader.get("default", "c1") is not None  # the next try goes through
    reader.stop()


class SlowApi:
    """An API whose claim GET takes a round trip of `delay` seconds."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.inside = 0
        self.most = 0
        self._lock = threading.Lock()

    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        with self._lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
        time.sleep(self.delay)
        with self._lock:
            self.inside -= 1
        if name == "gone":
            raise KubeError("get", 404)
        return claim(name, name=name)


def test_gets_for_several_claims_run_at_once() -> None:
    api = SlowApi(0.3)
    reader = ClaimReader(api)  # type: ignore[arg-type]
    started = time.monotonic()
    got = reader.get_many([("default", f"c{n}") for n in range(6)] + [("default", "gone")])
    took = time.monotonic() - started
    reader.stop()
    assert got[("default", "gone")] is None and len(got) == 7
    assert api.most == 7 and took < 1.2  # one after another: 2.1 s


@pytest.fixture
def rig(tmp_path: Path, api: Api) -> Rig:
    rig = Rig(tmp_path)
    rig.claims = ClaimReader(api)  # type: ignore[assignment]
    rig.fresh()
    return rig


def test_a_claim_allocated_again_with_its_uid_is_prepared_from_the_new_allocation(
    fake: FakeApiServer, rig: Rig
) -> None:
    ref = ClaimRef("default", "c1", "u1")
    fake.dra.add_claim(claim("u1", result("gpu-0", "4Gi", share="s-1"), name="c1"))
    first = rig.preparer.prepare([ref])["u1"]
    assert first.error is None and first.devices[0].device_name == "gpu-0"
    assert rig.preparer.prepare([ref])["u1"] == first  # answered from the checkpoint
    assert gets(fake) == 1
    assert rig.preparer.unprepare([ref]) == {"u1": None}
    # Deallocated and allocated again, same UID: now the whole GPU 2.
    fake.dra.add_claim(claim("u1", result("gpu-2", None, share=None), name="c1"))
    again = rig.preparer.prepare([ref])["u1"]
    assert again.error is None and again.devices[0].device_name == "gpu-2"
    assert gets(fake) == 2 and lists(fake) == 0
    rig.claims.stop()  # type: ignore[attr-defined]
