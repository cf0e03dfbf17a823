"""A stand-in Kubernetes API server for tests, the demo and the benchmarks: only the endpoints
the plugin uses, over real HTTP.
Serves list/watch of pods (field selector `spec.nodeName`), pod patch, node get/patch and
event create, applying JSON merge patches to its own state and recording every request, and
`resource.k8s.io/v1` (ResourceSlices, ResourceClaims, DeviceClasses: `dra_apiserver.py`).
Every request is authorized first, by the RBAC the project ships (`rbac.py`): the agent's
token (`write_kubeconfig`) is its ServiceAccount bound to its node, `rbac.ADMIN_HEADERS` an
admin for tests that set up fixtures over HTTP; a denied request gets the real 403 Status
and is kept in `denied`. Tests script failures (`fail_next`), cut watches
(`disconnect_watches`), expire resource versions (`expire_watches`) and stop the whole
server to play "API server down".
Over 400 lines on purpose: one HTTP handler over one store and one lock.
"""

from __future__ import annotations

import bisect
import copy
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from deviceplugin.simulate import rbac
from deviceplugin.simulate.api_versions import Versions
from deviceplugin.simulate.dra_apiserver import GROUP, DraStore


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    content_type: str
    body: Any


def pod(
    name: str,
    containers: dict[str, dict[str, int]],
    *,
    namespace: str = "ns",
    node: str = "node-1",
    phase: str = "Pending",
    annotations: dict[str, str] | None = None,
    init: dict[str, dict[str, int]] | None = None,
) -> dict[str, Any]:
    """A pod bound to `node`; containers map name → {resource: count} (as limits)."""

    def spec(cs: dict[str, dict[str, int]]) -> list[dict[str, Any]]:
        return [
            {"name": n, "resources": {"limits": {r: str(c) for r, c in res.items()}}}
            for n, res in cs.items()
        ]

    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "annotations": annotations or {}},
        "spec": {"nodeName": node, "containers": spec(containers)},
        "status": {"phase": phase},
    }
    if init:
        body["spec"]["initContainers"] = spec(init)
    return body


def after(history: Sequence[tuple[Any, ...]], rv: int) -> int:
    """Index of the first entry newer than `rv` (histories are in resourceVersion order, so a
    watch costs its own events, not the whole history's, however long a run grows it)."""
    return bisect.bisect_right(history, rv, key=lambda h: int(h[0]))


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


class FakeApiServer:
    def __init__(self, policy: rbac.Policy | None = None) -> None:
        """`policy` defaults to the shipped RBAC (`rbac.Policy.shipped`)."""
        self.policy = policy if policy is not None else rbac.Policy.shipped()
        self.tokens: dict[str, rbac.User] = {rbac.ADMIN_TOKEN: rbac.ADMIN}
        self.denied: list[str] = []  # the message of every 403 the authorizer gave
        self.versions = Versions()
        self.requests: list[Request] = []
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.fail_next: dict[tuple[str, str], list[int]] = {}  # (method, kind) → statuses
        self._watch_generation = 0
        self.down = False  # stopped: kept-alive connections get no answer either
        self._expired_below = 0
        self.dra = DraStore(self.versions)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def cond(self) -> threading.Condition:
        return self.versions.cond

    @property
    def rv(self) -> int:
        return self.versions.rv

    # --- lifecycle -------------------------------------------------------------------------
    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeApiServer:
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop answering at all: open watches end, new connections are refused."""
        self.down = True
        self.disconnect_watches()
        self._server.shutdown()
        self._server.server_close()

    def agent_token(self, node: str | None = None) -> str:
        """The agent's token, bound (as the kubelet's pod-bound tokens are) to `node`: by
        default the one Node this server holds, the agent's own."""
        if node is None:
            with self.cond:
                (node,) = self.nodes
        token = f"agent-token-{node}"
        self.tokens[token] = rbac.agent(node)
        return token

    def write_kubeconfig(self, path: Path, node: str | None = None) -> Path:
        """A kubeconfig for the agent (`agent_token`)."""
        token = self.agent_token(node)
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                    "users": [{"name": "fake", "user": {"token": token}}],
                    "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                    "current-context": "fake",
                }
            )
        )
        return path

    # --- state the tests drive ---------------------------------------------------------------
    def _bump(self, kind: str, obj: dict[str, Any]) -> None:
        rv = self.versions.bump()
        obj.setdefault("metadata", {})["resourceVersion"] = str(rv)
        self.history.append((rv, kind, copy.deepcopy(obj)))
        self.cond.notify_all()

    def add_pod(self, pod: dict[str, Any]) -> None:
        with self.cond:
            meta = pod["metadata"]
            meta.setdefault("uid", f"uid-{meta['namespace']}-{meta['name']}")
            self.pods[(meta["namespace"], meta["name"])] = pod
            self._bump("ADDED", pod)

    def update_pod(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        with self.cond:
            pod = merge_patch(self.pods[(namespace, name)], patch)
            self.pods[(namespace, name)] = pod
            self._bump("MODIFIED", pod)

    def delete_pod(self, namespace: str, name: str) -> None:
        with self.cond:
            pod = self.pods.pop((namespace, name))
            self._bump("DELETED", pod)

    def add_node(self, name: str, labels: dict[str, str] | None = None) -> None:
        with self.cond:
            self.nodes[name] = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "uid": f"uid-node-{name}", "labels": labels or {}},
            }

    def disconnect_watches(self) -> None:
        with self.cond:
            self._watch_generation += 1
            self.cond.notify_all()

    def expire_watches(self) -> None:
        """Every resourceVersion seen so far is now too old: watches from it get 410."""
        with self.cond:
            # a write elsewhere moves the store on; a relist sees a newer version
            self._expired_below = self.versions.bump()
            self._watch_generation += 1
            self.cond.notify_all()

    def requests_for(self, method: str, path_part: str) -> list[Request]:
        with self.cond:
            return [r for r in self.requests if r.method == method and path_part in r.path]

    def wait_for(self, predicate: Callable[[FakeApiServer], object], timeout: float = 10.0) -> bool:
        with self.cond:
            return bool(self.cond.wait_for(lambda: predicate(self), timeout))


