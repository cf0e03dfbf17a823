"""ClaimStatusWriter against the stand-in API server: the first write UPDATEs from the copy of
the claim that prepare read (no GET: one round trip per claim, not two); a stale copy gets
the API server's 409 and the retry reads the claim afresh."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from deviceplugin.dra.checkpoint import ClaimEntry, DeviceEntry, State
from deviceplugin.dra.slices import DRIVER
from deviceplugin.dra.status import Backoff, ClaimStatusWriter
from deviceplugin.kube.client import Api
from deviceplugin.model import GIB
from deviceplugin.simulate.apiserver import FakeApiServer
from tests.conftest import API_NODE as NODE


def allocated_claim(name: str) -> dict[str, Any]:
    result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0",
              "consumedCapacity": {"memory": "1Gi"}, "shareID": "s-1"}  # fmt: skip
    selector = {"key": "metadata.name", "operator": "In", "values": [NODE]}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": "default", "name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "time-slicing.gpu-fraction.dev"}}]}},
        "status": {"allocation": {
            "devices": {"results": [result]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [selector]}]}}},
    }  # fmt: skip


def entry_for(stored: dict[str, Any]) -> ClaimEntry:
    meta = stored["metadata"]
    device = DeviceEntry(
        request="gpu", pool=NODE, device="gpu-0", gpu="GPU-0", mode="time-slicing",
        share_id="s-1", request_bytes=GIB, limit_mib=1024, enforcement=("cuda-memory-limits",),
        ceiling_source=None, ceiling_policy=None, cdi_device_ids=("nvidia.com/gpu=GPU-0",),
    )  # fmt: skip
    return ClaimEntry(meta["uid"], meta["namespace"], meta["name"], State.COMPLETED, (device,))


def claim_gets(fake: FakeApiServer, name: str) -> int:
    return sum(1 for r in fake.requests_for("GET", f"/resourceclaims/{name}"))


def wait_written(writer: ClaimStatusWriter, count: int) -> None:
    deadline = time.monotonic() + 10
    while writer.written < count:
        assert time.monotonic() < deadline, (writer.failures, writer.last_error)
        time.sleep(0.02)


def test_the_first_write_uses_prepares_copy_without_a_get(
    fake: FakeApiServer,
    api: Api,
    tmp_path: Path,
) -> None:
    stored = fake.dra.add_claim(allocated_claim("c1"))
    writer = ClaimStatusWriter(api, DRIVER, NODE, tmp_path)
    writer.start()
    try:
        writer.submit(entry_for(stored), stored)
        wait_written(writer, 1)
    finally:
        writer.stop()
    assert claim_gets(fake, "c1") == 0
    (device,) = fake.dra.claims[("default", "c1")]["status"]["devices"]
    assert device["data"]["requestMiB"] == 1024 and device["shareID"] == "s-1"


def test_a_stale_copy_is_refused_and_the_retry_reads_the_claim(
    fake: FakeApiServer,
    api: Api,
    tmp_path: Path,
) -> None:
    stale = fake.dra.add_claim(allocated_claim("c2"))
    fake.dra.add_claim({**allocated_claim("c2"), "metadata": dict(stale["metadata"])})  # bumps rv
    writer = ClaimStatusWriter(api, DRIVER, NODE, tmp_path, backoff=Backoff(first=0.05))
    writer.start()
    try:
        writer.submit(entry_for(stale), stale)
        wait_written(writer, 1)
    finally:
        writer.stop()
    assert writer.failures == 1 and "409" in str(writer.last_error)
    assert claim_gets(fake, "c2") == 1  # only the retry read it
    assert fake.dra.claims[("default", "c2")]["status"]["devices"][0]["device"] == "gpu-0"


def test_without_a_copy_the_writer_reads_the_claim(
    fake: FakeApiServer,
    api: Api,
    tmp_path: Path,
) -> None:
    stored = fake.dra.add_claim(allocated_claim("c3"))
    writer = ClaimStatusWriter(api, DRIVER, NODE, tmp_path)
    writer.start()
    try:
        writer.submit(entry_for(stored))
        wait_written(writer, 1)
    finally:
        writer.stop()
    assert claim_gets(fake, "c3") == 1


def test_a_claim_that_already_holds_the_record_is_not_written_again(
    fake: FakeApiServer, api: Api, tmp_path: Path
) -> None:
    stored = fake.dra.add_claim(allocated_claim("c4"))
    writer = ClaimStatusWriter(api, DRIVER, NODE, tmp_path)
    assert writer.write(entry_for(stored), stored) == "written"
    puts = len(fake.requests_for("PUT", "/resourceclaims/c4/status"))
    again = ClaimStatusWriter(api, DRIVER, NODE, tmp_path)  # as after a restart: no copy
    assert again.write(entry_for(stored)) == "unchanged"
    assert len(fake.requests_for("PUT", "/resourceclaims/c4/status")) == puts == 1


def test_a_claim_due_after_one_already_waiting_does_not_wake_the_writer(
    fake: FakeApiServer,
    api: Api,
    tmp_path: Path,
) -> None:
    """A prepare of 8 claims wakes the writer once, not 8 times: each wake-up is a thread
    taking the GIL while the prepare's reply is still being built."""
    first = fake.dra.add_claim(allocated_claim("c1"))
    second = fake.dra.add_claim(allocated_claim("c2"))
    writer = ClaimStatusWriter(api, DRIVER, NODE, tmp_path, delay=0.5)
    sets: list[float] = []
    real_set = writer._wake.set

    def counting_set() -> None:
        sets.append(time.monotonic())
        real_set()

    writer._wake.set = counting_set  # type: ignore[method-assign]
    writer.start()
    try:
        writer.submit(entry_for(first), first)
        deadline = time.monotonic() + 5
        while writer._asleep_until == float("-inf") or writer._asleep_until == float("inf"):
            assert time.monotonic() < deadline, "the writer never went to sleep until c1"
            time.sleep(0.005)
        writer.submit(entry_for(second), second)  # due later than c1: the writer comes by
        assert len(sets) == 1
        wait_written(writer, 2)
    finally:
        writer.stop()


