"""The API server client: configured from the service account or KUBECONFIG, used raw.

`kubernetes` is imported only here and only when credentials exist, so a plugin start
without a cluster stays fast. Responses are read as plain JSON (`_preload_content=False`),
every call carries a timeout, and `call_with_retry` retries 409s and transient failures.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from deviceplugin.plumbing import logs

LOG = logs.get("kube")
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
MERGE_PATCH = "application/merge-patch+json"
# Server-side apply; JSON is YAML, so the client sends the body as JSON under this type.
APPLY_PATCH = "application/apply-patch+yaml"
# Statuses worth another try: conflict, throttled, and the server's own failures.
RETRY_STATUSES = frozenset({409, 429, 500, 502, 503, 504})

T = TypeVar("T")


class KubeError(Exception):
    """An API call failed; `status` is the HTTP status, or None when no answer came."""

    def __init__(self, what: str, status: int | None, detail: str = "") -> None:
        self.what = what
        self.status = status
        super().__init__(f"{what}: status={status} {detail}".strip())

    @property
    def retryable(self) -> bool:
        return self.status is None or self.status in RETRY_STATUSES


def _detail(err: Any) -> str:
    """The reason, and the Status body's message when there is one (a 422 names the field
    and why: the operator needs it, and the slice publisher finds the refused device in it)."""
    reason = str(err.reason or "")
    try:
        message = json.loads(err.body or b"").get("message")
    except (ValueError, TypeError, AttributeError):
        message = None
    return f"{reason}: {message}" if message else reason


class Gone(KubeError):
    """410: the watch's resourceVersion is too old; relist."""


@dataclass(frozen=True)
class Timeouts:
    connect: float = 3.0
    read: float = 10.0
    watch: int = 240  # server-side end of one watch request, seconds


