"""What the pilot's two services are and what traffic they see: every modelling constant.

The numbers are stated assumptions for a 7B-parameter fp16 model with multi-head attention on
an H200 (order of magnitude, not a benchmark); the report prints them. Arrivals are generated
once per service from a seeded RNG, so every scenario replays exactly the same requests.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelProfile:
    """One inference server: its fixed memory, KV-cache cost and step timing."""

    weights_mib: int  # model weights, loaded at start
    runtime_mib: int  # CUDA context, activations, allocator slack
    kv_mib_per_token: float  # 2 x layers x heads x head_dim x 2 bytes
    step_base_s: float  # one decode step at batch 1 (reading the weights once)
    step_per_seq_s: float  # extra per running sequence (reading its KV cache)
    prefill_per_token_s: float  # prompt processing
    max_prefill_tokens: int  # chunked prefill: prompt tokens admitted per step
    max_batch: int
    chunk_mib: int  # the KV pool grows and shrinks in chunks of this size
    release_after_s: float  # an unused chunk is given back after this long
    load_mib_per_s: float  # weight loading speed after a restart

    @property
    def base_mib(self) -> int:
        return self.weights_mib + self.runtime_mib

    @property
    def peak_tokens_per_s(self) -> float:
        """Decode throughput of one whole GPU at full batch: the compute-utilisation yardstick."""
        return self.max_batch / (self.step_base_s + self.step_per_seq_s * self.max_batch)


@dataclass(frozen=True)
class Traffic:
    """Poisson arrivals; prompt and output lengths log-normal around their medians."""

    base_rate: float  # requests per second outside the stress window
    stress_rate: float  # requests per second inside it
    prompt_median: int
    prompt_sigma: float
    output_median: int
    output_sigma: float
    max_prompt: int
    max_output: int


@dataclass(frozen=True)
class Timeline:
    """Steady load, then the stress window in which both services peak at once, then steady."""

    stress_start_s: float = 120.0
    stress_end_s: float = 240.0
    fault_s: float = 420.0  # fault scenarios inject their Xid here, once the stress drained
    horizon_s: float = 600.0

    def in_stress(self, t: float) -> bool:
        return self.stress_start_s <= t < self.stress_end_s

    def scaled(self, factor: float) -> Timeline:
        return Timeline(
            self.stress_start_s * factor,
            self.stress_end_s * factor,
            self.fault_s * factor,
            self.horizon_s * factor,
        )


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    model: ModelProfile
    traffic: Traffic
    latency_budget_s: float  # the service's p99 target, used by the verdict


@dataclass(frozen=True)
class Request:
    rid: int
    arrival: float
    prompt: int
    output: int

    def kv_mib(self, profile: ModelProfile) -> float:
        # KV reserved for the whole sequence at admission (no preemption modelled)
        return (self.prompt + self.output) * profile.kv_mib_per_token


MODEL_7B = ModelProfile(
    weights_mib=13_000,
    runtime_mib=2_000,
    kv_mib_per_token=0.5,
    step_base_s=0.008,
    step_per_seq_s=0.00006,
    prefill_per_token_s=0.000015,
    max_prefill_tokens=8192,
    max_batch=128,
    chunk_mib=1024,
    release_after_s=5.0,
    load_mib_per_s=2048.0,
)

# Two services with different traffic shapes: a chat service and a retrieval-augmented one
# with long prompts. Their stress rates make both ask for memory above their reservation at once.
CHAT = ServiceSpec(
    name="chat",
    model=MODEL_7B,
    traffic=Traffic(
        base_rate=2.0,
        stress_rate=8.0,
        prompt_median=1200,
        prompt_sigma=0.6,
        output_median=350,
        output_sigma=0.5,
        max_prompt=8000,
        max_output=2048,
    ),
    latency_budget_s=20.0,
)
RAG = ServiceSpec(
    name="rag",
    model=MODEL_7B,
    traffic=Traffic(
        base_rate=1.5,
        stress_rate=5.0,
        prompt_median=3000,
        prompt_sigma=0.5,
        output_median=300,
        output_sigma=0.5,
        max_prompt=12000,
        max_output=2048,
    ),
    latency_budget_s=20.0,
)


def _lognormal_int(rng: random.Random, median: int, sigma: float, cap: int) -> int:
    return max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma))))


def arrivals(traffic: Traffic, timeline: Timeline, seed: int, stress: float = 1.0) -> list[Request]:
    """Piecewise-Poisson arrivals over the timeline; `stress` scales the stress-window rate."""
    rng = random.Random(seed)
    out: list[Request] = []
    t = 0.0
    peak = max(traffic.base_rate, traffic.stress_rate * stress)
    while True:
        # thinning: draw at the peak rate, keep with probability rate(t) / peak
        t += rng.expovariate(peak)
        if t >= timeline.horizon_s:
            return out
        rate = traffic.stress_rate * stress if timeline.in_stress(t) else traffic.base_rate
        keep = rng.random() < rate / peak
        prompt = _lognormal_int(
            rng, traffic.prompt_median, traffic.prompt_sigma, traffic.max_prompt
        )
        output = _lognormal_int(
            rng, traffic.output_median, traffic.output_sigma, traffic.max_output
        )
        if keep:
            out.append(Request(len(out), t, prompt, output))
