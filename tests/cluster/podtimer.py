"""Run inside the cluster's namespaces: create pods one after another and time each from its
create call to the watch event that shows it Running (the client's clock, not the API
server's one-second timestamps). Prints one JSON object: kind → seconds per pod.

    hack/cluster/exec.sh python -m tests.cluster.podtimer KIND COUNT
KIND: plain (no resource), dp (nvidia.com/gpu-fraction: 1), dra (a 1Gi time-slicing claim).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from kubernetes import client, config, watch

IMAGE = "localhost/gpu-fraction/busybox:1"


def body(name: str, kind: str) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "app", "image": IMAGE, "imagePullPolicy": "Never", "command": ["sleep", "3600"],
    }  # fmt: skip
    spec: dict[str, Any] = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                            "containers": [container]}  # fmt: skip
    if kind == "dp":
        container["resources"] = {"limits": {"nvidia.com/gpu-fraction": "1"}}
    elif kind == "dra":
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "timer-1gi"}]
        container["resources"] = {"claims": [{"name": "gpu"}]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def main(kind: str, count: int) -> None:
    config.load_kube_config()
    core = client.CoreV1Api()
    if kind == "dra":
        template = {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "timer-1gi"},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "time-slicing.gpu-fraction.dev",
                "capacity": {"requests": {"memory": "1Gi"}}}}]}}},
        }  # fmt: skip
        client.CustomObjectsApi().create_namespaced_custom_object(
            "resource.k8s.io", "v1", "default", "resourceclaimtemplates", template
        )
    seconds = []
    for i in range(count):
        name = f"timer-{kind}-{i}"
        start = time.monotonic()
        core.create_namespaced_pod("default", body(name, kind))
        w = watch.Watch()
        selector = f"metadata.name={name}"
        stream = w.stream(core.list_namespaced_pod, "default", field_selector=selector,
                          timeout_seconds=120)  # fmt: skip
        for event in stream:
            if event["object"].status.phase == "Running":
                seconds.append(time.monotonic() - start)
                w.stop()
            elif event["object"].status.phase in ("Failed", "Succeeded"):
                raise SystemExit(f"{name} ended {event['object'].status.phase}")
        else:
            if len(seconds) != i + 1:
                raise SystemExit(f"{name} not Running within 120 s")
    for i in range(count):
        core.delete_namespaced_pod(f"timer-{kind}-{i}", "default", grace_period_seconds=0)
    print(json.dumps({kind: seconds}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
