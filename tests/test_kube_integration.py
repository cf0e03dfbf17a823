"""KubeIntegration end to end: the real `kubernetes` client against the in-test API server,
the real pod-resources gRPC fake on a unix socket, the real ledger and allocator.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from deviceplugin.config.settings import Config
from deviceplugin.dpapi import ceilings as ceil
from deviceplugin.dpapi.allocator import Allocator
from deviceplugin.dpapi.kube_integration import KubeIntegration, Settings, kube_from_environment
from deviceplugin.dpapi.kube_records import ALLOCATIONS_KEY, PLAN_KEY
from deviceplugin.dpapi.podresources import PodResourcesClient, PodResourcesPoller
from deviceplugin.health.board import HealthBoard
from deviceplugin.kube.client import Backoff
from deviceplugin.ledger.record import AllocationRecord
from deviceplugin.ledger.store import Ledger
from deviceplugin.model import GIB, Delivery, Enforcement, FaultDomain, GpuUuid, Mode, ResourceName
from deviceplugin.plan import SlicePlan
from deviceplugin.simulate.apiserver import FakeApiServer, pod
from tests.fakes.podresources import Assigned, FakePodResources
from tests.planfixtures import gpu_plan, small_plan

NODE = "node-1"
TS = ResourceName("nvidia.com/gpu-fraction")
SM = ResourceName("nvidia.com/gpu-fraction.sm-sharing")
FAST = Settings(node_min_interval=0.2, backoff=Backoff(first=0.05, cap=0.2, attempts=4))


def eventually(check: Callable[[], bool], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return check()


def limit(container: str, value: str) -> dict[str, str]:
    return {f"nvidia.com/container.{container}.gpu-memory.limit": value}


@dataclass
class Env:
    api: FakeApiServer
    kubelet: FakePodResources
    ledger: Ledger
    poller: PodResourcesPoller
    kube: KubeIntegration
    tmp: Path

    def allocator(self, plan: SlicePlan, config: Config, mps: ProvenMps | None = None) -> Allocator:
        return Allocator(
            plan_source=lambda: plan,
            config_source=lambda: config,
            cdi_dir=self.tmp / "cdi",
            mps_root=self.tmp / "mps",
            ledger=self.ledger,
            board=HealthBoard(),
            mps=mps,
            ceilings=self.kube,
        )


class ProvenMps:
    """Daemons up, with memory accounting read back `on` (reclaim needs that proof)."""

    def ensure(self, gpu: GpuUuid) -> bool:
        return True

    def wait_ready(self, gpu: GpuUuid, timeout: float) -> bool:
        return True

    def memory_accounting(self, gpu: GpuUuid) -> bool:
        return True


@pytest.fixture
def env(short_tmp: Path) -> Iterator[Env]:
    api = FakeApiServer().start()
    api.add_node(NODE, labels={"kubernetes.io/hostname": NODE})
    kubelet = FakePodResources(short_tmp / "pr.sock").start()
    (short_tmp / "cdi").mkdir()
    ledger = Ledger(short_tmp / "state")
    poller = PodResourcesPoller(
        PodResourcesClient(str(kubelet.socket_path)), ledger, {TS, SM}, fast=0.05, slow=0.2
    )
    kube = kube_from_environment(
        NODE,
        None,
        ledger,
        environ={"KUBECONFIG": str(api.write_kubeconfig(short_tmp / "kubeconfig"))},
        service_account_dir=str(short_tmp / "no-sa"),
        poller=poller,
        settings=FAST,
    )
    assert kube is not None
    kube.start()
    poller.start()
    assert eventually(lambda: kube.pods.synced)
    try:
        yield Env(api, kubelet, ledger, poller, kube, short_tmp)
    finally:
        kube.stop()
        poller.stop()
        kubelet.stop()
        api.stop()


def add_pods(env: Env, *pods: dict[str, object]) -> None:
    for p in pods:
        env.api.add_pod(p)  # type: ignore[arg-type]
    names = {p["metadata"]["name"] for p in pods}  # type: ignore[index]
    assert eventually(lambda: names <= {p.name for p in env.kube.pods.pods()})


# --- ceilings ------------------------------------------------------------------------------


def test_ceiling_from_the_cache_without_network(env: Env) -> None:
    add_pods(env, pod("a", {"app": {TS: 2}}, annotations=limit("app", "5Gi")))
    before = len(env.api.requests)
    got = env.kube.ceiling_for(TS, 2, GpuUuid("GPU-x"))
    assert (got.limit, got.source) == (5 * GIB, ceil.ANNOTATION)
    add_pods(env, pod("b", {"app": {TS: 2}}, annotations=limit("app", "3Gi")))
    got = env.kube.ceiling_for(TS, 2, GpuUuid("GPU-x"))
    assert (got.limit, got.source) == (3 * GIB, ceil.AMBIGUOUS)
    assert env.kube.ceiling_for(TS, 4, GpuUuid("GPU-x")).source == ceil.NO_CANDIDATES
    # Only the watch's own events reached the server; ceiling_for made no request.
    assert all(r.method == "GET" and r.path == "/api/v1/pods" for r in env.api.requests[before:])


def test_container_shown_by_pod_resources_is_no_longer_a_candidate(env: Env) -> None:
    add_pods(
        env,
        pod("old", {"app": {TS: 2}}, annotations=limit("app", "3Gi")),
        pod("new", {"app": {TS: 2}}, annotations=limit("app", "6Gi")),
    )
    assert env.kube.ceiling_for(TS, 2, GpuUuid("g")).source == ceil.AMBIGUOUS
    env.kubelet.set(Assigned("ns", "old", "app", TS, ("GPU-x::0", "GPU-x::1")))
    env.poller.wake()
    assert eventually(lambda: env.kube.ceiling_for(TS, 2, GpuUuid("g")).limit == 6 * GIB)


def test_invalid_ceiling_gives_the_request_and_one_event(env: Env) -> None:
    add_pods(env, pod("bad", {"app": {TS: 1}}, annotations=limit("app", "plenty")))
    for _ in range(3):
        got = env.kube.ceiling_for(TS, 1, GpuUuid("g"))
        assert (got.limit, got.source) == (None, ceil.INVALID)
    assert eventually(lambda: len(env.api.events) >= 1)
    time.sleep(0.3)
    assert len(env.api.events) == 1
    event = env.api.events[0]
    assert event["involvedObject"]["kind"] == "Pod"
    assert event["involvedObject"]["name"] == "bad"
    assert event["metadata"]["namespace"] == "ns"
    assert event["reason"] == "InvalidGpuMemoryLimit"
    assert "plenty" in event["message"]


@pytest.mark.parametrize(
    ("mode", "reclaimable", "policy", "expected_limit_gib", "expected_policy"),
    [
        (Mode.TIME_SLICING, False, "reclaimable-only", 2, "ignored: no-reclaim"),
        (Mode.TIME_SLICING, False, "allow-overcommit", 5, "overcommit"),
        (Mode.SM_SHARING, True, "reclaimable-only", 5, "applied"),
        (Mode.SM_SHARING, False, "reclaimable-only", 2, "ignored: no-reclaim"),
        (Mode.SM_SHARING, False, "allow-overcommit", 5, "overcommit"),
    ],
)
def test_ceiling_policies_through_the_allocator(
    env: Env,
    mode: Mode,
    reclaimable: bool,
    policy: str,
    expected_limit_gib: int,
    expected_policy: str,
) -> None:
    resource = TS if mode is Mode.TIME_SLICING else SM
    gp = replace(gpu_plan(0, mode), reclaimable=reclaimable)
    plan = SlicePlan(gpus=(gp,), resources=(resource,))
    config = Config(ceilings=policy, device_list_strategy=("envvar",))
    add_pods(env, pod("p", {"app": {resource: 2}}, annotations=limit("app", "5Gi")))
    grant = env.allocator(plan, config, ProvenMps()).allocate(resource, list(gp.device_ids[:2]))
    assert grant.record.request_mib == 2048
    assert grant.record.limit_mib == expected_limit_gib * 1024
    assert grant.record.ceiling_policy == expected_policy
    assert grant.envs["NVIDIA_GPU_MEMORY_LIMIT"] == str(expected_limit_gib * 1024)
    if mode is Mode.SM_SHARING:
        assert grant.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={expected_limit_gib * 1024}M"


def test_api_server_down_during_allocate(env: Env) -> None:
    gp = gpu_plan(0, Mode.TIME_SLICING)
    plan = SlicePlan(gpus=(gp,), resources=(TS,))
    config = Config(ceilings="allow-overcommit", device_list_strategy=("envvar",))
    add_pods(env, pod("p", {"app": {TS: 1}}, annotations=limit("app", "4Gi")))
    env.api.stop()
    assert eventually(lambda: not env.kube.pods.synced)
    started = time.monotonic()
    grant = env.allocator(plan, config).allocate(TS, [gp.device_ids[0]])
    assert time.monotonic() - started < 5.0  # liveness only: it did not wait on the network
    assert grant.record.limit_mib == grant.record.request_mib == 1024
    assert grant.record.ceiling_source == ceil.NO_CACHE


# --- pod cache -----------------------------------------------------------------------------


def test_watch_disconnect_resumes_from_the_last_resource_version(env: Env) -> None:
    add_pods(env, pod("a", {"app": {TS: 1}}))
    relists = env.kube.pods.relists
    watches = len(env.api.requests_for("GET", "/api/v1/pods"))
    env.api.disconnect_watches()
    env.api.add_pod(pod("b", {"app": {TS: 1}}))  # type: ignore[arg-type]
    env.api.delete_pod("ns", "a")
    assert eventually(lambda: {p.name for p in env.kube.pods.pods()} == {"b"})
    rewatch = env.api.requests_for("GET", "/api/v1/pods")[watches:]
    assert rewatch and all(r.query.get("watch") == "true" for r in rewatch)
    assert all(int(r.query["resourceVersion"]) > 100 for r in rewatch)
    assert env.kube.pods.relists == relists  # resumed, not relisted


def test_watch_410_gone_relists(env: Env) -> None:
    add_pods(env, pod("a", {"app": {TS: 1}}))
    relists = env.kube.pods.relists
    env.api.disconnect_watches()
    # While the watch is down, history moves on and old versions expire.
    env.api.add_pod(pod("b", {"app": {TS: 1}}))  # type: ignore[arg-type]
    env.api.expire_watches()
    assert eventually(lambda: env.kube.pods.relists > relists)
    assert eventually(lambda: {p.name for p in env.kube.pods.pods()} == {"a", "b"})
    env.api.add_pod(pod("c", {"app": {TS: 1}}))  # type: ignore[arg-type]
    assert eventually(lambda: "c" in {p.name for p in env.kube.pods.pods()})


def test_pods_of_other_nodes_are_not_cached(env: Env) -> None:
    add_pods(env, pod("mine", {"app": {TS: 1}}))
    env.api.add_pod(pod("theirs", {"app": {TS: 1}}, node="node-2"))  # type: ignore[arg-type]
    env.api.add_pod(pod("mine2", {"app": {TS: 1}}))  # type: ignore[arg-type]
    assert eventually(lambda: "mine2" in {p.name for p in env.kube.pods.pods()})
    assert "theirs" not in {p.name for p in env.kube.pods.pods()}
    lists = env.api.requests_for("GET", "/api/v1/pods")
    assert lists and all(r.query["fieldSelector"] == f"spec.nodeName={NODE}" for r in lists)


# --- allocation records --------------------------------------------------------------------


def ledger_record(device_ids: tuple[str, ...], resource: str = TS) -> AllocationRecord:
    return AllocationRecord(
        device_ids=tuple(sorted(device_ids)),  # type: ignore[arg-type]
        resource=resource,
        gpus=(GpuUuid("GPU-x"),),
        mode=Mode.TIME_SLICING,
        request_mib=1024 * len(device_ids),
        limit_mib=3072,
        enforcement=(Enforcement.CUDA_MEMORY_LIMITS,),
        delivery=Delivery.CDI,
        ceiling_source=ceil.ANNOTATION,
        ceiling_policy="overcommit",
        cdi_spec=None,
        created=time.time(),
    )


def allocations(env: Env, name: str) -> dict[str, object] | None:
    raw = env.api.pods[("ns", name)]["metadata"].get("annotations", {}).get(ALLOCATIONS_KEY)
    return None if raw is None else json.loads(raw)  # type: ignore[no-any-return]


def test_allocation_record_written_once_pod_resources_shows_the_container(env: Env) -> None:
    add_pods(env, pod("web", {"app": {TS: 2}}, annotations={"team": "x"}))
    env.ledger.add(ledger_record(("GPU-x::0", "GPU-x::1")))
    time.sleep(0.3)
    assert env.api.requests_for("PATCH", "/pods/") == []  # nobody known to hold it yet
    env.kubelet.set(Assigned("ns", "web", "app", TS, ("GPU-x::1", "GPU-x::0")))
    assert eventually(lambda: allocations(env, "web") is not None)
    assert allocations(env, "web") == {
        "app": {
            "gpu": "GPU-x",
            "mode": "time-slicing",
            "requestMiB": 2048,
            "limitMiB": 3072,
            "enforcement": ["cuda-memory-limits"],
            "delivery": "cdi-edit",
            "ceilingSource": "annotation",
            "ceilingPolicy": "overcommit",
        }
    }
    assert env.api.pods[("ns", "web")]["metadata"]["annotations"]["team"] == "x"
    patch = env.api.requests_for("PATCH", "/pods/web")[0]
    assert patch.content_type == "application/merge-patch+json"
    assert set(patch.body["metadata"]["annotations"]) == {ALLOCATIONS_KEY}


def test_conflict_on_patch_is_retried(env: Env) -> None:
    add_pods(env, pod("web", {"app": {TS: 1}}))
    env.api.fail_next[("PATCH", "pods")] = [409, 409]
    env.ledger.add(ledger_record(("GPU-x::3",)))
    env.kubelet.set(Assigned("ns", "web", "app", TS, ("GPU-x::3",)))
    assert eventually(lambda: allocations(env, "web") is not None)
    assert len(env.api.requests_for("PATCH", "/pods/web")) == 3


def test_missing_record_is_repaired(env: Env) -> None:
    env.kube._settings = replace(FAST, repair_after=0.2)
    add_pods(env, pod("web", {"app": {TS: 1}}))
    env.ledger.add(ledger_record(("GPU-x::2",)))
    env.kubelet.set(Assigned("ns", "web", "app", TS, ("GPU-x::2",)))
    assert eventually(lambda: allocations(env, "web") is not None)
    env.api.update_pod("ns", "web", {"metadata": {"annotations": {ALLOCATIONS_KEY: None}}})
    assert eventually(lambda: allocations(env, "web") is not None)
    assert len(env.api.requests_for("PATCH", "/pods/web")) >= 2


# --- node ----------------------------------------------------------------------------------


def node_meta(env: Env) -> dict[str, dict[str, str]]:
    return env.api.nodes[NODE]["metadata"]  # type: ignore[no-any-return]


def test_node_labels_and_plan_annotation(env: Env) -> None:
    board = HealthBoard()
    plan = small_plan(Mode.TIME_SLICING, Mode.SM_SHARING, Mode.EXCLUSIVE)
    env.ledger.add(replace(ledger_record((str(plan.gpus[0].device_ids[0]),)), created=time.time()))
    env.kube.publish_plan(plan, board, env.ledger)
    assert eventually(lambda: PLAN_KEY in node_meta(env).get("annotations", {}))
    labels = node_meta(env)["labels"]
    assert labels == {
        "kubernetes.io/hostname": NODE,
        "gpu-fraction.dev/mode.time-slicing": "true",
        "gpu-fraction.dev/mode.sm-sharing": "true",
        "gpu-fraction.dev/mode.exclusive": "true",
        "gpu-fraction.dev/slice-size": "1Gi",
    }
    gpus = json.loads(node_meta(env)["annotations"][PLAN_KEY])
    assert [g["mode"] for g in gpus] == ["time-slicing", "sm-sharing", "exclusive"]
    assert (gpus[0]["slices"], gpus[0]["freeSlices"], gpus[0]["largestFreeBlock"]) == (4, 3, "3Gi")
    assert gpus[0]["health"] == "Healthy" and gpus[0]["product"] == "NVIDIA H200"

    # Only time-slicing left, one GPU faulted: the other mode labels go, health shows.
    board.set(plan.gpus[0].uuid, FaultDomain.GPU, "xid=79")
    env.kube.publish_plan(small_plan(Mode.TIME_SLICING), board, env.ledger)
    assert eventually(lambda: "gpu-fraction.dev/mode.exclusive" not in node_meta(env)["labels"])
    assert node_meta(env)["labels"] == {
        "kubernetes.io/hostname": NODE,
        "gpu-fraction.dev/mode.time-slicing": "true",
        "gpu-fraction.dev/slice-size": "1Gi",
    }
    gpus = json.loads(node_meta(env)["annotations"][PLAN_KEY])
    assert gpus[0]["health"] == "Unhealthy" and gpus[0]["largestFreeBlock"] == "0"
    for patch in env.api.requests_for("PATCH", "/nodes/"):
        assert patch.content_type == "application/merge-patch+json"
        owned = set(patch.body["metadata"]["labels"]) | set(patch.body["metadata"]["annotations"])
        assert all(k.startswith("gpu-fraction.dev/") for k in owned)


def test_node_updates_are_rate_limited_and_end_at_the_latest(env: Env) -> None:
    board = HealthBoard()
    env.kube._settings = replace(FAST, node_min_interval=1.0)
    plans = [small_plan(Mode.TIME_SLICING), small_plan(Mode.SM_SHARING)] * 5
    for plan in plans:
        env.kube.publish_plan(plan, board, env.ledger)
        time.sleep(0.02)
    assert eventually(
        lambda: node_meta(env)["labels"].get("gpu-fraction.dev/mode.sm-sharing") == "true"
    )
    time.sleep(0.5)
    assert len(env.api.requests_for("PATCH", "/nodes/")) <= 3
    assert "gpu-fraction.dev/mode.time-slicing" not in node_meta(env)["labels"]


# --- events --------------------------------------------------------------------------------


def test_health_transition_events_on_the_node(env: Env) -> None:
    gpu = GpuUuid("GPU-x")
    env.kube.on_health_transition(gpu, FaultDomain.GPU, "xid=79 class=reboot", healthy=False)
    env.kube.on_health_transition(gpu, FaultDomain.GPU, "recovery action none", healthy=True)
    assert eventually(lambda: len(env.api.events) == 2)
    down, up = env.api.events
    assert down["metadata"]["namespace"] == "default"
    assert down["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Node",
        "name": NODE,
        "uid": f"uid-node-{NODE}",
    }
    assert (down["type"], down["reason"]) == ("Warning", "GpuUnhealthy")
    assert "xid=79" in down["message"] and gpu in down["message"]
    assert (up["type"], up["reason"]) == ("Normal", "GpuHealthy")
    assert env.api.requests_for("POST", "/namespaces/default/events")


def test_refused_allocation_event_names_the_largest_fit(env: Env) -> None:
    add_pods(env, pod("big", {"app": {TS: 6}}), pod("other", {"app": {TS: 2}}))
    env.kube.on_refused(TS, 6, "no GPU has 6 free slices", largest_fit=3)
    assert eventually(lambda: len(env.api.events) == 1)
    event = env.api.events[0]
    assert event["involvedObject"]["name"] == "big"
    assert (event["type"], event["reason"]) == ("Warning", "GpuAllocationRefused")
    assert "3 x nvidia.com/gpu-fraction" in event["message"]


def test_stop_is_idempotent_and_quiet(env: Env) -> None:
    env.kube.stop()
    env.kube.stop()
    count = len(env.api.requests)
    env.kube.on_health_transition(GpuUuid("g"), FaultDomain.GPU, "x", healthy=False)
    time.sleep(0.2)
    assert len(env.api.requests) == count


# --- off without credentials ---------------------------------------------------------------


def test_off_without_credentials_makes_no_call_and_imports_nothing(short_tmp: Path) -> None:
    code = (
        "import sys\n"
        "from deviceplugin.dpapi.kube_integration import kube_from_environment\n"
        "from deviceplugin.ledger.store import Ledger\n"
        "from pathlib import Path\n"
        f"ledger = Ledger(Path({str(short_tmp / 'state')!r}))\n"
        "kube = kube_from_environment('node-1', '/nonexistent.sock', ledger, environ={},\n"
        f"    service_account_dir={str(short_tmp / 'none')!r})\n"
        "assert kube is None\n"
        "assert 'kubernetes' not in sys.modules, 'kubernetes imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr


def test_in_cluster_service_account_is_preferred(short_tmp: Path) -> None:
    from deviceplugin.kube.client import load_api

    sa = short_tmp / "sa"
    sa.mkdir()
    (sa / "token").write_text("sa-token")
    (sa / "ca.crt").write_text("not-checked-until-a-call")
    kubeconfig = short_tmp / "kc"
    kubeconfig.write_text("{}")
    environ = {
        "KUBERNETES_SERVICE_HOST": "10.0.0.1",
        "KUBERNETES_SERVICE_PORT": "443",
        "KUBECONFIG": str(kubeconfig),
    }
    api = load_api(environ, str(sa))
    assert api is not None
    configuration = api._core.api_client.configuration
    assert configuration.host == "https://10.0.0.1:443"
    assert "sa-token" in str(configuration.api_key.get("BearerToken", configuration.api_key))
    assert load_api({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, str(short_tmp / "none")) is None
