"""One pilot service on a real GPU: PyTorch, KV-cache-like memory, a shortage policy.

Sets the plugin's grant variables before CUDA starts, then serves seeded Poisson arrivals for
`--seconds` (the middle 50 % is the stress window at `--stress`× the rate): every step runs
one fp16 matmul per running request and each request holds a KV block until it finishes.
A failed allocation (the MPS pinned limit, or the other tenant holding the memory) goes to
the policy. Writes JSON: latencies, errors, allocation failures, reserved memory samples.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--grants", type=Path, required=True)
    p.add_argument("--grant", required=True, help="key in the grants file: a service or dedicated")
    p.add_argument("--service", required=True)
    p.add_argument("--policy", choices=("queue", "refuse", "shed"), default="queue")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--rate", type=float, default=20.0)
    p.add_argument("--stress", type=float, default=4.0)
    p.add_argument("--kv-mib", type=float, default=900.0)
    p.add_argument("--weights-mib", type=int, default=13_000)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    grants = json.loads(args.grants.read_text())
    grant = grants[args.grant]
    os.environ.update(grant["envs"])  # before CUDA initialises: MPS pipe dir, pinned limit
    import torch  # deferred: the variables above must be in place first

    dev = torch.device("cuda:0")
    weights = torch.empty(args.weights_mib * 2**20, dtype=torch.uint8, device=dev)
    w = torch.randn(4096, 4096, dtype=torch.float16, device=dev)
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    lo, hi = args.seconds * 0.25, args.seconds * 0.75
    queue: collections.deque[tuple[int, float, int]] = collections.deque()
    running: list[tuple[float, int, Any]] = []  # (arrival, tokens left, kv block)
    latencies: list[float] = []
    errors: collections.Counter[str] = collections.Counter()
    failures = 0
    reserved: list[int] = []
    next_arrival = 0.0
    arrived_count = 0
    cap = 256
    while (now := time.monotonic() - t0) < args.seconds:
        while next_arrival <= now:  # Poisson arrivals, faster in the stress window
            rate = args.rate * (args.stress if lo <= next_arrival < hi else 1.0)
            queue.append((arrived_count, t0 + next_arrival, rng.randint(50, 400)))
            arrived_count += 1
            next_arrival += rng.expovariate(rate)
        while queue and len(running) < cap:
            _, arrived, tokens = queue[0]
            try:
                kv = torch.empty(int(args.kv_mib * 2**20), dtype=torch.uint8, device=dev)
            except torch.cuda.OutOfMemoryError:
                failures += 1
                if args.policy == "refuse":
                    queue.popleft()
                    errors["refused"] += 1
                    continue
                if args.policy == "shed":
                    cap = max(1, len(running))
                    torch.cuda.empty_cache()
                    while len(queue) > cap:
                        queue.pop()
                        errors["shed"] += 1
                break
            queue.popleft()
            running.append((arrived, tokens, kv))
        if running:
            x = torch.randn(len(running), 4096, dtype=torch.float16, device=dev)
            (x @ w).sum().item()  # one decode-like step, synchronised
        else:
            time.sleep(0.002)
        done = time.monotonic()
        still = []
        for arrived, tokens, kv in running:
            if tokens <= 1:
                latencies.append(done - arrived)
                del kv
                cap = min(256, cap + 1)
            else:
                still.append((arrived, tokens - 1, kv))
        running = still
        if len(reserved) < (done - t0) * 2:
            reserved.append(torch.cuda.memory_reserved() // 2**20)
            if not running and not queue:
                torch.cuda.empty_cache()
    del weights
    result = {
        "service": args.service,
        "policy": args.policy,
        "request_mib": grant.get("request_mib"),
        "limit_mib": grant.get("limit_mib"),
        "latencies": latencies,
        "errors": dict(errors),
        "alloc_failures": failures,
        "unfinished": len(queue) + len(running),
        "reserved_mib": reserved,
    }
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