class _Handler(BaseHTTPRequestHandler):
    fake: FakeApiServer
    _raw_body = b""
    _request = rbac.Attributes(rbac.ANONYMOUS, "")  # this request's, once authorized
    # Watches are chunked, as the real API server sends them; every other answer has a length.
    protocol_version = "HTTP/1.1"
    # As Go's net/http does: with Nagle on, a kept-alive connection's answer (headers, then
    # body, in separate writes) waited out the client's delayed ACK, 40 ms a request.
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _status(self, code: int, reason: str) -> None:
        self._send(code, {"kind": "Status", "status": "Failure", "code": code,
                          "reason": reason})  # fmt: skip

    def _record(self, method: str) -> tuple[list[str], dict[str, str], Any] | None:
        """The request's path parts, query and body; None when it was refused (answered)."""
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        self._raw_body = raw  # the DRA group compares some fields as the bytes sent
        with self.fake.cond:
            self.fake.requests.append(
                Request(method, url.path, query, self.headers.get("Content-Type", ""), body)
            )
            self.fake.cond.notify_all()
        if not self._authorized(method):
            return None
        return [p for p in url.path.split("/") if p], query, body

    def _authorized(self, method: str) -> bool:
        """The authentication and authorization filters of the real handler chain
        (k8s.io/apiserver/pkg/endpoints/filters/authorization.go, WithAuthorization): the
        token names the user, the request info its verb and resource, RBAC decides."""
        token = rbac.bearer(self.headers.get("Authorization"))
        user = self.fake.tokens.get(token) if token else rbac.ANONYMOUS
        if user is None:
            self._send(401, {"kind": "Status", "status": "Failure", "code": 401,
                             "reason": "Unauthorized", "message": "Unauthorized"})  # fmt: skip
            return False
        self._request = rbac.request_info(user, method, self.path)
        if self.fake.policy is None:
            return True
        allowed, reason = self.fake.policy.authorize(self._request)
        if not allowed:
            status = rbac.forbidden_status(self._request, reason)
            with self.fake.cond:
                self.fake.denied.append(status["message"])
                self.fake.cond.notify_all()
            self._send(403, status)
        return allowed

    def _scripted_failure(self, method: str, kind: str) -> bool:
        with self.fake.cond:
            queue = self.fake.fail_next.get((method, kind))
            status = queue.pop(0) if queue else None
        if status is None:
            return False
        self._status(status, "Conflict" if status == 409 else "Scripted")
        return True

    def _dra(self, method: str, parts: list[str], query: dict[str, str], body: Any) -> None:
        rest = parts[len(GROUP) :]
        if self._scripted_failure(method, rest[0] if rest else ""):
            return
        wanted = self.fake.dra.watch_filter(rest, query) if method == "GET" else None
        if wanted is not None:
            self._open_watch()
            try:
                self._stream_dra(wanted, int(query.get("resourceVersion") or 0))
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                pass
            return
        caller = rbac.Caller(self._request, self.fake.policy)
        content_type = self.headers.get("Content-Type", "")
        status, answer = self.fake.dra.handle(
            method, rest, query, body, self._raw_body, content_type, caller
        )
        self._send(status, answer)

    def _stream_dra(self, wanted: Any, since: int) -> None:
        with self.fake.cond:
            generation = self.fake._watch_generation
        sent, fake = since, self.fake
        while True:
            with fake.cond:
                fake.cond.wait_for(
                    lambda: fake._watch_generation != generation or fake.rv > sent,  # noqa: B023
                    timeout=1.0,
                )
                if fake._watch_generation != generation or fake.down:
                    return
                batch = fake.dra.history[after(fake.dra.history, sent) :]
                sent = max(sent, fake.rv)
            for _rv, resource, kind, obj in batch:
                if wanted(resource, obj):
                    self._chunk(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

    def _dra_only(self, method: str) -> None:
        """A verb only the DRA group serves here."""
        got = self._record(method)
        if got is None:
            return
        parts, query, body = got
        if parts[: len(GROUP)] == GROUP:
            self._dra(method, parts, query, body)
        else:
            self._status(404, "NotFound")

    def do_PUT(self) -> None:
        self._dra_only("PUT")

    def do_DELETE(self) -> None:
        self._dra_only("DELETE")

    def do_GET(self) -> None:
        got = self._record("GET")
        if got is None:
            return
        parts, query, _ = got
        if parts[: len(GROUP)] == GROUP:
            self._dra("GET", parts, query, None)
        elif parts == ["api", "v1", "pods"]:
            if self._scripted_failure("GET", "pods"):
                return
            node = query.get("fieldSelector", "").removeprefix("spec.nodeName=")
            if query.get("watch") in ("true", "1", "True"):
                self._watch(node, int(query.get("resourceVersion") or 0))
            else:
                self._list(node)
        elif parts[:3] == ["api", "v1", "nodes"] and len(parts) == 4:
            with self.fake.cond:
                node_obj = copy.deepcopy(self.fake.nodes.get(parts[3]))
            if node_obj is None:
                self._status(404, "NotFound")
            else:
                self._send(200, node_obj)
        else:
            self._status(404, "NotFound")

    def _list(self, node: str) -> None:
        with self.fake.cond:
            items = [
                copy.deepcopy(p)
                for p in self.fake.pods.values()
                if (p.get("spec") or {}).get("nodeName") == node
            ]
            rv = self.fake.rv
        self._send(200, {"kind": "PodList", "apiVersion": "v1",
                         "metadata": {"resourceVersion": str(rv)}, "items": items})  # fmt: skip

    def _open_watch(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def _watch(self, node: str, since: int) -> None:
        self._open_watch()
        try:
            self._stream_events(node, since)
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass

    def _gone_away(self) -> bool:
        if self.fake.down:
            self.close_connection = True
        return self.fake.down

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _stream_events(self, node: str, since: int) -> None:
        with self.fake.cond:
            generation = self.fake._watch_generation
            expired = since < self.fake._expired_below
        if expired:
            gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410,
                                                "reason": "Expired"}}  # fmt: skip
            self._chunk(json.dumps(gone).encode() + b"\n")
            return
        sent = since
        fake = self.fake
        while True:
            with self.fake.cond:
                self.fake.cond.wait_for(
                    lambda: fake._watch_generation != generation or fake.rv > sent,  # noqa: B023
                    timeout=1.0,
                )
                if self.fake._watch_generation != generation:
                    return
                batch = self.fake.history[after(self.fake.history, sent) :]
                # every resourceVersion up to now is seen, DRA ones included (the pod history
                # never holds those: waiting for `rv > sent` on a pod's rv spun)
                sent = fake.rv
            for _rv, kind, obj in batch:
                if (obj.get("spec") or {}).get("nodeName") != node:
                    continue
                self._chunk(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

    def do_PATCH(self) -> None:
        got = self._record("PATCH")
        if got is None:
            return
        parts, query, body = got
        if parts[: len(GROUP)] == GROUP:
            self._dra("PATCH", parts, query, body)
        elif len(parts) == 6 and parts[:3] == ["api", "v1", "namespaces"] and parts[4] == "pods":
            if self._scripted_failure("PATCH", "pods"):
                return
            ns, name = parts[3], parts[5]
            with self.fake.cond:
                pod = self.fake.pods.get((ns, name))
                if pod is not None:
                    pod = merge_patch(pod, body)
                    self.fake.pods[(ns, name)] = pod
                    self.fake._bump("MODIFIED", pod)
                    pod = copy.deepcopy(pod)
            if pod is None:
                self._status(404, "NotFound")
            else:
                self._send(200, pod)
        elif len(parts) == 4 and parts[:3] == ["api", "v1", "nodes"]:
            if self._scripted_failure("PATCH", "nodes"):
                return
            with self.fake.cond:
                node_obj = self.fake.nodes.get(parts[3])
                if node_obj is not None:
                    node_obj = merge_patch(node_obj, body)
                    self.fake.nodes[parts[3]] = node_obj
                    node_obj = copy.deepcopy(node_obj)
            if node_obj is None:
                self._status(404, "NotFound")
            else:
                self._send(200, node_obj)
        else:
            self._status(404, "NotFound")

    def do_POST(self) -> None:
        got = self._record("POST")
        if got is None:
            return
        parts, query, body = got
        if parts[: len(GROUP)] == GROUP:
            self._dra("POST", parts, query, body)
        elif len(parts) == 5 and parts[:3] == ["api", "v1", "namespaces"] and parts[4] == "events":
            if self._scripted_failure("POST", "events"):
                return
            with self.fake.cond:
                self.fake.events.append(body)
                self.fake.cond.notify_all()
            self._send(201, body)
        else:
            self._status(404, "NotFound")


def _handler(server: FakeApiServer) -> type[BaseHTTPRequestHandler]:
    return type("Handler", (_Handler,), {"fake": server})
