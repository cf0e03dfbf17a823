"""ClaimStatusWriter against the stand-in API server: a forced server-side apply of only our
`status.devices` entries (never the scheduler's allocation or reservedFor, which the API
server compares as raw bytes and guards with `resourceclaims/binding`), deciding from the
copy of the claim that prepare read (no GET: one round trip per claim, not two); other
drivers' entries survive our write and our unprepare."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from deviceplugin.dra.checkpoint import ClaimEntry, DeviceEntry, State
from deviceplugin.dra.slices import DRIVER
from deviceplugin.dra.status import Backoff, ClaimStatusWriter, device_status
from deviceplugin.kube.client import Api
from deviceplugin.model import GIB
from deviceplugin.simulate.apiserver import FakeApiServer, Request
from deviceplugin.simulate.rbac import ADMIN_HEADERS, Policy, shipped_documents
from tests.conftest import API_NODE as NODE

OTHER = "net.example.com"  # another driver with a device in the same claims
CEILING = {"apiVersion": "gpu-fraction.dev/v1", "kind": "GpuShareConfig", "memoryLimit": "8Gi",
           "activeThreadPercentage": 50}  # fmt: skip
# The claim as kubectl sent it for daemonset/examples/dra/ceiling.yaml (YAML made JSON: keys
# sorted, no spaces), which the API server keeps as the opaque parameters' raw bytes; Python's
# json.dumps of the same dict is `{"apiVersion": "gpu-fraction.dev/v1", "kind": ...`.
CEILING_TEXT = (
    '{"activeThreadPercentage":50,"apiVersion":"gpu-fraction.dev/v1","kind":"GpuShareConfig",'
    '"memoryLimit":"8Gi"}'
)


def allocated_claim(name: str, *, config: bool = False, other: bool = False) -> dict[str, Any]:
    result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0",
              "consumedCapacity": {"memory": "1Gi"}, "shareID": "s-1"}  # fmt: skip
    results = [result]
    if other:
        results.append({"request": "nic", "driver": OTHER, "pool": NODE, "device": "eth1"})
    selector = {"key": "metadata.name", "operator": "In", "values": [NODE]}
    allocation: dict[str, Any] = {
        "devices": {"results": results},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [selector]}]},
    }
    if config:
        allocation["devices"]["config"] = [{"source": "FromClaim", "requests": ["gpu"],
            "opaque": {"driver": DRIVER, "parameters": CEILING}}]  # fmt: skip
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": "default", "name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "time-slicing.gpu-fraction.dev"}}]}},
        "status": {"allocation": allocation,
                   "reservedFor": [{"resource": "pods", "name": "p", "uid": "pod-uid"}]},
    }  # fmt: skip


def old_writer_rbac() -> Policy:
    """The RBAC the old read-modify-UPDATE writer shipped with: `update` on a claim's status
    and `associated-node:update` on our driver's entries, beside today's grants."""
    docs = shipped_documents()
    assert docs is not None
    for doc in docs:
        for rule in (doc or {}).get("rules") or []:
            if "resourceclaims/status" in rule["resources"]:
                rule["verbs"] = [*rule["verbs"], "update"]
            if "resourceclaims/driver" in rule["resources"]:
                rule["verbs"] = [*rule["verbs"], "associated-node:update"]
    return Policy.from_documents(docs)


def add_as_kubectl(fake: FakeApiServer, claim: dict[str, Any]) -> dict[str, Any]:
    """`claim` created from the text kubectl sends, the opaque parameters as CEILING_TEXT."""
    text = json.dumps(claim, sort_keys=True, separators=(",", ":"))
    compact = json.dumps(CEILING, sort_keys=True, separators=(",", ":"))
    assert compact in text
    return fake.dra.add_claim(claim, raw=text.replace(compact, CEILING_TEXT))


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


def applies(fake: FakeApiServer, name: str) -> list[Request]:
    return fake.requests_for("PATCH", f"/resourceclaims/{name}/status")


def stored(fake: FakeApiServer, name: str) -> dict[str, Any]:
    return fake.dra.claims[("default", name)]


def devices(fake: FakeApiServer, name: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["driver"], d["device"]): d for d in stored(fake, name)["status"].get("devices", [])}


def other_driver_applies(fake: FakeApiServer, name: str) -> int:
    """The other driver writes its entry as the upstream drivers do: its own forced apply."""
    entry = {"driver": OTHER, "pool": NODE, "device": "eth1", "data": {"ip": "10.0.0.7"}}
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "status": {"devices": [entry]}}  # fmt: skip
    request = urllib.request.Request(
        f"{fake.url}/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/{name}/status"
        f"?fieldManager={OTHER}&force=true",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/apply-patch+yaml", **ADMIN_HEADERS},
        method="PATCH",
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return int(answer.status)


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
    claim = fake.dra.add_claim(allocated_claim("c1"))
    writer = ClaimStatusWriter(api, DRIVER, NODE, tmp_path)
    writer.start()
    try:
        writer.submit(entry_for(claim), claim)
        wait_written(writer, 1)
    finally:
        writer.stop()
    assert claim_gets(fake, "c1") == 0
    (device,) = stored(fake, "c1")["status"]["devices"]
    assert device["data"]["requestMiB"] == 1024 and device["shareID"] == "s-1"
    # a forced apply of our entries alone, as our field manager, the UID a precondition
    (request,) = applies(fake, "c1")
    assert request.content_type == "application/apply-patch+yaml"
    assert request.query == {"fieldManager": DRIVER, "force": "true"}
    assert request.body["metadata"] == {"name": "c1", "namespace": "default",
                                        "uid": claim["metadata"]["uid"]}  # fmt: skip
    assert set(request.body) == {"apiVersion", "kind", "metadata", "status"}
    assert list(request.body["status"]) == ["devices"]
    assert not fake.requests_for("PUT", "/resourceclaims/")


def test_a_claim_with_opaque_config_gets_its_status_and_its_allocation_is_untouched(
    fake: FakeApiServer, api: Api, tmp_path: Path
) -> None:
    """Kubernetes 1.37.2 refused the old read-modify-UPDATE of ceiling.yaml's claim with 422
    "changing status.allocation or status.reservedFor requires resourceclaims/binding": the
    parameters went back as Python's JSON, not the bytes kubectl sent."""
    claim = add_as_kubectl(fake, allocated_claim("cfg", config=True))
    before = json.dumps(stored(fake, "cfg")["status"]["allocation"], sort_keys=True)
    writer = ClaimStatusWriter(api, DRIVER, NODE, tmp_path)
    assert writer.write(entry_for(claim), claim) == "written"
    assert devices(fake, "cfg")[(DRIVER, "gpu-0")]["data"]["limitMiB"] == 1024
    assert json.dumps(stored(fake, "cfg")["status"]["allocation"], sort_keys=True) == before
    assert fake.dra.raws[("default", "cfg")] == {0: CEILING_TEXT}


