"""Discrete-event simulation of inference services on GPUs with memory caps and shared compute.

Each service is a continuous-batching server: a step decodes one token for every running
request (plus chunked prefill of newly admitted prompts); its KV pool grows in chunks on
demand up to the service's limit and only while the GPU has free memory, and shrinks when
unused. What a service does when it cannot grow is its shortage policy: shed, queue, refuse.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from enum import StrEnum

from pilot.workload import ModelProfile, Request, ServiceSpec, Timeline, arrivals


class Sharing(StrEnum):
    DEDICATED = "dedicated"  # one whole GPU per service
    SM_SHARING = "sm-sharing"  # MPS: both services' kernels run concurrently
    TIME_SLICING = "time-slicing"  # the GPU alternates between the services' contexts


class Policy(StrEnum):
    SHED = "shed"  # cut the batch to what fits, give memory back, reject excess queue
    QUEUE = "queue"  # wait until memory frees
    REFUSE = "refuse"  # answer the request that does not fit with an error at once


class FaultKind(StrEnum):
    APPLICATION = "application"  # the culprit's own error; MPS spreads it to every client
    GPU_RESET = "gpu-reset"  # the GPU needs a reset: everything on it goes down


class Shortage(StrEnum):
    CEILING = "ceiling"  # the service's own limit is reached
    CONTENTION = "contention"  # under its limit, but the GPU is full (the other tenant holds it)


@dataclass(frozen=True)
class ComputeModel:
    """Speed of one service's step, relative to running alone, while the other is also busy."""

    mps_share: float = 0.65
    time_slice_share: float = 0.47

    def share(self, sharing: Sharing, other_busy: bool) -> float:
        if sharing is Sharing.DEDICATED or not other_busy:
            return 1.0
        return self.mps_share if sharing is Sharing.SM_SHARING else self.time_slice_share


@dataclass(frozen=True)
class RecoveryModel:
    gpu_reset_s: float = 120.0  # a reset-class Xid: drain and reset the GPU
    mps_server_recover_s: float = 1.0  # MPS server back to ACTIVE once its clients exited
    backoff_first_s: float = 10.0  # kubelet's container restart back-off, doubling
    backoff_max_s: float = 300.0
    quiet_period_s: float = 30.0  # the plugin's health quiet period (from its config)


@dataclass(frozen=True)
class Tenant:
    spec: ServiceSpec
    request_mib: int  # guaranteed memory (the reservation)
    limit_mib: int  # ceiling
    gpu: int  # which simulated GPU it runs on


@dataclass(frozen=True)
class Fault:
    at_s: float
    xid: int
    kind: FaultKind
    culprit: int  # index of the tenant whose process or GPU raises it


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    sharing: Sharing
    policy: Policy
    tenants: tuple[Tenant, ...]
    gpu_usable_mib: tuple[int, ...]  # per simulated GPU, after the plugin's reserve
    gpu_total_mib: int
    timeline: Timeline
    fault: Fault | None = None
    stress: float = 1.0  # multiplier on the stress-window arrival rate
    note: str = ""


@dataclass
class ServiceResult:
    name: str
    request_mib: int
    limit_mib: int
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (arrival, latency)
    errors: Counter[str] = field(default_factory=Counter)  # refused, shed, fault, unavailable
    error_times: list[tuple[float, str]] = field(default_factory=list)
    shortages: Counter[str] = field(default_factory=Counter)  # requests hit, by Shortage
    guarantee_violations: int = 0  # shortages while still under its own reservation
    memory: list[tuple[float, int]] = field(default_factory=list)  # (time, MiB held)
    busy: list[tuple[float, float]] = field(default_factory=list)  # step intervals
    tokens: int = 0
    down_at: float | None = None
    recovered_at: float | None = None

    @property
    def alloc_failures(self) -> int:
        return sum(self.shortages.values())

    @property
    def served(self) -> int:
        return len(self.latencies)


@dataclass
class ScenarioResult:
    scenario: Scenario
    services: list[ServiceResult]
    replan_at: float | None = None  # when the plugin advertises the faulted GPU again


class Gpu:
    """One GPU's memory, as the tenants see it: what is free is what nobody holds."""

    def __init__(self, usable_mib: int) -> None:
        self.usable_mib = usable_mib
        self.held: dict[int, float] = {}

    def free(self) -> float:
        return self.usable_mib - sum(self.held.values())


