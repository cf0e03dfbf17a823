"""The measurements, each against a running `Plugin` and its kubelet simulator.

Every latency is taken on this side of a socket with `time.perf_counter` (gRPC calls) or
`time.monotonic` (the simulator's receipt times), so each figure includes the transport.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from benchlib import echo, procstat
from benchlib.plugin import Plugin, PluginError
from benchlib.stats import spread, summary_ms
from deviceplugin._pb import deviceplugin_v1beta1_pb2 as pb
from deviceplugin.ledger.record import read_records
from deviceplugin.model import split_slice_id
from deviceplugin.simulate.inject import inject
from deviceplugin.simulate.kubelet import Endpoint, Update

Devices = list[tuple[str, str, tuple[int, ...]]]
WARMUP = 20  # calls of each kind before counting: first-call channel and import costs
RATE_GAP = 0.25  # s; ListAndWatch sends at most 5 updates/s, so wait out the gap per cycle


def message_bytes(devices: Devices) -> int:
    """ByteSize of the ListAndWatchResponse the simulator received, rebuilt from its fields."""
    response = pb.ListAndWatchResponse()
    for device_id, health, nodes in devices:
        device = response.devices.add(ID=device_id, health=health)
        for node in nodes:
            device.topology.nodes.add(ID=node)
    return int(response.ByteSize())


def startup(plugin: Plugin, resources: int) -> dict[str, Any]:
    """Process start to the first full list of every resource; devices and message size."""
    plugin.wait_listed(resources)
    out: dict[str, Any] = {"devices": {}, "list_bytes": {}}
    last = 0.0
    for resource in plugin.kubelet.resources():
        ep = _endpoint(plugin, resource)
        first = ep.updates[0]
        last = max(last, first.at)
        out["devices"][resource] = len(first.devices)
        out["list_bytes"][resource] = message_bytes(first.devices)
    out["first_full_list_s"] = round(last - plugin.started_at, 4)
    return out


def _endpoint(plugin: Plugin, resource: str) -> Endpoint:
    ep = plugin.kubelet.endpoint(resource)
    if ep is None:
        raise PluginError(f"{resource} is not registered:\n{plugin.tail()}")
    return ep


def _by_gpu(device_ids: Sequence[str]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for device_id in device_ids:
        groups.setdefault(split_slice_id(device_id)[0], []).append(device_id)
    return groups


@dataclass
class _Kind:
    name: str
    call: Callable[[int], object]  # i-th call
    times: list[float]


def calls(
    plugin: Plugin, resource: str, count: int, new: int, sock_dir: Path, run: int = 0
) -> dict[str, Any]:
    """Allocate/GetPreferredAllocation on the plugin's socket vs a bare echo, interleaved
    call by call, each counted call after an uncounted call to a second echo process.

    All through the kubelet simulator's own channel and stub (sync grpc). Preferred asks for
    2 slices out of the full device list (a fresh node's request, the largest one). Allocate
    `reuse` (`count` calls) asks again for one of 20 sets granted in the warm-up; the allocator
    does the same work as for a new set (validate, the CDI spec, a ledger record) but the
    ledger stays small. Allocate `new` (`new` calls) takes a distinct 2-slice
    set per call, so the ledger grows by one record per call (run `run` takes the sets after
    those of the runs before it). The echo carries the Allocate
    request's bytes; the sink takes the preferred request's bytes and answers nothing. Then
    `count // 4` reuse calls back to back, each meeting what the last left after its reply.
    """
    ep = _endpoint(plugin, resource)
    all_ids = [d for d, _, _ in ep.updates[-1].devices]
    pairs = [g[i : i + 2] for g in _by_gpu(all_ids).values() for i in range(0, len(g) - 1, 2)]
    if not 0 < new <= count:
        raise PluginError(f"new allocations ({new}) must be 1 to calls ({count})")
    wanted = WARMUP + (run + 1) * new
    if len(pairs) < wanted:
        raise PluginError(f"{resource} has {len(pairs)} slice pairs, fewer than {wanted}")

    def allocate_req(ids: list[str]) -> pb.AllocateRequest:
        return pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])

    preferred_req = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=all_ids, allocation_size=2)
        ]
    )
    socket, spacer_socket = sock_dir / "echo.sock", sock_dir / "spacer.sock"
    server, spacer_server = echo.start(socket), echo.start(spacer_socket)
    channel, spacer_channel = echo.channel(socket), echo.channel(spacer_socket)
    try:
        grpc.channel_ready_future(channel).result(timeout=30)
        grpc.channel_ready_future(spacer_channel).result(timeout=30)
        spacer_call = echo.echo_call(spacer_channel, pb.AllocateRequest)
        echo_call = echo.echo_call(channel, pb.AllocateRequest)
        sink_call = channel.unary_unary(
            f"/{echo.SERVICE}/Sink",
            request_serializer=pb.PreferredAllocationRequest.SerializeToString,
            response_deserializer=pb.PreferredAllocationResponse.FromString,
        )
        small = allocate_req(pairs[0])
        new_pairs = pairs[WARMUP + run * new :]
        stub = ep.stub

        def allocate_new(i: int) -> object:
            return stub.Allocate(allocate_req(new_pairs[i]), timeout=30)

        def allocate_reuse(i: int) -> object:
            return stub.Allocate(allocate_req(pairs[i % WARMUP]), timeout=30)

        kinds = [
            _Kind("echo", lambda i: echo_call(small, timeout=30), []),
            _Kind("echo_preferred_payload", lambda i: sink_call(preferred_req, timeout=30), []),
            _Kind(
                "preferred", lambda _: stub.GetPreferredAllocation(preferred_req, timeout=30), []
            ),
            _Kind("allocate_new", allocate_new, []),
            _Kind("allocate_reuse", allocate_reuse, []),
        ]
        for kind in kinds:
            for i in range(WARMUP):
                if kind.name == "allocate_new":
                    ep.stub.Allocate(allocate_req(pairs[i]), timeout=30)  # the reuse set
                else:
                    kind.call(i)
        spill: list[float] = []  # spacer calls right after a plugin call
        last = "echo"
        back_to_back: list[float] = []
        new_steps = {j * count // new for j in range(new)}  # allocate_new joins these steps
        for i in range(count):
            # One call of each kind per step, in an order that rotates, so a burst of host
            # noise lands on every kind alike.
            step = [k for k in kinds if k.name != "allocate_new" or i in new_steps]
            shift = i % len(step)
            for kind in step[shift:] + step[:shift]:
                # An uncounted call to a second echo process first: every counted call then
                # follows another process's work, as an Allocate follows the kubelet's own
                # between two admissions, and what the last call left until after its reply
                # (a log line, a wake) lands on the spacer, not on the call being counted.
                started = time.perf_counter()
                spacer_call(small, timeout=30)
                spacer = time.perf_counter() - started
                if last not in ("echo", "echo_preferred_payload"):
                    spill.append(spacer)
                started = time.perf_counter()
                kind.call(len(kind.times))  # the i-th call of its kind
                kind.times.append(time.perf_counter() - started)
                last = kind.name
        # The same devices again, back to back: each call meets what the last one deferred.
        for i in range(count // 4):
            started = time.perf_counter()
            allocate_reuse(i)
            back_to_back.append(time.perf_counter() - started)
    finally:
        channel.close()
        spacer_channel.close()
        for proc in (server, spacer_server):
            proc.terminate()
            proc.wait(10)
    out: dict[str, Any] = {k.name: summary_ms(k.times) for k in kinds}
    out["echo_after_plugin_call"] = summary_ms(spill)
    out["allocate_reuse_back_to_back"] = summary_ms(back_to_back)
    out["ledger_records_after"] = len(read_records(plugin.state))  # what the plugin recorded
    out["preferred_request_bytes"] = preferred_req.ByteSize()
    out["allocate_request_bytes"] = small.ByteSize()
    for q in ("p50_ms", "p99_ms"):
        out[f"ratio_{q[:3]}"] = {
            name: round(out[name][q] / out["echo"][q], 3)
            for name in ("preferred", "allocate_new", "allocate_reuse")
        }
    out["ratio_p99_payload_matched"] = {
        "preferred": round(out["preferred"]["p99_ms"] / out["echo_preferred_payload"]["p99_ms"], 3)
    }
    return out


def call_spreads(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each p99 ratio over the runs of `calls`: median, range, every run."""
    out = {
        name: spread([r["ratio_p99"][name] for r in runs])
        for name in ("preferred", "allocate_new", "allocate_reuse")
    }
    out["preferred_payload_matched"] = spread(
        [r["ratio_p99_payload_matched"]["preferred"] for r in runs]
    )
    return out


def _wait_update(
    plugin: Plugin, resource: str, since: int, ok: Callable[[Devices], bool], timeout: float
) -> Update:
    """The first update received after index `since` of the current endpoint satisfying `ok`."""
    found: list[Update] = []

    def check() -> bool:
        ep = plugin.kubelet.endpoint(resource)
        if ep is None:
            return False
        for update in ep.updates[since:]:
            if ok(update.devices):
                found.append(update)
                return True
        return False

    if not plugin.kubelet.wait_for(check, timeout):
        raise PluginError(f"no matching ListAndWatch update for {resource} in {timeout}s")
    return found[0]


def faults(plugin: Plugin, resource: str, cycles: int, xid: int = 79) -> dict[str, Any]:
    """`xid` then `recover` on each GPU in turn: injection to the Unhealthy update, and back."""
    ep = _endpoint(plugin, resource)
    gpus = list(_by_gpu([d for d, _, _ in ep.updates[-1].devices]))

    def all_healthy(devices: Devices) -> bool:
        return all(h == "Healthy" for _, h, _ in devices)

    _wait_update(plugin, resource, 0, all_healthy, 60)
    to_unhealthy: list[float] = []  # from the Xid entering NVML (the harness's stamp)
    inject_to_unhealthy: list[float] = []  # from the bench's inject call: the harness too
    to_healthy: list[float] = []
    largest = 0
    for cycle in range(cycles):
        gpu = gpus[cycle % len(gpus)]

        def gpu_down(devices: Devices, gpu: str = gpu) -> bool:
            mine = [h for d, h, _ in devices if d.startswith(gpu + "::")]
            return bool(mine) and all(h == "Unhealthy" for h in mine)

        time.sleep(RATE_GAP)
        since = len(ep.updates)
        started = time.monotonic()
        happened = inject(plugin.state, gpu, "xid", xid)["at"]
        down = _wait_update(plugin, resource, since, gpu_down, 30)
        to_unhealthy.append(down.at - happened)
        inject_to_unhealthy.append(down.at - started)
        largest = max(largest, message_bytes(down.devices))
        time.sleep(RATE_GAP)
        since = len(ep.updates)
        started = time.monotonic()
        inject(plugin.state, gpu, "recover")
        up = _wait_update(plugin, resource, since, all_healthy, 60)
        to_healthy.append(up.at - started)
    return {
        "xid": xid,
        "cycles": cycles,
        "to_unhealthy": summary_ms(to_unhealthy),
        "inject_to_unhealthy": summary_ms(inject_to_unhealthy),
        "recover_to_healthy": summary_ms(to_healthy),
        "largest_unhealthy_list_bytes": largest,
    }


def restarts(plugin: Plugin, count: int) -> dict[str, Any]:
    """Kubelet restarts (sockets deleted, new kubelet.sock) to every resource re-registered."""
    kubelet = plugin.kubelet
    resources = kubelet.resources()
    registered: list[float] = []
    listed: list[float] = []
    from_socket: list[float] = []
    for _ in range(count):
        time.sleep(0.3)  # let the previous round's servers settle
        started = time.monotonic()
        kubelet.restart()
        socket_up = time.monotonic()

        def back(started: float = started) -> bool:
            eps = [kubelet.endpoint(r) for r in resources]
            return all(ep is not None and ep.registered_at >= started and ep.updates for ep in eps)

        if not kubelet.wait_for(back, 30):
            raise PluginError(f"not re-registered within 30 s:\n{plugin.tail()}")
        eps = [_endpoint(plugin, r) for r in resources]
        registered.append(max(ep.registered_at for ep in eps) - started)
        from_socket.append(max(ep.registered_at for ep in eps) - socket_up)
        listed.append(max(ep.updates[0].at for ep in eps) - started)
    return {
        "restarts": count,
        "to_registered": summary_ms(registered),
        "new_socket_to_registered": summary_ms(from_socket),
        "to_first_list": summary_ms(listed),
    }


def idle(plugin: Plugin, seconds: float, settle: float = 2.0) -> dict[str, Any]:
    """CPU (% of one core) of the plugin and its children, MPS daemons apart, and its RSS."""
    plugin.wait_listed(1)
    time.sleep(settle)
    pid = plugin.pid
    mps = plugin.mps_pids()
    cpu0, mps0 = procstat.tree_cpu_seconds(pid), procstat.pids_cpu_seconds(mps)
    started = time.monotonic()
    peak = procstat.rss_bytes(pid)
    while time.monotonic() - started < seconds:
        time.sleep(min(1.0, max(0.0, seconds - (time.monotonic() - started))))
        peak = max(peak, procstat.rss_bytes(pid))
    elapsed = time.monotonic() - started
    cpu1, mps1 = procstat.tree_cpu_seconds(pid), procstat.pids_cpu_seconds(mps)
    if not procstat.alive(pid):
        raise PluginError(f"plugin exited during the idle measurement:\n{plugin.tail()}")
    rss = procstat.rss_bytes(pid)
    return {
        "seconds": round(elapsed, 3),
        "settle_s": settle,
        "cpu_percent": round(100.0 * (cpu1 - cpu0) / elapsed, 3),
        "children": len(procstat.children(pid)),
        "rss_mb": round(rss / 2**20, 2),
        "rss_peak_mb": round(peak / 2**20, 2),
        "mps_daemons": len(mps),
        "mps_cpu_percent": round(100.0 * (mps1 - mps0) / elapsed, 3),
    }
