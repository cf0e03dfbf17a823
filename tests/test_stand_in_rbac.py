"""The stand-in API server enforces the RBAC the project ships, as the real one's RBAC
authorizer does: the request's verb as NewRequestInfo resolves it, the rules as RuleAllows
matches them, a real 403 Status for a request no rule grants; and the registry's own checks
on a claim's status (`resourceclaims/binding`, and from 1.36 `resourceclaims/driver` with
the node-scoped verbs) ask the same policy."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from deviceplugin.simulate.apiserver import FakeApiServer
from deviceplugin.simulate.rbac import (
    ADMIN,
    ADMIN_HEADERS,
    AGENT,
    ANONYMOUS,
    Policy,
    User,
    agent,
    request_info,
)
from tests.conftest import API_NODE

Obj = dict[str, Any]
RESOURCE = "resource.k8s.io"
CLAIMS = f"/apis/{RESOURCE}/v1/namespaces/default/resourceclaims"


@pytest.mark.parametrize(
    ("method", "target", "verb", "group", "namespace", "resource", "sub", "name"),
    [
        ("GET", "/api/v1/namespaces/ns/pods/p", "get", "", "ns", "pods", "", "p"),
        ("GET", "/api/v1/pods?fieldSelector=spec.nodeName%3Dn1", "list", "", "", "pods", "", ""),
        ("GET", "/api/v1/pods?watch=true&resourceVersion=7", "watch", "", "", "pods", "", ""),
        ("GET", "/api/v1/pods?watch=1", "watch", "", "", "pods", "", ""),
        ("GET", "/api/v1/pods?watch=false", "list", "", "", "pods", "", ""),
        ("GET", "/api/v1/watch/namespaces/ns/pods", "watch", "", "ns", "pods", "", ""),
        # a list or watch pinned to one name by its field selector names it
        ("GET", f"/apis/{RESOURCE}/v1/resourceslices?fieldSelector=metadata.name%3Ds1",
         "list", RESOURCE, "", "resourceslices", "", "s1"),
        ("GET", f"/apis/{RESOURCE}/v1/deviceclasses?watch=true&fieldSelector=metadata.name%3D%3Dc",
         "watch", RESOURCE, "", "deviceclasses", "", "c"),
        ("POST", "/api/v1/namespaces/ns/events", "create", "", "ns", "events", "", ""),
        ("PUT", f"{CLAIMS}/c/status", "update", RESOURCE, "default", "resourceclaims",
         "status", "c"),
        # a server-side apply is a PATCH, so a patch
        ("PATCH", f"{CLAIMS}/c/status?fieldManager=m&force=true", "patch", RESOURCE, "default",
         "resourceclaims", "status", "c"),
        ("PATCH", "/api/v1/nodes/n1", "patch", "", "", "nodes", "", "n1"),
        ("DELETE", f"/apis/{RESOURCE}/v1/resourceslices/s", "delete", RESOURCE, "",
         "resourceslices", "", "s"),
        ("DELETE", f"/apis/{RESOURCE}/v1/resourceslices", "deletecollection", RESOURCE, "",
         "resourceslices", "", ""),
        # a namespace's own subresources are not namespaced resources
        ("GET", "/api/v1/namespaces/ns", "get", "", "ns", "namespaces", "", "ns"),
        ("PUT", "/api/v1/namespaces/ns/finalize", "update", "", "ns", "namespaces",
         "finalize", "ns"),
    ],
)  # fmt: skip
def test_request_verbs_as_the_request_info_resolver_names_them(
    method: str, target: str, verb: str, group: str, namespace: str, resource: str, sub: str,
    name: str,
) -> None:  # fmt: skip
    a = request_info(ADMIN, method, target)
    assert a.resource_request
    assert (a.verb, a.api_group, a.namespace, a.resource, a.subresource, a.name) == (
        verb, group, namespace, resource, sub, name,
    )  # fmt: skip


@pytest.mark.parametrize("target", ["/healthz", "/apis", f"/apis/{RESOURCE}", "/api/v1"])
def test_paths_outside_a_resource_are_non_resource_requests(target: str) -> None:
    a = request_info(ADMIN, "GET", target)
    assert not a.resource_request and a.verb == "get" and a.path == target


def rules_policy(rules: list[Obj], *, role: str = "ClusterRole", namespace: str = "") -> Policy:
    meta: Obj = {"name": "r", **({"namespace": namespace} if namespace else {})}
    binding_kind = "ClusterRoleBinding" if role == "ClusterRole" and not namespace else (
        "RoleBinding")  # fmt: skip
    subject = {"kind": "ServiceAccount", "name": "gpu-fraction-plugin",
               "namespace": "gpu-fraction-system"}  # fmt: skip
    docs = [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": role, "metadata": meta,
         "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": binding_kind,
         "metadata": {"name": "b", **({"namespace": namespace} if namespace else {})},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role, "name": "r"},
         "subjects": [subject]},
    ]  # fmt: skip
    return Policy.from_documents(docs)


def may(policy: Policy, method: str, target: str, user: User | None = None) -> bool:
    return policy.authorize(request_info(user or agent("n1"), method, target))[0]


def test_rules_match_as_rule_allows_matches_them() -> None:
    subresource = rules_policy([{"apiGroups": [RESOURCE], "resources": ["resourceclaims/status"],
                                 "verbs": ["patch"]}])  # fmt: skip
    assert may(subresource, "PATCH", f"{CLAIMS}/c/status")
    assert not may(subresource, "PATCH", f"{CLAIMS}/c")  # the object is not its subresource
    assert not may(subresource, "PUT", f"{CLAIMS}/c/status")  # update is not patch
    assert not may(subresource, "PATCH", "/api/v1/namespaces/default/pods/c/status")  # group
    any_status = rules_policy([{"apiGroups": ["*"], "resources": ["*/status"],
                                "verbs": ["*"]}])  # fmt: skip
    assert may(any_status, "PUT", f"{CLAIMS}/c/status")
    assert not may(any_status, "GET", f"{CLAIMS}/c")
    named = rules_policy([{"apiGroups": [""], "resources": ["nodes"], "resourceNames": ["n1"],
                           "verbs": ["get", "list"]}])  # fmt: skip
    assert may(named, "GET", "/api/v1/nodes/n1")
    assert not may(named, "GET", "/api/v1/nodes/n2")
    assert not may(named, "GET", "/api/v1/nodes")  # a list names nothing...
    assert may(named, "GET", "/api/v1/nodes?fieldSelector=metadata.name%3Dn1")  # ...unless pinned
    assert not may(named, "GET", "/api/v1/nodes/n1", user=User("someone-else"))
    assert may(named, "GET", "/api/v1/nodes/n2", user=ADMIN)  # system:masters


def test_a_role_grants_only_in_its_namespace() -> None:
    role = rules_policy([{"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}],
                        role="Role", namespace="gpu-fraction-system")  # fmt: skip
    assert may(role, "POST", "/api/v1/namespaces/gpu-fraction-system/events")
    assert not may(role, "POST", "/api/v1/namespaces/default/events")
    assert not may(role, "GET", "/api/v1/events")  # nor cluster-wide


def test_a_binding_to_a_missing_role_is_the_reason() -> None:
    policy = rules_policy([])
    policy.cluster_roles.clear()
    allowed, reason = policy.authorize(request_info(agent("n1"), "GET", "/api/v1/pods"))
    assert not allowed
    assert reason == 'RBAC: clusterrole.rbac.authorization.k8s.io "r" not found'


def call(fake: FakeApiServer, method: str, path: str, headers: dict[str, str],
         body: Obj | None = None) -> tuple[int, Obj]:  # fmt: skip
    request = urllib.request.Request(
        fake.url + path, method=method, headers={"Content-Type": "application/json", **headers},
        data=json.dumps(body).encode() if body is not None else None,
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status), json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return int(err.code), json.loads(err.read())


def test_the_agent_gets_the_real_403_for_what_its_rbac_lacks(fake: FakeApiServer) -> None:
    agent_headers = {"Authorization": f"Bearer {fake.agent_token()}"}
    # no node reads every claim in the cluster (issue 30 item 6): the list is refused...
    code, status = call(fake, "GET", f"/apis/{RESOURCE}/v1/resourceclaims", agent_headers)
    assert code == 403
    assert status["kind"] == "Status" and status["reason"] == "Forbidden"
    assert status["code"] == 403 and status["status"] == "Failure"
    assert status["message"] == (
        f'resourceclaims.{RESOURCE} is forbidden: User "{AGENT}" cannot list resource '
        f'"resourceclaims" in API group "{RESOURCE}" at the cluster scope'
    )
    # ...and a named object's message names it, in its namespace
    code, status = call(fake, "DELETE", f"{CLAIMS}/c1", agent_headers)
    assert code == 403
    assert status["message"] == (
        f'resourceclaims.{RESOURCE} "c1" is forbidden: User "{AGENT}" cannot delete resource '
        f'"resourceclaims" in API group "{RESOURCE}" in the namespace "default"'
    )
    assert status["details"] == {"name": "c1", "group": RESOURCE, "kind": "resourceclaims"}
    # what the shipped RBAC grants passes the same way
    assert call(fake, "GET", f"{CLAIMS}/c1", agent_headers)[0] == 404
    assert call(fake, "GET", f"/api/v1/nodes/{API_NODE}", agent_headers)[0] == 200
    # an admin sets up fixtures; no token is system:anonymous; a bad token is not a user
    assert call(fake, "GET", f"/apis/{RESOURCE}/v1/resourceclaims", ADMIN_HEADERS)[0] == 200
    code, status = call(fake, "GET", f"/api/v1/nodes/{API_NODE}", {})
    assert (
        code == 403
        and f'User "{ANONYMOUS.name}" cannot get resource "nodes"' in (status["message"])
    )
    assert call(fake, "GET", "/api/v1/pods", {"Authorization": "Bearer nope"})[0] == 401
    assert len(fake.denied) == 3
    fake.denied.clear()


def allocated(name: str, node: str) -> Obj:
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
    result = {"request": "gpu", "driver": "gpu-fraction.dev", "pool": node, "device": "gpu-0"}
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"namespace": "default", "name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "time-slicing.gpu-fraction.dev"}}]}},
        "status": {"allocation": {"devices": {"results": [result]},
                                  "nodeSelector": {"nodeSelectorTerms": [term]}}},
    }  # fmt: skip


def apply_status(fake: FakeApiServer, name: str, node: str, headers: dict[str, str]) -> Any:
    entry = {"driver": "gpu-fraction.dev", "pool": node, "device": "gpu-0"}
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"namespace": "default", "name": name},
            "status": {"devices": [entry]}}  # fmt: skip
    headers = {**headers, "Content-Type": "application/apply-patch+yaml"}
    return call(fake, "PATCH", f"{CLAIMS}/{name}/status?fieldManager=gpu-fraction.dev&force=true",
                headers, body)  # fmt: skip


def test_status_entries_only_on_claims_allocated_to_the_agents_own_node(
    fake: FakeApiServer,
) -> None:
    """1.36's AuthorizedForDeviceStatus: `associated-node:patch` lets the agent write our
    driver's entries only where its pod-bound token's node is the claim's node; elsewhere it
    needs `arbitrary-node:patch`, which it does not have: a 422 naming both verbs."""
    fake.add_node("node-2")
    ours = {"Authorization": f"Bearer {fake.agent_token(API_NODE)}"}
    fake.dra.add_claim(allocated("here", API_NODE))
    fake.dra.add_claim(allocated("there", "node-2"))
    assert apply_status(fake, "here", API_NODE, ours)[0] == 200
    code, status = apply_status(fake, "there", "node-2", ours)
    assert code == 422 and status["reason"] == "Invalid"
    assert status["message"] == (
        f'ResourceClaim.{RESOURCE} "there" is invalid: status.devices: Forbidden: changing '
        'status.devices requires resource="resourceclaims/driver", '
        'verb="[arbitrary-node:patch]" permission: '
        f'resourceclaims.{RESOURCE} "gpu-fraction.dev/driver" is forbidden: User "{AGENT}" '
        f'cannot arbitrary-node:patch resource "resourceclaims/driver" in API group '
        f'"{RESOURCE}" in the namespace "default"'
    )
    assert "devices" not in fake.dra.claims[("default", "there")]["status"]
    # the node-2 agent may; an admin may anywhere
    theirs = {"Authorization": f"Bearer {fake.agent_token('node-2')}"}
    assert apply_status(fake, "there", "node-2", theirs)[0] == 200
    fake.dra.add_claim(allocated("admin", "node-2"))
    assert apply_status(fake, "admin", "node-2", ADMIN_HEADERS)[0] == 200


def test_the_default_policy_is_the_shipped_one(fake: FakeApiServer) -> None:
    """Were the manifests not found (an installed package's demo), nothing would be refused:
    the tests run from the repository, so they always meet the shipped RBAC."""
    assert fake.policy is not None and fake.policy == Policy.shipped()
    assert fake.policy.cluster_roles and fake.policy.cluster_bindings
    request = request_info(agent(API_NODE), "PATCH", f"{CLAIMS}/c/status")
    assert fake.policy.authorize(request)[0]
    assert not fake.policy.without("resourceclaims/status").authorize(request)[0]
    assert fake.policy.without("pods").authorize(request)[0]
