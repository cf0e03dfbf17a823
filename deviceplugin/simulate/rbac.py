"""The stand-in API server's authorization: the RBAC the project ships, evaluated as the real
API server's RBAC authorizer evaluates it, for the identity a request's bearer token names.

The policy is read from the kustomize tree (`daemonset/base/rbac.yaml` and
`daemonset/components/dra/rbac.yaml`; tests/test_chart.py checks the chart against it) when
the server starts, so the stand-in enforces whatever the manifests grant today. Tests pass a
changed copy (`Policy.from_documents`) to show what a missing rule costs.

Three identities: the agent (its ServiceAccount, with the pod-bound token's node, as the
kubelet issues it), an admin in `system:masters` (tests and the demo setting up fixtures),
and `system:anonymous` for a request without a token.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

Obj = dict[str, Any]

NAMESPACE = "gpu-fraction-system"
SERVICE_ACCOUNT = "gpu-fraction-plugin"
AGENT = f"system:serviceaccount:{NAMESPACE}:{SERVICE_ACCOUNT}"
# k8s.io/apiserver/pkg/authentication/serviceaccount, NodeNameKey: the extra a pod-bound token
# carries (ServiceAccountTokenPodNodeInfo), naming the node of the pod it was issued for.
NODE_NAME_KEY = "authentication.kubernetes.io/node-name"
ADMIN_TOKEN = "stand-in-admin"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
# The shipped RBAC, relative to the repository root; the kustomize tree is the source.
SHIPPED = ("daemonset/base/rbac.yaml", "daemonset/components/dra/rbac.yaml")
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class User:
    name: str
    groups: tuple[str, ...] = ()
    node: str | None = None  # the NODE_NAME_KEY extra, for a pod-bound token


def agent(node: str | None) -> User:
    """The agent's ServiceAccount, as k8s pkg/serviceaccount/util.go UserInfo names it."""
    groups = ("system:serviceaccounts", f"system:serviceaccounts:{NAMESPACE}",
              "system:authenticated")  # fmt: skip
    return User(AGENT, groups, node)


ADMIN = User("stand-in:admin", ("system:masters", "system:authenticated"))
ANONYMOUS = User("system:anonymous", ("system:unauthenticated",))


@dataclass(frozen=True)
class Attributes:
    """k8s.io/apiserver/pkg/authorization/authorizer.AttributesRecord, the fields RBAC reads."""

    user: User
    verb: str
    path: str = ""
    resource_request: bool = False
    api_group: str = ""
    api_version: str = ""
    namespace: str = ""
    resource: str = ""
    subresource: str = ""
    name: str = ""


def _true(value: str) -> bool:
    """apimachinery/pkg/runtime/conversion.go Convert_Slice_string_To_bool: any value but
    `0` and `false` is true."""
    return value.lower() not in ("false", "0")


def request_info(user: User, method: str, target: str) -> Attributes:
    """k8s.io/apiserver/pkg/endpoints/request/requestinfo.go, NewRequestInfo: a path under
    /api/v1 or /apis/<group>/<version> is a resource request; POST is create, GET and HEAD
    get, PUT update, PATCH patch (a server-side apply too), DELETE delete; a GET without a
    name is list, or watch with `?watch=` true; a list or watch whose field selector pins
    `metadata.name` names that object; a DELETE without a name is deletecollection."""
    url = urlsplit(target)
    query = parse_qs(url.query)
    parts = [p for p in url.path.strip("/").split("/") if p]
    plain = Attributes(user, method.lower(), path=url.path)
    if len(parts) < 3 or parts[0] not in ("api", "apis"):
        return plain
    group = ""
    if parts[0] == "apis":
        if len(parts) < 4:
            return plain
        group, parts = parts[1], parts[1:]
    version, rest = parts[1], parts[2:]
    verb = {"POST": "create", "GET": "get", "HEAD": "get", "PUT": "update", "PATCH": "patch",
            "DELETE": "delete"}.get(method, "")  # fmt: skip
    if rest[0] in ("watch", "proxy") and len(rest) > 1:  # the deprecated /watch/ prefix
        verb, rest = rest[0], rest[1:]
    namespace = ""
    if rest[0] == "namespaces" and len(rest) > 1:
        namespace = rest[1]
        if len(rest) > 2 and rest[2] not in ("status", "finalize"):
            rest = rest[2:]
    resource = rest[0]
    name = rest[1] if len(rest) > 1 else ""
    subresource = rest[2] if len(rest) > 2 and verb != "proxy" else ""
    if not name and verb == "get":
        watch = query.get("watch")
        verb = "watch" if watch and _true(watch[0]) else "list"
        for term in (query.get("fieldSelector") or [""])[0].split(","):
            key, _, value = term.partition("=")
            value = value.removeprefix("=")  # `==` is `=` in a field selector
            # apimachinery/pkg/api/validation/path, IsValidPathSegmentName
            valid = value not in ("", ".", "..") and not {"/", "%"} & set(value)
            if key == "metadata.name" and valid:
                name = value
    if not name and verb == "delete":
        verb = "deletecollection"
    return Attributes(user, verb, url.path, True, group, version, namespace, resource,
                      subresource, name)  # fmt: skip