def test_the_fake_refuses_a_claim_status_the_schema_refuses(fake: FakeApiServer) -> None:
    # The schemas are compiled once per kind and version (dra_apiserver._validator); a field
    # the 1.36 and 1.37 schemas do not know in a status device entry is still a 422.
    import json
    import urllib.error
    import urllib.request

    stored = fake.dra.add_claim(allocated_claim("c1"))
    device = {"driver": DRIVER, "pool": NODE, "device": "gpu-0", "shareID": "s-1"}

    def put(status: dict[str, Any]) -> int:
        body = {**stored, "status": {**stored["status"], **status}}
        body["metadata"] = dict(fake.dra.claims[("default", "c1")]["metadata"])
        request = urllib.request.Request(
            f"{fake.url}/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/c1/status",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="PUT",
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return int(answer.status)
        except urllib.error.HTTPError as err:
            return int(err.code)

    assert put({"devices": [{**device, "readyness": "yes"}]}) == 422  # not a v1 field
    assert "devices" not in fake.dra.claims[("default", "c1")]["status"]
    assert put({"devices": [device]}) == 200
    assert fake.dra.claims[("default", "c1")]["status"]["devices"][0]["shareID"] == "s-1"


def test_a_permanent_refusal_is_not_retried_and_is_told_once(
    fake: FakeApiServer, api: Api, tmp_path: Path
) -> None:
    # 403: the node-scoped resourceclaims/driver permission missing on a 1.36+ cluster;
    # 422: a body the server will never take. Neither changes on a retry (409 and 429 may).
    told: list[tuple[str, int | None]] = []
    writer = ClaimStatusWriter(
        api, DRIVER, NODE, tmp_path, backoff=Backoff(first=0.05),
        on_abandoned=lambda e, err: told.append((e.name, err.status)),
    )  # fmt: skip
    claims = {name: fake.dra.add_claim(allocated_claim(name)) for name in ("p1", "p2", "p3")}
    fake.fail_next[("PUT", "namespaces")] = [403, 429]
    writer.start()
    try:
        writer.submit(entry_for(claims["p1"]), claims["p1"])  # 403: given up
        deadline = time.monotonic() + 10
        while not told:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        writer.submit(entry_for(claims["p2"]), claims["p2"])  # 429: retried, then written
        wait_written(writer, 1)
        fake.fail_next[("PUT", "namespaces")] = [422]
        writer.submit(entry_for(claims["p3"]), claims["p3"])
        while len(told) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.3)  # several backoffs: nothing more is tried for p1 or p3
    finally:
        writer.stop()
    assert told == [("p1", 403), ("p3", 422)]
    assert writer.abandoned == 2 and writer.pending() == 0
    assert len(fake.requests_for("PUT", "/resourceclaims/p1/status")) == 1
    assert len(fake.requests_for("PUT", "/resourceclaims/p3/status")) == 1
    assert len(fake.requests_for("PUT", "/resourceclaims/p2/status")) == 2
    writer.submit(entry_for(claims["p1"]), claims["p1"])  # a re-prepare does not try again
    assert writer.pending() == 0