class Service:
    """One continuous-batching server on one GPU, under one shortage policy."""

    def __init__(self, sim: Simulation, index: int, tenant: Tenant) -> None:
        self.sim = sim
        self.index = index
        self.tenant = tenant
        self.model: ModelProfile = tenant.spec.model
        self.gpu = sim.gpus[tenant.gpu]
        self.result = ServiceResult(tenant.spec.name, tenant.request_mib, tenant.limit_mib)
        self.queue: deque[Request] = deque()
        self.running: list[tuple[int, int, Request]] = []  # heap of (finish step, rid, req)
        self.started: dict[int, float] = {}
        self.step = 0
        self.kv_used = 0.0
        self.pool = 0.0
        self.busy = False
        self.up = True
        self.generation = 0  # bumps on a crash, so events of the dead process are ignored
        self.cap = self.model.max_batch
        self.excess_since: float | None = None
        self.retry_pending = False
        self.hit: set[int] = set()  # requests that met a shortage at least once
        self._hold(self.model.base_mib)

    # -- memory -------------------------------------------------------------------------
    @property
    def held(self) -> float:
        return self.gpu.held.get(self.index, 0.0)

    def _hold(self, mib: float) -> None:
        self.gpu.held[self.index] = mib

    def _reserve(self, kv: float) -> Shortage | None:
        need = self.kv_used + kv - self.pool
        if need > 0:
            chunk = self.model.chunk_mib
            grow: float = math.ceil(need / chunk) * chunk
            room = self.tenant.limit_mib - self.held
            if room < need:
                return Shortage.CEILING
            grow = min(grow, room)
            if self.gpu.free() < need:
                return Shortage.CONTENTION
            grow = min(grow, self.gpu.free())
            self.pool += grow
            self._hold(self.held + grow)
        self.kv_used += kv
        return None

    def _trim(self, now: float, keep_chunks: int) -> None:
        chunk = self.model.chunk_mib
        target = math.ceil(self.kv_used / chunk + keep_chunks) * chunk
        if self.pool > target:
            self._hold(self.held - (self.pool - target))
            self.pool = target
        self.excess_since = None

    def _maybe_release(self, now: float) -> None:
        if self.pool - self.kv_used <= 2 * self.model.chunk_mib:
            self.excess_since = None
        elif self.excess_since is None:
            self.excess_since = now
        elif now - self.excess_since >= self.model.release_after_s:
            self._trim(now, keep_chunks=1)

    # -- requests -----------------------------------------------------------------------
    def arrive(self, now: float, req: Request) -> None:
        if not self.up:
            self._fail(now, req, "unavailable")
            return
        shedding = self.sim.scenario.policy is Policy.SHED and self.cap < self.model.max_batch
        if shedding and len(self.queue) >= self.cap:
            # load shedding: while capacity is cut, answer at once rather than queue long
            self._fail(now, req, "shed")
            return
        self.queue.append(req)
        if not self.busy:
            self._start_step(now)

    def _fail(self, now: float, req: Request, why: str) -> None:
        self.result.errors[why] += 1
        self.result.error_times.append((now, why))

    def _shortage(self, now: float, req: Request, why: Shortage) -> bool:
        """Apply the policy to the head request; True when admission should go on."""
        if req.rid not in self.hit:
            self.hit.add(req.rid)
            self.result.shortages[why] += 1
            if why is Shortage.CONTENTION and self.held < self.tenant.request_mib:
                self.result.guarantee_violations += 1
        policy = self.sim.scenario.policy
        if policy is Policy.REFUSE:
            self.queue.popleft()
            self._fail(now, req, "refused")
            return True
        if policy is Policy.SHED:
            # multiplicative decrease: run only what fits, give the rest back to the GPU
            self.cap = max(1, len(self.running))
            self._trim(now, keep_chunks=0)
            while len(self.queue) > self.cap:
                self._fail(now, self.queue.pop(), "shed")
        return False

    def _admit(self, now: float) -> int:
        budget = self.model.max_prefill_tokens
        prefill = 0
        while self.queue and len(self.running) < self.cap and prefill < budget:
            req = self.queue[0]
            why = self._reserve(req.kv_mib(self.model))
            if why is not None:
                if self._shortage(now, req, why):
                    continue
                return prefill
            self.queue.popleft()
            prefill += req.prompt
            self.started[req.rid] = now
            heapq.heappush(self.running, (self.step + req.output, req.rid, req))
        return prefill

    # -- steps --------------------------------------------------------------------------
    def _start_step(self, now: float) -> None:
        if not self.up or self.busy:
            return
        prefill = self._admit(now)
        if not self.running:
            if self.queue and not self.retry_pending:
                self.retry_pending = True
                self.sim.schedule(now + 0.05, "retry", self.index, self.generation)
            return
        m = self.model
        share = self.sim.share(self)
        dt = (
            m.step_base_s + m.step_per_seq_s * len(self.running) + m.prefill_per_token_s * prefill
        ) / share
        self.busy = True
        self.result.busy.append((now, now + dt))
        self.sim.schedule(now + dt, "step", self.index, self.generation)

    def step_end(self, now: float) -> None:
        self.busy = False
        self.step += 1
        self.result.tokens += len(self.running)
        while self.running and self.running[0][0] <= self.step:
            _, rid, req = heapq.heappop(self.running)
            self.kv_used -= req.kv_mib(self.model)
            self.result.latencies.append((req.arrival, now - req.arrival))
            del self.started[rid]
            if self.cap < self.model.max_batch:
                self.cap += 1  # additive increase: one more slot per finished request
        if not self.running:
            self.kv_used = 0.0  # drop float drift
        self._maybe_release(now)
        self._start_step(now)

    def retry(self, now: float) -> None:
        self.retry_pending = False
        if not self.busy:
            self._start_step(now)

    # -- faults -------------------------------------------------------------------------
    def crash(self, now: float) -> None:
        for _, _, req in self.running:
            self._fail(now, req, "fault")
        for req in self.queue:
            self._fail(now, req, "fault")
        self.running.clear()
        self.queue.clear()
        self.started.clear()
        self.kv_used = self.pool = 0.0
        self.gpu.held.pop(self.index, None)
        self.up = False
        self.busy = False
        self.retry_pending = False
        self.generation += 1
        self.result.down_at = now

    def restore(self, now: float) -> None:
        self.up = True
        self.cap = self.model.max_batch
        self._hold(self.model.base_mib)
        self.result.recovered_at = now