@dataclass(frozen=True)
class Rule:
    verbs: tuple[str, ...]
    api_groups: tuple[str, ...] = ()
    resources: tuple[str, ...] = ()
    resource_names: tuple[str, ...] = ()
    non_resource_urls: tuple[str, ...] = ()

    @classmethod
    def of(cls, obj: Obj) -> Rule:
        def get(key: str) -> tuple[str, ...]:
            return tuple(obj.get(key) or ())

        return cls(get("verbs"), get("apiGroups"), get("resources"), get("resourceNames"),
                   get("nonResourceURLs"))  # fmt: skip

    def allows(self, a: Attributes) -> bool:
        """plugin/pkg/auth/authorizer/rbac/rbac.go, RuleAllows, with the matchers of
        pkg/apis/rbac/v1/evaluation_helpers.go: VerbMatches, APIGroupMatches,
        ResourceMatches (`resource/subresource`, `*`, `*/subresource`), ResourceNameMatches
        (an empty list is every name) and NonResourceURLMatches (a trailing `*` a prefix)."""
        if not ("*" in self.verbs or a.verb in self.verbs):
            return False
        if not a.resource_request:
            return any(
                u == "*" or u == a.path or (u.endswith("*") and a.path.startswith(u.rstrip("*")))
                for u in self.non_resource_urls
            )
        if not ("*" in self.api_groups or a.api_group in self.api_groups):
            return False
        combined = f"{a.resource}/{a.subresource}" if a.subresource else a.resource
        resource_ok = any(
            r in ("*", combined) or (bool(a.subresource) and r == f"*/{a.subresource}")
            for r in self.resources
        )
        return resource_ok and (not self.resource_names or a.name in self.resource_names)


def _applies(subject: Obj, user: User, binding_namespace: str) -> bool:
    """pkg/registry/rbac/validation/rule.go, appliesToUser."""
    kind, name = subject.get("kind"), subject.get("name", "")
    if kind == "User":
        return bool(user.name == name)
    if kind == "Group":
        return name in user.groups
    if kind == "ServiceAccount":
        namespace = subject.get("namespace") or binding_namespace
        return user.name == f"system:serviceaccount:{namespace}:{name}"
    return False


@dataclass
class Policy:
    """ClusterRoles, Roles and their bindings, as the RBAC authorizer's listers hold them."""

    cluster_roles: dict[str, list[Rule]] = field(default_factory=dict)
    roles: dict[tuple[str, str], list[Rule]] = field(default_factory=dict)
    cluster_bindings: list[Obj] = field(default_factory=list)
    bindings: list[Obj] = field(default_factory=list)

    @classmethod
    def from_documents(cls, docs: Iterable[Obj | None]) -> Policy:
        policy = cls()
        for doc in docs:
            if not doc or doc.get("apiVersion") != "rbac.authorization.k8s.io/v1":
                continue
            meta = doc.get("metadata") or {}
            rules = [Rule.of(r) for r in doc.get("rules") or []]
            kind = doc.get("kind")
            if kind == "ClusterRole":
                policy.cluster_roles[meta["name"]] = rules
            elif kind == "Role":
                policy.roles[(meta.get("namespace", "default"), meta["name"])] = rules
            elif kind == "ClusterRoleBinding":
                policy.cluster_bindings.append(doc)
            elif kind == "RoleBinding":
                policy.bindings.append(doc)
        return policy

    @classmethod
    def shipped(cls, root: Path = REPO_ROOT) -> Policy | None:
        """The project's RBAC from the kustomize tree; None for an installed package, which
        has no manifests beside it (its `demo` then authorizes every request)."""
        docs = shipped_documents(root)
        return cls.from_documents(docs) if docs is not None else None

    def without(self, resource: str) -> Policy:
        """This policy less every rule naming `resource`: what a cluster installed from an
        older or trimmed manifest grants (tests show what the missing rule costs)."""

        def kept(rules: list[Rule]) -> list[Rule]:
            return [r for r in rules if resource not in r.resources]

        return replace(
            self,
            cluster_roles={n: kept(rules) for n, rules in self.cluster_roles.items()},
            roles={k: kept(rules) for k, rules in self.roles.items()},
        )

    def _role_rules(self, ref: Obj, namespace: str) -> tuple[list[Rule], str | None]:
        name = ref.get("name", "")
        if ref.get("kind") == "ClusterRole":
            found = self.cluster_roles.get(name)
            missing = f'clusterrole.rbac.authorization.k8s.io "{name}" not found'
        else:
            found = self.roles.get((namespace, name))
            missing = f'role.rbac.authorization.k8s.io "{name}" not found'
        return (found, None) if found is not None else ([], missing)

    def authorize(self, a: Attributes) -> tuple[bool, str]:
        """(allowed, reason). The privileged group first, as the kube-apiserver's authorizer
        chain starts (pkg/kubeapiserver/authorizer/config.go: `system:masters` is always
        allowed), then plugin/pkg/auth/authorizer/rbac/rbac.go, RBACAuthorizer.Authorize:
        every rule of every ClusterRoleBinding, then of every RoleBinding in the request's
        namespace, that names the user (VisitRulesFor in pkg/registry/rbac/validation/
        rule.go); denied, the reason lists the bindings whose role was not found."""
        if "system:masters" in a.user.groups:
            return True, ""
        errors = []
        scoped = [(b, "") for b in self.cluster_bindings]
        if a.namespace:
            scoped += [
                (b, a.namespace)
                for b in self.bindings
                if (b.get("metadata") or {}).get("namespace", "default") == a.namespace
            ]
        for binding, namespace in scoped:
            if not any(_applies(s, a.user, namespace) for s in binding.get("subjects") or []):
                continue
            rules, missing = self._role_rules(binding.get("roleRef") or {}, namespace)
            if missing:
                errors.append(missing)
            if any(rule.allows(a) for rule in rules):
                return True, ""
        reason = ""
        if errors:  # utilerrors.NewAggregate: one as itself, more as `[a, b]`
            reason = "RBAC: " + (errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]")
        return False, reason


