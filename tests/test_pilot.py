"""The pilot (hack/pilot): caps from the plugin, the simulation's behaviour, the report."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "hack"))

from pilot import caps, metrics, report, scenarios
from pilot.sim import FaultKind, Policy, Sharing, simulate
from pilot.workload import Timeline

from deviceplugin.model import MIB, Mode
from deviceplugin.plan import build_plan

# A quarter of the default timeline: 30 s steady, 30 s stress, steady to 150 s.
SHORT = Timeline().scaled(0.25)
# Long enough after the fault for a reset-class recovery (GPU reset plus restart back-off).
FAULTS = Timeline(stress_start_s=30, stress_end_s=60, fault_s=70, horizon_s=260)
SEED = 3


def _run(name: str, sharing: Sharing, policy: Policy, **kw: object) -> metrics.ScenarioFigures:
    arr = scenarios.arrangement(sharing)
    sc = scenarios.build(name, name, arr, policy, SHORT, **kw)  # type: ignore[arg-type]
    return metrics.scenario_figures(simulate(sc, SEED))


@pytest.fixture(scope="module")
def figs() -> dict[str, metrics.ScenarioFigures]:
    return {
        "dedicated": _run("dedicated", Sharing.DEDICATED, Policy.QUEUE),
        "queue": _run("queue", Sharing.SM_SHARING, Policy.QUEUE),
        "refuse": _run("refuse", Sharing.SM_SHARING, Policy.REFUSE),
        "shed": _run("shed", Sharing.SM_SHARING, Policy.SHED),
    }


def test_caps_come_from_the_plugin_config_and_plan() -> None:
    cfg = caps.plugin_config_for(Mode.SM_SHARING, "allow-overcommit")
    plan = build_plan(caps.simulated_inventory(), cfg)
    pod = scenarios.pod("p", str(cfg.resource_names.sm_sharing), 24, "40Gi")
    got = caps.caps_for_pod(pod, plan, cfg)
    gpu = plan.for_resource(cfg.resource_names.sm_sharing)[0]
    assert got.request_mib == 24 * cfg.slice_size // MIB
    assert got.limit_mib == 40 * 1024
    assert got.gpu_usable_mib == (gpu.gpu.memory_total - cfg.reserved_memory) // MIB
    assert got.enforcement == ("mps-pinned-limit",)


def test_ceiling_rules_follow_the_plugin_policy() -> None:
    inv = caps.simulated_inventory()
    strict = caps.plugin_config_for(Mode.SM_SHARING)  # reclaimable-only, MPS protocol 2
    plan = build_plan(inv, strict)
    pod = scenarios.pod("p", str(strict.resource_names.sm_sharing), 8, "16Gi")
    ignored = caps.caps_for_pod(pod, plan, strict)
    assert ignored.limit_mib == ignored.request_mib
    assert "no-reclaim" in ignored.ceiling_note
    loose = caps.plugin_config_for(Mode.SM_SHARING, "allow-overcommit")
    huge = scenarios.pod("p", str(loose.resource_names.sm_sharing), 8, "1Ti")
    clamped = caps.caps_for_pod(huge, build_plan(inv, loose), loose)
    assert clamped.limit_mib == clamped.gpu_usable_mib  # never above what the GPU offers
    with pytest.raises(caps.PodSpecError):
        caps.caps_for_pod(scenarios.pod("p", "example.com/other", 1, None), plan, strict)


def test_dedicated_has_no_failures(figs: dict[str, metrics.ScenarioFigures]) -> None:
    ded = figs["dedicated"]
    assert ded.gpus == 2
    assert all(s.errors == 0 and s.alloc_failures == 0 for s in ded.services)
    assert all(s.served > 0 for s in ded.services)


def test_refuse_fails_requests_under_contention(figs: dict[str, metrics.ScenarioFigures]) -> None:
    refuse = figs["refuse"]
    assert sum(s.error_kinds.get("refused", 0) for s in refuse.services) > 0
    assert sum(s.contention for s in refuse.services) > 0


def test_queue_never_fails_but_waits(figs: dict[str, metrics.ScenarioFigures]) -> None:
    queue, ded = figs["queue"], figs["dedicated"]
    assert all(s.errors == 0 for s in queue.services)
    assert sum(s.alloc_failures for s in queue.services) > 0
    for q, d in zip(queue.services, ded.services, strict=True):
        assert q.p99_stress > d.p99_stress


def test_shed_rejects_only_while_cut_back(figs: dict[str, metrics.ScenarioFigures]) -> None:
    shed = figs["shed"]
    assert set().union(*(s.error_kinds for s in shed.services)) <= {"shed"}
    assert sum(s.error_kinds.get("shed", 0) for s in shed.services) > 0


def test_sharing_uses_memory_better(figs: dict[str, metrics.ScenarioFigures]) -> None:
    assert figs["queue"].memory_utilisation > figs["dedicated"].memory_utilisation
    assert figs["queue"].compute_utilisation > figs["dedicated"].compute_utilisation


def test_memory_never_exceeds_limits_or_the_gpu() -> None:
    arr = scenarios.arrangement(Sharing.SM_SHARING)
    sc = scenarios.build("q", "q", arr, Policy.QUEUE, SHORT)
    res = simulate(sc, SEED)
    usable = sc.gpu_usable_mib[0]
    for tenant, svc in zip(sc.tenants, res.services, strict=True):
        assert max(m for _, m in svc.memory) <= tenant.limit_mib
    totals = [sum(x) for x in zip(*([m for _, m in s.memory] for s in res.services), strict=True)]
    assert max(totals) <= usable


def test_same_seed_same_result_other_seed_differs() -> None:
    arr = scenarios.arrangement(Sharing.SM_SHARING)
    sc = scenarios.build("q", "q", arr, Policy.QUEUE, SHORT)
    a, b, c = simulate(sc, 11), simulate(sc, 11), simulate(sc, 12)
    assert a.services[0].latencies == b.services[0].latencies
    assert a.services[0].latencies != c.services[0].latencies


@pytest.mark.parametrize(
    ("sharing", "xid", "kind", "down"),
    [
        (Sharing.SM_SHARING, 31, FaultKind.APPLICATION, {"chat", "rag"}),
        (Sharing.TIME_SLICING, 31, FaultKind.APPLICATION, {"chat"}),
        (Sharing.SM_SHARING, 79, FaultKind.GPU_RESET, {"chat", "rag"}),
        (Sharing.DEDICATED, 79, FaultKind.GPU_RESET, {"chat"}),
    ],
)
def test_fault_domains_follow_design(
    sharing: Sharing, xid: int, kind: FaultKind, down: set[str]
) -> None:
    arr = scenarios.arrangement(sharing)
    assert scenarios.classify_xid(xid, arr.config) is kind
    sc = scenarios.build("f", "f", arr, Policy.QUEUE, FAULTS, xid=xid)
    fig = metrics.scenario_figures(simulate(sc, SEED))
    assert {s.name for s in fig.services if s.recovery_s is not None} == down
    for s in fig.services:
        if s.name in down:
            assert s.recovery_s is not None and s.recovery_s > 0
            assert s.error_kinds.get("unavailable", 0) + s.error_kinds.get("fault", 0) > 0
        else:
            assert "fault" not in s.error_kinds and "unavailable" not in s.error_kinds


def test_reset_class_recovers_slower_than_application_fault() -> None:
    arr = scenarios.arrangement(Sharing.SM_SHARING)
    slow = simulate(scenarios.build("a", "a", arr, Policy.QUEUE, FAULTS, xid=79), SEED)
    fast = simulate(scenarios.build("b", "b", arr, Policy.QUEUE, FAULTS, xid=31), SEED)
    rec_slow = metrics.service_figures(slow.services[0], (0, 0)).recovery_s
    rec_fast = metrics.service_figures(fast.services[0], (0, 0)).recovery_s
    assert rec_slow is not None and rec_fast is not None and rec_slow > rec_fast


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert metrics.percentile(values, 50) == 50.0
    assert metrics.percentile(values, 99) == 99.0
    assert metrics.percentile([], 99) != metrics.percentile([], 99)  # NaN


def test_report_and_plots_are_written(tmp_path: Path) -> None:
    run = scenarios.run_pilot(seed=SEED, timeline=SHORT, sweep=(0.5, 1.0))
    written = report.write_report(run, tmp_path, "test")
    assert {p.name for p in written} == {"report.md", *report.PLOTS}
    for png in report.PLOTS:
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (tmp_path / "report.md").read_text()
    for res in (*run.contention, *run.faults):
        assert f"### {res.scenario.title}" in text
    assert "**Verdict.**" in text
    assert "## What is modelled" in text
    for png in report.PLOTS:
        assert f"({png})" in text


def test_hardware_setup_uses_the_plugins_grants_and_daemon(tmp_path: Path) -> None:
    """gpu.sh's setup on the simulated NVML and MPS control binary: the plugin's own
    Allocate answers, its MPS daemon started and then quit, no compute mode touched."""
    from pilot import hw

    from deviceplugin.simulate.mps_control import write_launcher
    from deviceplugin.simulate.nvml import FakeNvml
    from deviceplugin.simulate.specs import load_spec

    FakeNvml(load_spec("h200x2")).install()
    control = str(write_launcher(tmp_path / "mps-control"))
    # short: the MPS socket path under the root has a 107-byte limit
    root = Path(tempfile.mkdtemp(prefix="pilot-"))
    assert hw.setup(0, root, tmp_path / "grants.json", control) == 0
    try:
        grants = json.loads((tmp_path / "grants.json").read_text())
        for svc in ("chat", "rag"):
            g = grants[svc]
            assert g["envs"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={g['limit_mib']}M"
            assert Path(g["envs"]["CUDA_MPS_PIPE_DIRECTORY"]).is_dir()
            assert "CUDA_VISIBLE_DEVICES" not in g["envs"]
            assert g["request_mib"] < g["limit_mib"]
        assert grants["dedicated"]["envs"]["CUDA_VISIBLE_DEVICES"] == grants["uuid"]
        assert list(root.glob("*/pipe/nvidia-cuda-mps-control.pid"))  # the daemon runs on
    finally:
        assert hw.teardown(root, control) == 0
        pid_files = list(root.glob("*/pipe/nvidia-cuda-mps-control.pid"))
        shutil.rmtree(root, ignore_errors=True)
    assert not pid_files  # the daemon quit and took its pid file with it