class Simulation:
    def __init__(
        self, scenario: Scenario, seed: int, compute: ComputeModel, recovery: RecoveryModel
    ) -> None:
        self.scenario = scenario
        self.compute = compute
        self.recovery = recovery
        self.gpus = [Gpu(mib) for mib in scenario.gpu_usable_mib]
        self.events: list[tuple[float, int, str, int, int]] = []
        self.seq = 0
        self.services = [Service(self, i, t) for i, t in enumerate(scenario.tenants)]
        self.replan_at: float | None = None
        self.seed = seed

    def schedule(self, at: float, kind: str, index: int, generation: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, index, generation))

    def share(self, svc: Service) -> float:
        other_busy = any(
            o.busy for o in self.services if o is not svc and o.tenant.gpu == svc.tenant.gpu
        )
        return self.compute.share(self.scenario.sharing, other_busy)

    def run(self) -> ScenarioResult:
        sc = self.scenario
        feeds = [
            arrivals(t.spec.traffic, sc.timeline, self.seed * 1000 + i, sc.stress)
            for i, t in enumerate(sc.tenants)
        ]
        for i, feed in enumerate(feeds):
            if feed:
                self.schedule(feed[0].arrival, "arrive", i, 0)
        cursor = [0] * len(feeds)
        sample_every = 0.5
        self.schedule(0.0, "sample", -1, 0)
        if sc.fault is not None:
            self.schedule(sc.fault.at_s, "fault", sc.fault.culprit, 0)
        while self.events:
            now, _, kind, index, generation = heapq.heappop(self.events)
            if now > sc.timeline.horizon_s:
                break
            if kind == "arrive":
                svc, feed = self.services[index], feeds[index]
                svc.arrive(now, feed[cursor[index]])
                cursor[index] += 1
                if cursor[index] < len(feed):
                    self.schedule(feed[cursor[index]].arrival, "arrive", index, 0)
            elif kind == "sample":
                for svc in self.services:
                    svc.result.memory.append((now, round(svc.held)))
                self.schedule(now + sample_every, "sample", -1, 0)
            elif kind == "fault" and sc.fault is not None:
                self._fault(now, sc.fault)
            elif kind == "restore":
                self.services[index].restore(now)
            elif generation == self.services[index].generation:
                if kind == "step":
                    self.services[index].step_end(now)
                elif kind == "retry":
                    self.services[index].retry(now)
        return ScenarioResult(sc, [s.result for s in self.services], self.replan_at)

    def _fault(self, now: float, fault: Fault) -> None:
        sc = self.scenario
        gpu = sc.tenants[fault.culprit].gpu
        rec = self.recovery
        if fault.kind is FaultKind.GPU_RESET:
            hit = [s for s in self.services if s.tenant.gpu == gpu]
            gpu_back = now + rec.gpu_reset_s
            self.replan_at = gpu_back + rec.quiet_period_s
        elif sc.sharing is Sharing.SM_SHARING:
            # the MPS server faults and poisons every client on the GPU (DESIGN section 5)
            hit = [s for s in self.services if s.tenant.gpu == gpu]
            gpu_back = now + rec.mps_server_recover_s
            self.replan_at = gpu_back
        else:
            hit = [self.services[fault.culprit]]
            gpu_back = now
        for svc in hit:
            svc.crash(now)
            restart = self._first_restart_after(now, gpu_back)
            load = svc.model.weights_mib / svc.model.load_mib_per_s
            self.schedule(restart + load, "restore", svc.index, 0)

    def _first_restart_after(self, crashed: float, ready: float) -> float:
        """The kubelet restarts a crashed container after a doubling back-off; attempts made
        while the GPU is still down fail at once and only lengthen the next wait."""
        rec = self.recovery
        t, wait = crashed, rec.backoff_first_s
        while True:
            t += wait
            if t >= ready:
                return t
            wait = min(wait * 2, rec.backoff_max_s)


def simulate(
    scenario: Scenario,
    seed: int,
    compute: ComputeModel | None = None,
    recovery: RecoveryModel | None = None,
) -> ScenarioResult:
    return Simulation(scenario, seed, compute or ComputeModel(), recovery or RecoveryModel()).run()
