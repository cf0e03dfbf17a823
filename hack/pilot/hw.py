"""Real-GPU side of the pilot: the plugin's grants, its MPS daemon, and the hardware report.

`setup` reads the real GPU through the plugin's NVML inventory, plans it in sm-sharing with
`mps.setComputeMode: false`, starts the plugin's MPS daemon for it (MpsSupervisor) and writes
the plugin's own Allocate answers for the pilot's pods. `teardown` quits that daemon.
`report` turns the workers' JSON results into `docs/hardware/pilot-*.md`. Run by gpu.sh.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HACK = Path(__file__).resolve().parent.parent
if str(HACK) not in sys.path:
    sys.path.insert(0, str(HACK))

from deviceplugin.config import settings as plugin_config  # noqa: E402
from deviceplugin.dpapi.allocator import Grant  # noqa: E402
from deviceplugin.health.board import HealthBoard  # noqa: E402
from deviceplugin.inventory.gpus import Inventory, read_inventory  # noqa: E402
from deviceplugin.inventory.nvml import NvmlSession  # noqa: E402
from deviceplugin.model import GIB, MIB  # noqa: E402
from deviceplugin.mps.supervisor import MpsSupervisor  # noqa: E402
from deviceplugin.plan import build_plan  # noqa: E402
from pilot.caps import DeclaredCeiling, plugin_allocate  # noqa: E402
from pilot.metrics import percentile  # noqa: E402
from pilot.scenarios import CEILING, SERVICES, SLICES  # noqa: E402


def hw_config(
    index: int, mode: str, control: str = "nvidia-cuda-mps-control"
) -> plugin_config.Config:
    """Only GPU `index` is planned in `mode`; the plugin never touches compute modes here."""
    return plugin_config.parse(
        {
            "version": "v1",
            "defaultMode": "exclusive",
            "gpus": [{"match": {"index": index}, "mode": mode}],
            "ceilings": "allow-overcommit",
            "deviceListStrategy": ["envvar"],  # plain envs: no container runtime here
            "mps": {"setComputeMode": False, "controlBinary": control},
        }
    )


def _inventory() -> Inventory:
    with NvmlSession.open() as session:
        return read_inventory(session, Path("/sys"), "/usr/bin/nvidia-ctk")


def _host_envs(grant: Grant) -> dict[str, str]:
    """The grant's variables for a process on the host: the pipe dir is mounted at its own
    host path, so the variable holds as it is."""
    envs = dict(grant.envs)
    if "CUDA_MPS_PIPE_DIRECTORY" not in envs:
        # no container runtime to narrow the devices; MPS clients see the daemon's GPU only
        envs["CUDA_VISIBLE_DEVICES"] = envs.get("NVIDIA_VISIBLE_DEVICES", "")
    return envs


def setup(index: int, mps_root: Path, out: Path, control: str = "nvidia-cuda-mps-control") -> int:
    inv = _inventory()
    gpu = next((g for g in inv.gpus if g.index == index), None)
    if gpu is None:
        print(f"no GPU with index {index}", file=sys.stderr)
        return 1
    grants: dict[str, Any] = {"gpu": gpu.name, "uuid": gpu.uuid, "driver": inv.node.driver_version}
    # dedicated baseline: the whole GPU as `nvidia.com/gpu: 1` (no MPS, no caps)
    ex_cfg = hw_config(index, "exclusive", control)
    ex_plan = build_plan(inv, ex_cfg)
    state = mps_root.parent / "state"
    ex = plugin_allocate(
        ex_plan,
        ex_cfg,
        ex_cfg.resource_names.exclusive,
        1,
        DeclaredCeiling(None, ""),
        state / "ex",
        mps_root,
    )
    grants["dedicated"] = {"envs": _host_envs(ex), "limit_mib": gpu.memory_total // MIB}
    # shared: both pods on the GPU in sm-sharing, with the pilot's slices and ceilings,
    # scaled down on GPUs smaller than an H200
    cfg = hw_config(index, "sm-sharing", control)
    plan = build_plan(inv, cfg)
    gp = plan.for_gpu(gpu.uuid)
    if gp is None or not gp.advertised:
        print(
            f"GPU {index} cannot be shared: {gp.skipped if gp else 'not planned'}", file=sys.stderr
        )
        return 1
    count = min(SLICES, (len(gp.device_ids) - 2) // 2)
    ceiling = min(int(CEILING.removesuffix("Gi")) * GIB, gp.usable * 70 // 100)
    sup = MpsSupervisor(mps_root, lambda: cfg, HealthBoard(), compute_modes=None)
    sup.sync(plan)
    sup.start()
    try:
        if not sup.wait_ready(gpu.uuid, 60.0):
            print("the plugin's MPS daemon did not become ready in 60 s", file=sys.stderr)
            return 1
        for i, svc in enumerate(SERVICES):
            grant = plugin_allocate(
                plan,
                cfg,
                cfg.resource_names.sm_sharing,
                count,
                DeclaredCeiling(ceiling, f"pod {svc.name}"),
                state / f"shared-{i}",
                mps_root,
            )
            grants[svc.name] = {
                "envs": _host_envs(grant),
                "request_mib": grant.record.request_mib,
                "limit_mib": grant.record.limit_mib,
                "enforcement": [str(e) for e in grant.record.enforcement],
                "cuda_mps_pinned_device_mem_limit": grant.envs.get(
                    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
                ),
            }
    finally:
        sup.stop()  # supervision stops; the daemon lives on until `teardown`
    out.write_text(json.dumps(grants, indent=2))
    return 0


def teardown(mps_root: Path, control: str = "nvidia-cuda-mps-control") -> int:
    cfg = hw_config(0, "sm-sharing", control)
    sup = MpsSupervisor(mps_root, lambda: cfg, HealthBoard(), compute_modes=None)
    outcome = sup.stop_daemons(None, force=True)
    print(json.dumps(outcome))
    return 0


def _row(name: str, res: dict[str, Any]) -> str:
    lat = [float(x) for x in res["latencies"]]
    errors = res["errors"]
    return (
        f"| {name} | {res['service']} | "
        f"{res.get('request_mib') or '–'} / {res.get('limit_mib') or '–'} "
        f"| {len(lat)} / {len(lat) + sum(errors.values())} | "
        f"{', '.join(f'{k} {v}' for k, v in sorted(errors.items())) or '0'} | "
        f"{res['alloc_failures']} | {percentile(lat, 50):.2f} / {percentile(lat, 99):.2f} | "
        f"{max(res['reserved_mib'], default=0) / 1024:.1f} |"
    )


def report(grants_file: Path, results: list[Path], out: Path, date: str) -> int:
    grants = json.loads(grants_file.read_text())
    lines = [
        f"# Pilot on real hardware: {grants['gpu']} ({date})",
        "",
        f"GPU `{grants['uuid']}`, driver {grants['driver']}. Made by `hack/pilot/gpu.sh`: two "
        "PyTorch processes under the plugin's MPS daemon, each with the variables of the "
        "plugin's own Allocate answer (pinned device-memory limit = the ceiling), compared with "
        "each process alone on the GPU. No GPU setting was changed.",
        "",
        "| service | request MiB | limit MiB | CUDA_MPS_PINNED_DEVICE_MEM_LIMIT | enforcement |",
        "|---|---|---|---|---|",
    ]
    for svc in SERVICES:
        g = grants[svc.name]
        lines.append(
            f"| {svc.name} | {g['request_mib']} | {g['limit_mib']} | "
            f"`{g['cuda_mps_pinned_device_mem_limit']}` | {', '.join(g['enforcement'])} |"
        )
    lines += [
        "",
        "| run | service | request / limit MiB | served / offered | errors | alloc failures | "
        "p50 / p99 s | peak reserved GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for path in results:
        res = json.loads(path.read_text())
        lines.append(_row(path.stem.rsplit("-", 1)[0], res))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="real-GPU pilot helper (run by hack/pilot/gpu.sh)")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup")
    s.add_argument("--gpu-index", type=int, default=0)
    s.add_argument("--mps-root", type=Path, required=True)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--mps-control", default="nvidia-cuda-mps-control")
    t = sub.add_parser("teardown")
    t.add_argument("--mps-root", type=Path, required=True)
    t.add_argument("--mps-control", default="nvidia-cuda-mps-control")
    r = sub.add_parser("report")
    r.add_argument("--grants", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--date", required=True)
    r.add_argument("results", type=Path, nargs="+")
    args = p.parse_args(argv)
    if args.cmd == "setup":
        return setup(args.gpu_index, args.mps_root, args.out, args.mps_control)
    if args.cmd == "teardown":
        return teardown(args.mps_root, args.mps_control)
    return report(args.grants, args.results, args.out, args.date)


if __name__ == "__main__":
    sys.exit(main())