class Api:
    """The handful of calls the plugin makes, as plain dicts in and out.

    `resource` is the `resource.k8s.io/v1` client (ResourceSlices, ResourceClaims) for DRA.
    """

    def __init__(self, core: Any, timeouts: Timeouts = Timeouts(), resource: Any = None) -> None:
        self._core = core
        self._resource = resource
        self._t = timeouts

    def _timeout(self) -> tuple[float, float]:
        return (self._t.connect, self._t.read)

    def _raw(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            resp = fn(*args, _preload_content=False, _request_timeout=self._timeout(), **kwargs)
            data = resp.data
        except ApiException as err:
            raise KubeError(what, err.status, _detail(err)) from err
        except Exception as err:  # urllib3/socket failures: no answer at all
            raise KubeError(what, None, type(err).__name__) from err
        return json.loads(data) if data else {}

    def list_pods(self, node: str) -> dict[str, Any]:
        return dict(
            self._raw(
                "list pods",
                self._core.list_pod_for_all_namespaces,
                field_selector=f"spec.nodeName={node}",
            )
        )

    def watch_pods(
        self, node: str, resource_version: str, on_open: Callable[[Any], None]
    ) -> Iterator[dict[str, Any]]:
        """Watch events (`{"type", "object"}`) after `resource_version` until the server ends it.

        `on_open` receives the open response so another thread can shut it down.
        """
        return self._watch(
            "watch pods",
            self._core.list_pod_for_all_namespaces,
            resource_version,
            on_open,
            field_selector=f"spec.nodeName={node}",
        )

    def _watch(
        self,
        what: str,
        fn: Callable[..., Any],
        resource_version: str,
        on_open: Callable[[Any], None],
        **selectors: str,
    ) -> Iterator[dict[str, Any]]:
        from kubernetes.client.exceptions import ApiException

        try:
            resp = fn(
                **selectors,
                watch=True,
                allow_watch_bookmarks=True,
                resource_version=resource_version,
                timeout_seconds=self._t.watch,
                _preload_content=False,
                # read timeout a little past the server's own end of the watch
                _request_timeout=(self._t.connect, self._t.watch + 30),
            )
        except ApiException as err:
            if err.status == 410:
                raise Gone(what, 410) from err
            raise KubeError(what, err.status, str(err.reason or "")) from err
        except Exception as err:
            raise KubeError(what, None, type(err).__name__) from err
        on_open(resp)
        try:
            buffer = b""
            # amt=None: one chunk at a time, as the API server flushes each event
            for chunk in resp.stream(None, decode_content=True):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        yield _watch_event(line, what)
            if buffer.strip():
                yield _watch_event(buffer, what)
        except (KubeError, GeneratorExit):
            raise
        except Exception as err:
            raise KubeError(what, None, type(err).__name__) from err
        finally:
            resp.release_conn()

    def patch_pod(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return dict(
            self._raw(
                f"patch pod {namespace}/{name}",
                self._core.patch_namespaced_pod,
                name,
                namespace,
                body,
                _content_type=MERGE_PATCH,
            )
        )

    def get_node(self, name: str) -> dict[str, Any]:
        return dict(self._raw(f"get node {name}", self._core.read_node, name))

    def patch_node(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return dict(
            self._raw(
                f"patch node {name}",
                self._core.patch_node,
                name,
                body,
                _content_type=MERGE_PATCH,
            )
        )

    def create_event(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return dict(
            self._raw(
                f"create event in {namespace}",
                self._core.create_namespaced_event,
                namespace,
                body,
            )
        )

    # ---- resource.k8s.io/v1 (DRA) ------------------------------------------------------
    def list_resource_slices(self, node: str, driver: str) -> dict[str, Any]:
        """This node's slices of `driver` (the field selectors the kubelet's wipe uses too)."""
        return dict(
            self._raw(
                "list resourceslices",
                self._resource.list_resource_slice,
                field_selector=f"spec.nodeName={node},spec.driver={driver}",
            )
        )

    def watch_resource_slices(
        self, node: str, driver: str, resource_version: str, on_open: Callable[[Any], None]
    ) -> Iterator[dict[str, Any]]:
        return self._watch(
            "watch resourceslices",
            self._resource.list_resource_slice,
            resource_version,
            on_open,
            field_selector=f"spec.nodeName={node},spec.driver={driver}",
        )

    def create_resource_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        return dict(
            self._raw(f"create resourceslice {name}", self._resource.create_resource_slice, body)
        )

    def replace_resource_slice(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return dict(
            self._raw(
                f"replace resourceslice {name}", self._resource.replace_resource_slice, name, body
            )
        )

    def delete_resource_slice(self, name: str) -> None:
        self._raw(f"delete resourceslice {name}", self._resource.delete_resource_slice, name)

    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        return dict(
            self._raw(
                f"get resourceclaim {namespace}/{name}",
                self._resource.read_namespaced_resource_claim,
                name,
                namespace,
            )
        )

    def apply_resource_claim_status(
        self, namespace: str, name: str, body: dict[str, Any], field_manager: str
    ) -> dict[str, Any]:
        """Server-side apply on the status subresource, forced, as `field_manager`: the body
        names only the fields that manager owns (a driver's `status.devices` entries), so the
        scheduler's allocation and reservedFor are never sent back."""
        return dict(
            self._raw(
                f"apply resourceclaim {namespace}/{name} status",
                self._resource.patch_namespaced_resource_claim_status,
                name,
                namespace,
                body,
                field_manager=field_manager,
                force=True,
                _content_type=APPLY_PATCH,
            )
        )


def _watch_event(line: bytes, what: str) -> dict[str, Any]:
    event = json.loads(line)
    if not isinstance(event, dict):
        raise KubeError(what, None, "malformed event")
    if event.get("type") == "ERROR":
        status = (event.get("object") or {}).get("code")
        if status == 410:
            raise Gone(what, 410)
        raise KubeError(what, status if isinstance(status, int) else None, "error event")
    return event


def load_api(
    environ: Mapping[str, str],
    service_account_dir: str = SERVICE_ACCOUNT_DIR,
    timeouts: Timeouts = Timeouts(),
) -> Api | None:
    """An Api from the in-cluster service account, else KUBECONFIG; None when neither exists."""
    token = os.path.join(service_account_dir, "token")
    in_cluster = bool(environ.get("KUBERNETES_SERVICE_HOST")) and os.path.exists(token)
    kubeconfig = environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    if not in_cluster and not (kubeconfig and os.path.exists(kubeconfig)):
        return None
    # Imported here: the client is large and only needed with credentials.
    from kubernetes import client, config
    from kubernetes.config.incluster_config import InClusterConfigLoader

    configuration = client.Configuration()
    if in_cluster:
        loader = InClusterConfigLoader(  # type: ignore[no-untyped-call]
            token_filename=token,
            cert_filename=os.path.join(service_account_dir, "ca.crt"),
            environ=dict(environ),
        )
        loader.load_and_set(configuration)  # type: ignore[no-untyped-call]
        source = "service-account"
    else:
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig, client_configuration=configuration
        )
        source = "kubeconfig"
    logs.log(LOG, "kubernetes client configured", source=source, host=configuration.host)
    api_client = client.ApiClient(configuration)
    return Api(client.CoreV1Api(api_client), timeouts, client.ResourceV1Api(api_client))


@dataclass(frozen=True)
class Backoff:
    first: float = 0.2
    factor: float = 2.0
    cap: float = 10.0
    attempts: int = 5

    def delays(self) -> Iterator[float]:
        delay = self.first
        for _ in range(self.attempts - 1):
            yield delay
            delay = min(delay * self.factor, self.cap)


def call_with_retry(
    what: str,
    fn: Callable[[], T],
    stop: threading.Event,
    backoff: Backoff = Backoff(),
) -> T | None:
    """`fn()`, retried on 409 and transient errors; None (logged once) when it gives up."""
    delays = backoff.delays()
    while True:
        try:
            return fn()
        except KubeError as err:
            delay = next(delays, None) if err.retryable else None
            if delay is None or stop.is_set():
                logs.log(LOG, "kubernetes call failed", level=logging.WARNING, what=what,
                         status=err.status, error=str(err))  # fmt: skip
                return None
            logs.log(LOG, "kubernetes call retried", level=logging.DEBUG, what=what,
                     status=err.status, delay=delay)  # fmt: skip
            if stop.wait(delay):
                return None
