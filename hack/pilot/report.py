"""Writes the pilot's `report.md` and its PNG plots from a `PilotRun`.

Every number in the report is computed from the run (nothing typed in by hand), so the report
and the plots regenerate identically for the same seed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a display
import matplotlib.pyplot as plt

from pilot.metrics import (
    ScenarioFigures,
    percentile,
    scenario_figures,
    within_budget,
)
from pilot.scenarios import CEILING, SERVICES, SLICES, PilotRun
from pilot.sim import ScenarioResult

PLOTS = ("memory.png", "latency.png", "failures.png", "faults.png", "sweep.png")
GIB = 1024.0


def _s(x: float) -> str:
    return "–" if math.isnan(x) else f"{x:.1f}"


def _gib(mib: float) -> str:
    return f"{mib / GIB:.1f}"


# -- plots ------------------------------------------------------------------------------------
def _memory_plot(results: Sequence[ScenarioResult], path: Path, title: str) -> None:
    fig, axes = plt.subplots(len(results), 1, figsize=(9, 2.3 * len(results)), sharex=True)
    for ax, res in zip(axes, results, strict=True):
        sc = res.scenario
        for svc in res.services:
            ax.plot([t for t, _ in svc.memory], [m / GIB for _, m in svc.memory], label=svc.name)
        t0 = sc.tenants[0]
        ax.axhline(t0.request_mib / GIB, color="grey", ls=":", lw=1, label="request")
        if t0.limit_mib != t0.request_mib:
            ax.axhline(t0.limit_mib / GIB, color="grey", ls="--", lw=1, label="limit")
        ax.axvspan(sc.timeline.stress_start_s, sc.timeline.stress_end_s, color="orange", alpha=0.1)
        if sc.fault is not None:
            ax.axvline(sc.fault.at_s, color="red", lw=1, label=f"Xid {sc.fault.xid}")
        ax.set_title(sc.title, fontsize=9)
        ax.set_ylabel("GiB held")
        ax.legend(fontsize=7, loc="upper right", ncol=5)
    axes[-1].set_xlabel("time (s); shaded: stress window")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _latency_plot(results: Sequence[ScenarioResult], path: Path, bin_s: float = 15.0) -> None:
    names = [s.name for s in results[0].services]
    fig, axes = plt.subplots(1, len(names), figsize=(11, 3.6), sharey=True)
    for i, (ax, name) in enumerate(zip(axes, names, strict=True)):
        for res in results:
            lat = res.services[i].latencies
            horizon = res.scenario.timeline.horizon_s
            xs, ys = [], []
            for b in range(int(horizon // bin_s)):
                window = [v for a, v in lat if b * bin_s <= a < (b + 1) * bin_s]
                if window:
                    xs.append((b + 0.5) * bin_s)
                    ys.append(percentile(window, 99))
            ax.plot(xs, ys, label=res.scenario.name)
        ax.axhline(SERVICES[i].latency_budget_s, color="black", ls="--", lw=1, label="budget")
        tl = results[0].scenario.timeline
        ax.axvspan(tl.stress_start_s, tl.stress_end_s, color="orange", alpha=0.1)
        ax.set_yscale("log")
        ax.set_title(f"{name}: p99 latency per {bin_s:.0f} s of arrivals", fontsize=9)
        ax.set_xlabel("arrival time (s)")
    axes[0].set_ylabel("seconds (log)")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _failures_plot(figs: Sequence[ScenarioFigures], path: Path) -> None:
    kinds = sorted({k for f in figs for s in f.services for k in s.error_kinds} | {"refused"})
    fig, ax = plt.subplots(figsize=(11, 3.8))
    labels = [f.name for f in figs]
    bottom = [0.0] * len(figs)
    for kind in kinds:
        vals = [float(sum(s.error_kinds.get(kind, 0) for s in f.services)) for f in figs]
        ax.bar(labels, vals, bottom=bottom, label=f"errors: {kind}")
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.plot(
        labels,
        [sum(s.alloc_failures for s in f.services) for f in figs],
        "kx",
        label="requests that met a failed allocation",
    )
    ax.set_ylabel("requests")
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    ax.legend(fontsize=7)
    ax.set_title("Failed requests and allocation failures (both services)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _sweep_plot(run: PilotRun, path: Path, usable_gib: float) -> None:
    xs = [s for s, _, _ in run.sweep]
    ded = [scenario_figures(d) for _, d, _ in run.sweep]
    shr = [scenario_figures(m) for _, _, m in run.sweep]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.6))
    for label, figs in (("dedicated", ded), ("shared (MPS, queue)", shr)):
        a1.plot(xs, [max(s.p99_stress for s in f.services) for f in figs], "o-", label=label)
    a1.axhline(min(s.latency_budget_s for s in SERVICES), color="black", ls="--", lw=1)
    a1.set_xlabel("stress multiplier")
    a1.set_ylabel("worst p99 in stress window (s)")
    a1.set_yscale("log")
    a1.legend(fontsize=8)
    a2.plot(xs, [sum(s.peak_mib for s in f.services) / GIB for f in ded], "o-")
    a2.axhline(usable_gib, color="black", ls="--", lw=1, label="shared GPU usable")
    a2.set_xlabel("stress multiplier")
    a2.set_ylabel("combined peak memory, dedicated (GiB)")
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_plots(run: PilotRun, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    contention = list(run.contention)
    _memory_plot(
        [
            r
            for r in contention
            if r.scenario.name in ("dedicated", "shared-shed", "shared-queue", "shared-refuse")
        ],
        out / "memory.png",
        "Memory held per service",
    )
    _latency_plot(contention, out / "latency.png")
    _failures_plot(
        [scenario_figures(r) for r in (*run.contention, *run.faults)], out / "failures.png"
    )
    _memory_plot(list(run.faults), out / "faults.png", "Faults: memory held (zero while down)")
    _sweep_plot(run, out / "sweep.png", run.arrangements[1].caps[0].gpu_usable_mib / GIB)
    return [out / name for name in PLOTS]


# -- markdown ---------------------------------------------------------------------------------
def _service_table(f: ScenarioFigures) -> list[str]:
    rows = [
        "| service | request / limit GiB | served / offered | errors | alloc failures "
        "(contention / ceiling / under own reservation) | p50 / p99 outside stress s | "
        "p50 / p99 stress s | p99 all s | peak GiB | recovery s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in f.services:
        errors = ", ".join(f"{k} {v}" for k, v in s.error_kinds.items()) or "0"
        rec = "–" if s.recovery_s is None else f"{s.recovery_s:.1f}"
        rows.append(
            f"| {s.name} | {_gib(s.request_mib)} / {_gib(s.limit_mib)} | {s.served} / {s.offered} "
            f"| {errors} | {s.alloc_failures} ({s.contention} / {s.ceiling} / "
            f"{s.guarantee_violations}) | {_s(s.p50_steady)} / {_s(s.p99_steady)} | "
            f"{_s(s.p50_stress)} / {_s(s.p99_stress)} | {_s(s.p99_all)} | "
            f"{_gib(s.peak_mib)} | {rec} |"
        )
    return rows


def _summary_table(figs: Sequence[ScenarioFigures]) -> list[str]:
    rows = [
        "| scenario | GPUs | memory used | GPU busy | compute used | tokens/s | errors | "
        "alloc failures | worst p99 stress s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f in figs:
        rows.append(
            f"| {f.name} | {f.gpus} | {f.memory_utilisation:.0%} | {f.busy:.0%} | "
            f"{f.compute_utilisation:.0%} | {f.tokens_per_s:.0f} | "
            f"{sum(s.errors for s in f.services)} | {sum(s.alloc_failures for s in f.services)} | "
            f"{_s(max(s.p99_stress for s in f.services))} |"
        )
    return rows


def _caps_table(run: PilotRun) -> list[str]:
    rows = [
        "| arrangement | pod limits | ceiling annotation | request MiB | limit MiB | "
        "enforcement | ceiling | GPU usable MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    labels = ("dedicated", "shared, sm-sharing", "shared, time-slicing", "shared, plugin defaults")
    for label, arr in zip(labels, run.arrangements, strict=True):
        c = arr.caps[0]
        declared = "–" if arr.sharing == "dedicated" else CEILING
        rows.append(
            f"| {label} (`ceilings: {arr.config.ceilings}`) | `{c.resource}: {c.devices}` | "
            f"{declared} | {c.request_mib} | {c.limit_mib} | {', '.join(c.enforcement) or '–'} | "
            f"{c.ceiling_note} | {c.gpu_usable_mib} |"
        )
    return rows


def _verdict(run: PilotRun) -> list[str]:
    budgets = [s.latency_budget_s for s in SERVICES]
    budget = ", ".join(f"{s.name} {s.latency_budget_s:.0f} s" for s in SERVICES)
    usable = run.arrangements[1].caps[0].gpu_usable_mib
    lines = [f"Latency budget (p99): {budget}; a scenario wins only with no failed request.", ""]
    holds = []
    for stress, ded, shr in run.sweep:
        fd, fs = scenario_figures(ded), scenario_figures(shr)
        peak = sum(s.peak_mib for s in fd.services)
        ok = within_budget(fs, budgets, stress=True)
        holds.append((stress, ok, peak, fs))
        worst = max(s.p99_stress for s in fs.services)
        lines.append(
            f"- stress ×{stress:g}: combined peak demand (measured on dedicated GPUs) "
            f"{_gib(peak)} GiB = {peak / usable:.0%} of the shared GPU's usable memory; "
            f"shared worst p99 {_s(worst)} s, dedicated "
            f"{_s(max(s.p99_stress for s in fd.services))} s → "
            f"{'sharing holds the budget' if ok else 'sharing misses the budget'}"
        )
    wins = [h for h in holds if h[1]]
    lines.append("")
    if wins:
        top = max(wins, key=lambda h: h[0])
        lines.append(
            f"**Verdict.** Sharing one GPU between these two services, instead of one GPU each, "
            f"holds the budget up to stress ×{top[0]:g}, where their combined peak is "
            f"{top[2] / usable:.0%} of the shared GPU's usable memory, with half the GPUs."
        )
    else:
        lines.append("**Verdict.** Sharing misses the budget at every stress level tried.")
    misses = [h for h in holds if not h[1]]
    if misses:
        first = min(misses, key=lambda h: h[0])
        cause = (
            "the coincident peaks no longer fit in the GPU's usable memory, so allocations fail "
            "and requests wait"
            if first[2] > usable
            else "memory still fits, but both services computing at once under MPS "
            f"(each at {run.compute.mps_share:g} of solo speed) stretches latency past the budget"
        )
        lines.append(
            f"It stops holding at stress ×{first[0]:g} (combined peak {first[2] / usable:.0%} "
            f"of usable memory): {cause}. Beyond that point give each service its own GPU, or "
            "size the reservations to the coincident peak."
        )
    by_name = {r.scenario.name: scenario_figures(r) for r in run.contention}
    parts = []
    for name in ("shared-queue", "shared-shed", "shared-refuse"):
        f = by_name[name]
        parts.append(
            f"`{name.removeprefix('shared-')}` {sum(s.errors for s in f.services)} failed "
            f"requests, worst p99 {_s(max(s.p99_stress for s in f.services))} s"
        )
    lines.append(
        "At full simultaneous stress (×1) the policies trade latency for failures: "
        + "; ".join(parts)
        + ". No policy meets the budget there; dedicated GPUs do."
        if not within_budget(by_name["dedicated"], budgets, stress=True)
        or not any(
            within_budget(by_name[n], budgets, stress=True)
            for n in ("shared-queue", "shared-shed", "shared-refuse")
        )
        else "At full simultaneous stress (×1): " + "; ".join(parts) + "."
    )
    return lines


def _fault_rows(run: PilotRun) -> list[str]:
    rows = [
        "| scenario | Xid | class (plugin config) | services down | recovery s | "
        "failed requests | slices advertised again at s |",
        "|---|---|---|---|---|---|---|",
    ]
    for res in run.faults:
        f = scenario_figures(res)
        sc = res.scenario
        assert sc.fault is not None
        down = [s for s in f.services if s.recovery_s is not None]
        rec = ", ".join(f"{s.name} {s.recovery_s:.1f}" for s in down if s.recovery_s is not None)
        failed = sum(
            s.error_kinds.get("fault", 0) + s.error_kinds.get("unavailable", 0) for s in f.services
        )
        replan = "–" if f.replan_at is None else f"{f.replan_at:.0f}"
        rows.append(
            f"| {sc.title} | {sc.fault.xid} | {sc.fault.kind} | "
            f"{', '.join(s.name for s in down) or 'none'} | {rec or '–'} | {failed} | {replan} |"
        )
    return rows


def render(run: PilotRun, command: str) -> str:
    ded = run.arrangements[0]
    c = run.compute
    r = run.recovery
    m = SERVICES[0].model
    lines = [
        "# Pilot: two inference services on one GPU vs one GPU each (simulated)",
        "",
        f"Generated by `{command}` (seed {run.seed}); deterministic: the same seed gives the "
        "same report. A real-GPU run of the same experiment is `hack/pilot/gpu.sh` "
        "(report under `docs/hardware/`).",
        "",
        "## Setup",
        "",
        f"- GPU: simulated NVIDIA H200, {ded.caps[0].gpu_total_mib} MiB (preset `h200x2`). "
        f"Shared scenarios put both services on GPU 0; dedicated gives each its own GPU.",
        f"- Two services, each a 7B fp16 model ({m.weights_mib} MiB weights + {m.runtime_mib} MiB "
        f"runtime): `chat` and `rag` (long prompts). Each pod asks for `{SLICES}` slices and "
        f"declares a ceiling of `{CEILING}` with "
        "`nvidia.com/container.server.gpu-memory.limit`.",
        "- Caps come from the plugin itself: `deviceplugin.config.settings.parse` (defaults: 1 GiB "
        "slices, 1 GiB reserved per GPU; `mps.setComputeMode: false`), `plan.build_plan` on "
        "the simulated inventory, and the ceiling rule of DESIGN section 4:",
        "",
        *_caps_table(run),
        "",
        "- Timeline: steady load, a stress window in which both services' arrival rates jump at "
        "the same time (shaded in the plots), steady again; fault scenarios inject one Xid "
        f"at t = {run.contention[0].scenario.timeline.fault_s:.0f} s.",
        "",
        "## What is modelled (and what is not)",
        "",
        "- **Requests**: Poisson arrivals (seeded, identical in every scenario), log-normal "
        "prompt and output lengths.",
        f"- **Latency**: each service is a continuous-batching server. A step decodes one token "
        f"for every running request and prefills at most {m.max_prefill_tokens} prompt tokens; "
        f"step time = ({m.step_base_s * 1000:g} ms + {m.step_per_seq_s * 1000:g} ms × running "
        f"+ {m.prefill_per_token_s * 1e6:g} µs × prefill tokens) / compute share. Latency = "
        "queueing + prefill + decode, arrival to last token.",
        f"- **Memory**: KV cache of {m.kv_mib_per_token} MiB per token, reserved for the whole "
        f"sequence at admission; the KV pool grows in {m.chunk_mib} MiB chunks on demand up to "
        f"the limit, and gives unused chunks back after {m.release_after_s:g} s. Borrowing "
        "above the request succeeds only while the GPU has free memory: nobody reclaims "
        "borrowed memory (MPS protocol 2, `ceilings: allow-overcommit`), so a tenant can fail "
        "even under its own reservation (column *under own reservation*). Reclaim by MPS "
        "protocol 3 memory accounting is not modelled.",
        f"- **Compute share** when both services run a step at once: MPS {c.mps_share} of solo "
        f"speed each (kernels overlap; decode alone leaves the GPU partly idle), time-slicing "
        f"{c.time_slice_share} each (alternating contexts, with switch cost). Alone: 1.0. These "
        "are assumptions, not measurements.",
        "- **Shortage policies** when an allocation fails: `queue` waits for memory; `refuse` "
        "answers that request with an error; `shed` cuts its batch to what fits, gives free "
        "memory back, rejects arrivals while its queue is longer than its batch, and grows the "
        "batch back by one per finished request.",
        f"- **Faults** (classified by the plugin's Xid lists): a reset-class Xid takes the GPU "
        f"for {r.gpu_reset_s:g} s; an application Xid under MPS faults the server and every "
        f"client ({r.mps_server_recover_s:g} s to ACTIVE once they exit); under time-slicing "
        "or on a dedicated GPU only the culprit dies. Crashed containers restart on the "
        f"kubelet's back-off ({r.backoff_first_s:g} s doubling), then reload weights at "
        f"{m.load_mib_per_s:g} MiB/s. The plugin advertises the slices again after its quiet "
        f"period ({r.quiet_period_s:g} s). Requests to a service that is down fail.",
        "- **Utilisation**: *memory used* = mean memory held / total memory of the GPUs the "
        "arrangement occupies; *GPU busy* = share of time a kernel runs (what nvidia-smi "
        "shows; continuous batching keeps it near 100 % even at small batches); *compute used* "
        "= decode throughput / the throughput of the occupied GPUs at full batch.",
        "- Not modelled: preemption and recompute of running requests, prefix caching, "
        "rescheduling to another node, PCIe/NVLink, the MPS client limit, power and clocks.",
        "",
        "## Results under simultaneous stress",
        "",
        *_summary_table([scenario_figures(x) for x in run.contention]),
        "",
    ]
    for res in run.contention:
        f = scenario_figures(res)
        note = f" {res.scenario.note}" if res.scenario.note else ""
        lines += [f"### {f.title}{note}", "", *_service_table(f), ""]
    lines += [
        "![memory](memory.png)",
        "",
        "![latency](latency.png)",
        "",
        "![failures](failures.png)",
        "",
        "## Faults and recovery",
        "",
        *_fault_rows(run),
        "",
    ]
    for res in run.faults:
        f = scenario_figures(res)
        lines += [f"### {f.title}", "", *_service_table(f), ""]
    lines += [
        "![faults](faults.png)",
        "",
        "## When sharing wins",
        "",
        "The stress window's arrival rates scaled by a multiplier; dedicated vs shared (MPS, "
        "queue), same seed.",
        "",
        *_verdict(run),
        "",
        "![sweep](sweep.png)",
        "",
    ]
    return "\n".join(lines)


def write_report(run: PilotRun, out: Path, command: str) -> list[Path]:
    """Write report.md and the plots into `out`; returns the paths written."""
    plots = write_plots(run, out)
    report = out / "report.md"
    report.write_text(render(run, command))
    return [report, *plots]
