"""In-test kubelet pod-resources server built from protos/, on a real unix socket.

Tests set `pods` (namespace, pod, container, resource, device ids) and read `calls`;
`fail` makes `List` answer UNAVAILABLE, as a restarting kubelet does.
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from deviceplugin._pb import podresources_v1_pb2 as pb
from deviceplugin._pb import podresources_v1_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class Assigned:
    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


class FakePodResources(pb_grpc.PodResourcesListerServicer):
    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.lock = threading.Lock()
        self.pods: list[Assigned] = []
        self.calls = 0
        self.fail = False
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_PodResourcesListerServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{socket_path}")

    def start(self) -> FakePodResources:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    def set(self, *assigned: Assigned) -> None:
        with self.lock:
            self.pods = list(assigned)

    def List(self, request: Any, context: Any) -> pb.ListPodResourcesResponse:
        with self.lock:
            self.calls += 1
            if self.fail:
                context.abort(grpc.StatusCode.UNAVAILABLE, "kubelet restarting")
            pods: dict[tuple[str, str], dict[str, list[pb.ContainerDevices]]] = {}
            for a in self.pods:
                containers = pods.setdefault((a.namespace, a.pod), {})
                devices = containers.setdefault(a.container, [])
                # The kubelet lists every pod, with devices or without, and each device as an
                # entry of its own, never one per Allocate (pkg/kubelet/cm/
                # container_manager_linux.go, containerDevicesFromResourceDeviceInstances).
                devices.extend(
                    pb.ContainerDevices(resource_name=a.resource, device_ids=[d])
                    for d in a.device_ids
                )
        return pb.ListPodResourcesResponse(
            pod_resources=[
                pb.PodResources(
                    name=name,
                    namespace=ns,
                    containers=[
                        pb.ContainerResources(name=c, devices=devs) for c, devs in cs.items()
                    ],
                )
                for (ns, name), cs in pods.items()
            ]
        )