def shipped_documents(root: Path = REPO_ROOT) -> list[Obj | None] | None:
    """The documents of the shipped RBAC files (a test edits a copy), None without them."""
    paths = [root / p for p in SHIPPED]
    if not all(p.is_file() for p in paths):
        return None
    return [doc for p in paths for doc in yaml.safe_load_all(p.read_text())]


def forbidden_message(a: Attributes, reason: str = "") -> str:
    """k8s.io/apiserver/pkg/endpoints/handlers/responsewriters/errors.go, forbiddenMessage,
    with the authorizer's reason after it."""
    if not a.resource_request:
        message = f'User "{a.user.name}" cannot {a.verb} path "{a.path}"'
    else:
        resource = f"{a.resource}/{a.subresource}" if a.subresource else a.resource
        where = f'in the namespace "{a.namespace}"' if a.namespace else "at the cluster scope"
        message = (f'User "{a.user.name}" cannot {a.verb} resource "{resource}" in API group '
                   f'"{a.api_group}" {where}')  # fmt: skip
    return f"{message}: {reason}" if reason else message


def _qualified(a: Attributes) -> str:
    """schema.GroupResource.String(): `resource.group`, or `resource` for the core group."""
    return f"{a.resource}.{a.api_group}" if a.api_group else a.resource


def _forbidden(a: Attributes, name: str, reason: str) -> str:
    """apimachinery/pkg/api/errors/errors.go, NewForbidden's message."""
    qualified = _qualified(a)
    head = f'{qualified} "{name}"' if name else qualified
    if not a.resource_request:
        return f"forbidden: {forbidden_message(a, reason)}"
    return f"{head} is forbidden: {forbidden_message(a, reason)}"


def forbidden_status(a: Attributes, reason: str = "") -> Obj:
    """The 403 body responsewriters.Forbidden writes for a request the authorizer denied: a
    Status whose message names the object, the user, the verb and the resource."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": _forbidden(a, a.name, reason),
        "reason": "Forbidden",
        "details": {"name": a.name, "group": a.api_group, "kind": a.resource},
        "code": 403,
    }


def synthetic_forbidden(a: Attributes, reason: str = "") -> str:
    """responsewriters.ForbiddenStatusError's message, which the registry's synthetic checks
    (pkg/registry/resource/utils.go, checkAuthorization) embed in a field error: the name
    carries the subresource, `resource/subresource` when there is no name (Kubernetes
    1.37.2 refused the agent's binding change naming `"resourceclaims/binding"`)."""
    name = a.name
    if a.subresource:
        name = f"{name}/{a.subresource}" if name else f"{a.resource}/{a.subresource}"
    return _forbidden(a, name, reason)


@dataclass(frozen=True)
class Caller:
    """Who sent a request, for the registry's own authorization checks on synthetic
    subresources (pkg/registry/resource/utils.go); no policy authorizes everything."""

    request: Attributes
    policy: Policy | None

    @property
    def user(self) -> User:
        return self.request.user

    def denied(self, verb: str, subresource: str, namespace: str, name: str) -> str | None:
        """None when allowed, else the ForbiddenStatusError message of the check."""
        if self.policy is None:
            return None
        a = replace(self.request, verb=verb, subresource=subresource, namespace=namespace,
                    name=name)  # fmt: skip
        allowed, reason = self.policy.authorize(a)
        return None if allowed else synthetic_forbidden(a, reason)


def bearer(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header."""
    scheme, _, token = (header or "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None