def test_the_stand_in_refuses_a_status_update_that_reencodes_opaque_parameters(
    fake: FakeApiServer,
) -> None:
    """What the real server answered the old writer: the allocation sent back is compared
    with the stored one, the opaque parameters as raw bytes; the same bytes pass."""
    fake.policy = old_writer_rbac()
    token = fake.agent_token()
    add_as_kubectl(fake, allocated_claim("cfg", config=True))
    entry = {"driver": DRIVER, "pool": NODE, "device": "gpu-0", "shareID": "s-1"}
    compact_ceiling = json.dumps(CEILING, sort_keys=True, separators=(",", ":"))

    def put(python_json: bool = False, drop_reserved: bool = False) -> tuple[int, str]:
        body = json.loads(json.dumps(stored(fake, "cfg")))  # the current resourceVersion
        body["status"]["devices"] = [entry]
        if drop_reserved:
            del body["status"]["reservedFor"]
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        text = json.dumps(body) if python_json else text.replace(compact_ceiling, CEILING_TEXT)
        request = urllib.request.Request(
            f"{fake.url}/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/cfg/status",
            data=text.encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
            method="PUT",
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return int(answer.status), ""
        except urllib.error.HTTPError as err:
            return int(err.code), json.loads(err.read())["message"]

    code, message = put(python_json=True)  # as the Python client sends it
    assert code == 422
    assert "is invalid: status.allocation: Forbidden: changing status.allocation or " in message
    assert 'requires resource="resourceclaims/binding", verb="update" permission' in message
    assert "devices" not in stored(fake, "cfg")["status"]
    assert put(drop_reserved=True)[0] == 422  # reservedFor is the scheduler's too
    assert put() == (200, "")  # byte-identical parameters are no change


def test_another_drivers_entry_survives_our_write_and_our_unprepare(
    fake: FakeApiServer, api: Api, tmp_path: Path
) -> None:
    claim = fake.dra.add_claim(allocated_claim("both", other=True))
    assert other_driver_applies(fake, "both") == 200
    writer = ClaimStatusWriter(api, DRIVER, NODE, tmp_path, delay=0.0)
    writer.start()
    try:
        writer.submit(entry_for(claim), claim)
        wait_written(writer, 1)
        assert set(devices(fake, "both")) == {(DRIVER, "gpu-0"), (OTHER, "eth1")}
        assert devices(fake, "both")[(OTHER, "eth1")]["data"] == {"ip": "10.0.0.7"}
        writer.forget(claim["metadata"]["uid"])
        deadline = time.monotonic() + 10
        while writer.removed < 1:
            assert time.monotonic() < deadline, writer.last_error
            time.sleep(0.02)
    finally:
        writer.stop()
    assert set(devices(fake, "both")) == {(OTHER, "eth1")}
    assert devices(fake, "both")[(OTHER, "eth1")]["data"] == {"ip": "10.0.0.7"}
    removal = applies(fake, "both")[-1]
    assert removal.body["status"] == {"devices": []}
    assert removal.query["fieldManager"] == DRIVER and writer.abandoned == 0


def test_an_entry_the_claim_was_created_with_survives_too(
    fake: FakeApiServer, api: Api, tmp_path: Path
) -> None:
    """An entry no field manager applied (written by an UPDATE) is nobody's to remove."""
    claim = allocated_claim("old", other=True)
    claim["status"]["devices"] = [{"driver": OTHER, "pool": NODE, "device": "eth1"}]
    added = fake.dra.add_claim(claim)
    writer = ClaimStatusWriter(api, DRIVER, NODE, tmp_path)
    assert writer.write(entry_for(added), added) == "written"
    assert writer.remove(entry_for(added)) == "removed"
    assert set(devices(fake, "old")) == {(OTHER, "eth1")}


def test_unprepare_of_a_claim_already_gone_is_quiet(
    fake: FakeApiServer, api: Api, tmp_path: Path
) -> None:
    told: list[str] = []
    claim = fake.dra.add_claim(allocated_claim("gone"))
    writer = ClaimStatusWriter(api, DRIVER, NODE, tmp_path, delay=0.0,
                               on_abandoned=lambda e, err: told.append(e.name))  # fmt: skip
    writer.start()
    try:
        writer.submit(entry_for(claim), claim)
        wait_written(writer, 1)
        fake.dra.delete_claim("default", "gone")  # with its pod, as a template's claim goes
        writer.forget(claim["metadata"]["uid"])
        deadline = time.monotonic() + 10
        while writer.pending():
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        writer.stop()
    assert len(applies(fake, "gone")) == 2  # the record, then the removal's 404
    assert writer.remove(entry_for(claim)) == "skipped (claim gone)"
    assert told == [] and writer.abandoned == 0 and writer.removed == 0


def test_a_claim_replaced_under_its_name_is_not_written(
    fake: FakeApiServer, api: Api, tmp_path: Path
) -> None:
    """The apply names the UID prepare saw: the API server refuses to change a claim's UID
    (immutable), so a claim re-created under the name between the read and the write is not
    given our record, and nothing is counted as refused."""
    first = fake.dra.add_claim(allocated_claim("re"))
    fake.dra.delete_claim("default", "re")
    fake.dra.add_claim(allocated_claim("re"))  # a new UID
    told: list[str] = []
    writer = ClaimStatusWriter(api, DRIVER, NODE, tmp_path,
                               on_abandoned=lambda e, err: told.append(e.name))  # fmt: skip
    assert writer.write(entry_for(first), first) == "skipped (claim replaced)"
    assert len(applies(fake, "re")) == 1 and "devices" not in stored(fake, "re")["status"]
    assert told == []


def test_without_a_copy_the_writer_reads_the_claim(
    fake: FakeApiServer,
    api: Api,
    tmp_path: Path,
) -> None:
    claim = fake.dra.add_claim(allocated_claim("c3"))
    writer = ClaimStatusWriter(api, DRIVER, NODE, tmp_path)
    writer.start()
    try:
        writer.submit(entry_for(claim))
        wait_written(writer, 1)
    finally:
        writer.stop()
    assert claim_gets(fake, "c3") == 1


def test_a_claim_that_already_holds_the_record_is_not_written_again(
    fake: FakeApiServer, api: Api, tmp_path: Path
) -> None:
    claim = fake.dra.add_claim(allocated_claim("c4"))
    writer = ClaimStatusWriter(api, DRIVER, NODE, tmp_path)
    assert writer.write(entry_for(claim), claim) == "written"
    again = ClaimStatusWriter(api, DRIVER, NODE, tmp_path)  # as after a restart: no copy
    assert again.write(entry_for(claim)) == "unchanged"
    assert len(applies(fake, "c4")) == 1


def test_a_record_an_older_agent_updated_is_applied_once_to_own_it(
    fake: FakeApiServer, api: Api, tmp_path: Path
) -> None:
    """An equal record that no apply of ours wrote (an older agent's UPDATE) is applied once,
    so that our unprepare's empty apply removes it."""
    claim = allocated_claim("c5")
    writer = ClaimStatusWriter(api, DRIVER, NODE, tmp_path)
    added = fake.dra.add_claim(claim)
    claim["status"]["devices"] = [
        device_status(d, DRIVER, tmp_path, 0.0) for d in entry_for(added).devices
    ]
    claim["metadata"] = dict(added["metadata"])
    added = fake.dra.add_claim(claim)  # the record there, by nobody's apply
    assert writer.write(entry_for(added)) == "written"
    assert writer.write(entry_for(added)) == "unchanged"
    assert writer.remove(entry_for(added)) == "removed"
    assert "devices" not in stored(fake, "c5")["status"]


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
    claim = fake.dra.add_claim(allocated_claim("c1"))
    device = {"driver": DRIVER, "pool": NODE, "device": "gpu-0", "shareID": "s-1"}

    def put(status: dict[str, Any]) -> int:
        body = {**claim, "status": {**claim["status"], **status}}
        body["metadata"] = dict(fake.dra.claims[("default", "c1")]["metadata"])
        request = urllib.request.Request(
            f"{fake.url}/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/c1/status",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **ADMIN_HEADERS},
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
    fake.fail_next[("PATCH", "namespaces")] = [403, 429]
    writer.start()
    try:
        writer.submit(entry_for(claims["p1"]), claims["p1"])  # 403: given up
        deadline = time.monotonic() + 10
        while not told:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        writer.submit(entry_for(claims["p2"]), claims["p2"])  # 429: retried, then written
        wait_written(writer, 1)
        fake.fail_next[("PATCH", "namespaces")] = [422]
        writer.submit(entry_for(claims["p3"]), claims["p3"])
        while len(told) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.3)  # several backoffs: nothing more is tried for p1 or p3
    finally:
        writer.stop()
    assert told == [("p1", 403), ("p3", 422)]
    assert writer.abandoned == 2 and writer.pending() == 0
    assert len(applies(fake, "p1")) == 1
    assert len(applies(fake, "p3")) == 1
    assert len(applies(fake, "p2")) == 2
    writer.submit(entry_for(claims["p1"]), claims["p1"])  # a re-prepare does not try again
    assert writer.pending() == 0
