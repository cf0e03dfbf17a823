#!/usr/bin/env bash
# Real-GPU smoke check: the inventory of this machine's GPUs as the plugin reads it through
# the real NVML driver, and a diff of its field shapes against the simulated h200x2 preset
# (a shape is a JSON path with its value type; a difference is a fact the fake gets wrong).
#
# Then the MPS step (issue 5, issue 13 item 13, DESIGN 9): the plugin's MpsSupervisor starts a
# real control daemon on one GPU with `mps.setComputeMode: false` and the GPU's shm tmpfs as
# its /dev/shm; the plugin's own Allocator answers two containers of one 4 GiB slice each, and
# each PyTorch client runs as a pod sees it (deviceplugin.simulate.pod: `unshare --mount --ipc
# --fork`, a private /dev/shm, only the answer's env, mounts and device nodes, its CDI devices
# resolved from the spec files). Both at once: 3 GiB must allocate, 5 GiB must fail with
# out-of-memory. The daemon is quit and the compute mode checked unchanged. The result, with
# date, GPU and driver and the real daemon's exact outputs, goes to
# docs/hardware/mps-smoke-<date>-<gpu>.md. The MPS step needs root.
#
# Changes no GPU setting (compute mode, MIG, clocks). The MPS daemon lives in a temp dir and is
# quit on any exit; nothing is left behind. Safe on a shared machine.
#
# Usage: hack/gpu-smoke.sh [OUT_DIR]   (default OUT_DIR: a temp dir; files are kept there)
# Env:   PYTHON=/path/to/python        (default: .venv/bin/python, else a fresh venv); the MPS
#                                      step needs PyTorch with CUDA in it, or CLIENT_PYTHON
#        CLIENT_PYTHON=/path/to/python (the MPS client's interpreter; default: PYTHON)
#        SMOKE_MPS=0                   (skip the MPS step)   SMOKE_GPU_INDEX (default 0)
#        MPS_CONTROL=binary            (default nvidia-cuda-mps-control)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
out="${1:-$(mktemp -d -t gpu-smoke.XXXXXX)}"
mkdir -p "$out"

py="${PYTHON:-}"
if [[ -z "$py" ]]; then
  if [[ -x .venv/bin/python ]]; then
    py=.venv/bin/python
  else
    venv="$out/venv"
    echo "creating $venv (pip install -e .)" >&2
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q -e .
    py="$venv/bin/python"
  fi
fi

# The CLI's `inventory --json` when it is wired; otherwise the same library calls it makes.
inventory_json() { # $1: "" for the real driver, or a preset name
  local sim=()
  [[ -n "$1" ]] && sim=(--simulate "$1")
  if "$py" -m deviceplugin inventory --json "${sim[@]}" 2>"$out/cli.err"; then
    return 0
  fi
  "$py" - "$1" <<'EOF'
import json
import sys
import tempfile
from pathlib import Path

from deviceplugin.inventory.gpus import read_inventory
from deviceplugin.report import inventory_report
from deviceplugin.inventory.nvml import NvmlSession, NvmlUnavailable

preset = sys.argv[1]
facts = None
sysfs = Path("/sys")
if preset:
    from deviceplugin.simulate.nvml import FakeNvml
    from deviceplugin.simulate.specs import load_spec

    spec = load_spec(preset)
    FakeNvml(spec).install()
    sysfs = spec.write_sysfs(Path(tempfile.mkdtemp()))
    facts = spec.node_facts()
try:
    with NvmlSession.open() as session:
        inv = read_inventory(session, sysfs, "/usr/bin/nvidia-ctk", facts)
except NvmlUnavailable as err:
    print(err, file=sys.stderr)
    sys.exit(1)
print(json.dumps(inventory_report(inv, None), indent=2))
EOF
}

# One line per JSON path with the value's type; list items collapse to [].
shapes() {
  "$py" -c '
import json, sys
def walk(v, path):
    if isinstance(v, dict):
        for k, x in v.items():
            walk(x, f"{path}.{k}")
    elif isinstance(v, list):
        for x in v:
            walk(x, f"{path}[]")
        if not v:
            print(f"{path}[] empty")
    else:
        print(f"{path} {type(v).__name__}")
walk(json.load(open(sys.argv[1])), "$")
' "$1" | sort -u
}

# --- the MPS step -----------------------------------------------------------------------------

write_mps_helpers() { # $1: directory for mps_smoke.py and mps_client.py
  cat >"$1/mps_client.py" <<'EOF'
"""MPS client: 3 GiB (expected to work), wait for a line on stdin, then 5 GiB (expected OOM)."""
import json
import os
import sys

import torch

GIB = 1 << 30


def attempt(gib):
    try:
        x = torch.empty(gib * GIB, dtype=torch.uint8, device="cuda")
        x.fill_(1)
        torch.cuda.synchronize()
        del x
        torch.cuda.empty_cache()
        return {"gib": gib, "ok": True, "oom": False}
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError is a RuntimeError
        torch.cuda.empty_cache()
        text = str(e)
        oom = isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in text
        return {"gib": gib, "ok": False, "oom": oom, "error": text.splitlines()[0][:300]}


torch.cuda.init()
free, total = torch.cuda.mem_get_info()
first = attempt(3)
first.update(pid=os.getpid(), mem_get_info=[free, total], torch=torch.__version__)
first["env"] = {k: v for k, v in os.environ.items() if k.startswith(("CUDA_", "NVIDIA_"))}
first["dev"] = sorted(os.listdir("/dev"))
print(json.dumps(first), flush=True)
sys.stdin.readline()
print(json.dumps(attempt(5)), flush=True)
EOF
  cat >"$1/mps_smoke.py" <<'EOF'
"""Start the plugin's MPS daemon on one GPU (compute mode untouched), take two Allocate
answers of one 4 GiB slice each from the plugin's own Allocator, and run one client per
answer as a pod would see it (deviceplugin.simulate.pod: new mount and IPC namespaces, a
private /dev/shm, only the answer's env, mounts and device nodes, its CDI devices resolved
from the spec files), both at once; quit the daemon and write the report. Run inside a
private mount namespace (the caller's unshare), so the shm tmpfs goes with it. Exit 1 when
a check fails."""
import argparse
import dataclasses
import datetime
import json
import select
import shutil
import subprocess
import sys
from pathlib import Path

from deviceplugin import cdi_registry
from deviceplugin import config as plugin_config
from deviceplugin.dpapi.allocator import Allocator
from deviceplugin.health.board import HealthBoard
from deviceplugin.inventory.gpus import read_inventory
from deviceplugin.ledger.store import Ledger
from deviceplugin.model import GIB, MIB
from deviceplugin.mps import shm
from deviceplugin.mps.control import MpsControl, parse_mem_limit, parse_pids
from deviceplugin.mps.supervisor import MpsSupervisor
from deviceplugin.inventory.nvml import NvmlSession
from deviceplugin.plan import build_plan
from deviceplugin.simulate import pod

CAP = 4 * GIB  # one slice: the cap of each client
CLIENTS = 2
DRIVER_SPEC_DIRS = [Path("/etc/cdi"), Path("/var/run/cdi")]
COMMANDS = (
    "get_default_device_pinned_mem_limit 0",
    "get_default_active_thread_percentage",
    "get_server_list",
    "ps",
)


def read_line(proc, timeout):
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    return json.loads(line) if line.strip() else None


def compute_mode(uuid):
    with NvmlSession.open() as session:
        return session.get_compute_mode(uuid)


def answer_json(grant):
    return {
        "envs": grant.envs,
        "mounts": [list(m) for m in grant.mounts],
        "device_specs": [list(d) for d in grant.device_specs],
        "cdi_devices": grant.cdi_devices,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--control", default="nvidia-cuda-mps-control")
    ap.add_argument("--client", required=True)
    ap.add_argument("--client-python", default=sys.executable)
    ap.add_argument("--report-dir", type=Path, required=True)
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args()
    root, cdi_dir = a.work / "mps", a.work / "cdi"

    with NvmlSession.open() as session:
        inv = read_inventory(session, Path("/sys"), "/usr/bin/nvidia-ctk")
    gpu = next((g for g in inv.gpus if g.index == a.index), None)
    if gpu is None:
        print(f"mps step: no GPU with index {a.index}", file=sys.stderr)
        return 1
    # The plugin's CDI delivery where the toolkit's spec names this GPU; else device nodes
    # and plain env (what a node without CDI gets).
    driver = f"nvidia.com/gpu={gpu.uuid}"
    has_driver_spec = driver in cdi_registry.known_devices(DRIVER_SPEC_DIRS)
    strategies = ["cdi"] if has_driver_spec else ["device-nodes"]
    cfg = plugin_config.parse(
        {
            "version": "v1",
            "defaultMode": "exclusive",
            "deviceListStrategy": strategies,
            # usable = total - reserved = 2 slices of 4 GiB; each answer caps its client at 4
            "gpus": [
                {
                    "match": {"index": a.index},
                    "mode": "sm-sharing",
                    "sliceSize": CAP,
                    "reservedMemory": gpu.memory_total - CLIENTS * CAP,
                }
            ],
            "mps": {"setComputeMode": False, "controlBinary": a.control, "launcher": "direct"},
        }
    )
    plan = build_plan(inv, cfg)
    gp = plan.for_gpu(gpu.uuid)
    date = datetime.datetime.now(datetime.timezone.utc)
    result = {
        "date": date.isoformat(timespec="seconds"),
        "gpu": gpu.name,
        "uuid": gpu.uuid,
        "driver": inv.node.driver_version,
        "cuda_driver_version": inv.node.cuda_driver_version,
        "compute_mode_before": compute_mode(gpu.uuid),
        "delivery": strategies,
        "checks": {},
        "raw": {},
    }
    checks, raw = result["checks"], result["raw"]
    if gp is None or not gp.advertised:
        result["error"] = f"GPU not planned for sm-sharing: {gp.skipped if gp else 'absent'}"
        a.json.write_text(json.dumps(result, indent=2))
        print(result["error"], file=sys.stderr)
        return 1
    state, why = shm.ensure(root, gpu.uuid, cfg.mps.shm_size, simulated=False)
    result["shm"] = f"{state.value}: {why}"
    checks["shm tmpfs mounted"] = state is shm.ShmState.TMPFS
    board = HealthBoard()
    # compute_modes=None: the supervisor cannot touch compute modes even by mistake
    sup = MpsSupervisor(
        root,
        lambda: cfg,
        board,
        compute_modes=None,
        multiuser=False,
        shm_states=lambda: {gpu.uuid: state},
    )
    sup.sync(plan)
    sup.start()
    clients = []
    try:
        checks["daemon started and verified by the supervisor"] = sup.wait_ready(gpu.uuid, 60)
        snap = sup.snapshot()[gpu.uuid]
        result["daemon"] = {
            "pid": snap.pid,
            "state": snap.state.value,
            "error": snap.last_error,
            "pinned_limit_mib": snap.settings.pinned_limit_mib if snap.settings else None,
        }
        if not checks["daemon started and verified by the supervisor"]:
            return 1
        ctl = MpsControl(a.control, root, gpu.uuid)
        for cmd in COMMANDS:
            raw[cmd] = ctl.command(cmd, 10)
        checks["default pinned limit reads back as both slices"] = (
            parse_mem_limit(raw[COMMANDS[0]]) == CLIENTS * CAP // MIB
        )
        allocator = Allocator(
            lambda: plan, lambda: cfg, cdi_dir, root, Ledger(a.work / "state"), board, mps=sup
        )
        spec_dirs = [*DRIVER_SPEC_DIRS, cdi_dir]
        if shutil.which("nvidia-modprobe"):
            # /dev/nvidia-uvm* appear with the first CUDA process; the answers name them.
            subprocess.run(["nvidia-modprobe", "-u", "-c=0"], check=False)
        for n, device in enumerate(gp.device_ids[:CLIENTS]):
            grant = allocator.allocate(gp.resource, [device])
            answer = answer_json(grant)
            view = pod.view_of(answer, spec_dirs)
            result[f"answer_{n}"] = answer
            result[f"view_{n}"] = dataclasses.asdict(view)
            stage = a.work / f"dev{n}"
            stage.mkdir()
            argv = pod.container_argv(view, [a.client_python, a.client], stage)
            clients.append(
                subprocess.Popen(
                    argv,
                    env=pod.container_env(view),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        firsts = [read_line(c, 120) for c in clients]
        result["clients_3gib"] = firsts
        servers = ctl.server_list(10)
        listed = {s: parse_pids(ctl.command(f"get_client_list {s}", 10)) for s in servers}
        raw["get_server_list (clients connected)"] = ctl.command("get_server_list", 10)
        raw["ps (clients connected)"] = ctl.command("ps", 10)
        for s in servers:
            raw[f"get_server_status {s}"] = ctl.command(f"get_server_status {s}", 10)
            raw[f"get_client_list {s}"] = ctl.command(f"get_client_list {s}", 10)
        checks["3 GiB allocation works in each client"] = all(f and f["ok"] for f in firsts)
        pids = {p for ps in listed.values() for p in ps}
        checks["both clients are clients of the MPS server at once"] = all(
            f and f["pid"] in pids for f in firsts
        )
        for c in clients:
            c.stdin.write("go\n")
            c.stdin.flush()
        seconds = [read_line(c, 120) for c in clients]
        result["clients_5gib"] = seconds
        checks["5 GiB allocation fails with out-of-memory in each client"] = all(
            s and not s["ok"] and s["oom"] for s in seconds
        )
        for c in clients:
            c.stdin.close()
            c.wait(60)
        result["client_stderr_tail"] = [c.stderr.read()[-2000:] for c in clients]
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
                c.wait()
        sup.stop()
        result["stop"] = sup.stop_daemons([gpu.uuid], force=True)
        result["compute_mode_after"] = compute_mode(gpu.uuid)
        checks["daemon quit"] = result["stop"].get(gpu.uuid, "").startswith("stopped")
        checks["compute mode unchanged"] = (
            result["compute_mode_after"] == result["compute_mode_before"]
        )
        a.json.write_text(json.dumps(result, indent=2))
        write_report(a.report_dir, date, result)
    return 0 if all(checks.values()) else 1


def write_report(report_dir, date, r):
    name = "".join(c for c in r["gpu"].replace(" ", "-") if c.isalnum() or c == "-")
    path = report_dir / f"mps-smoke-{date:%Y-%m-%d}-{name}.md"
    lines = [
        f"# MPS smoke: {r['gpu']}, driver {r['driver']}, {date:%Y-%m-%d}",
        "",
        "Written by `hack/gpu-smoke.sh` (MPS step). The plugin's MpsSupervisor started one",
        "`nvidia-cuda-mps-control -d` for this GPU with `mps.setComputeMode: false`; the",
        "plugin's Allocator answered two containers of one 4 GiB slice each; each PyTorch",
        "client ran as a pod sees it (`unshare --mount --ipc --fork`, private /dev/shm, only",
        "the answer's env, mounts and device nodes) and allocated 3 GiB, then 5 GiB, both",
        "at once; the daemon was quit.",
        "",
        f"- date: {r['date']}",
        f"- GPU: {r['gpu']} `{r['uuid']}`",
        f"- driver: {r['driver']} (CUDA driver API {r['cuda_driver_version']})",
        f"- delivery: {r['delivery']}; shm: {r.get('shm')}",
        f"- compute mode before/after: {r['compute_mode_before']} / "
        f"{r.get('compute_mode_after')}",
        f"- daemon: `{json.dumps(r.get('daemon'))}`",
        f"- stop: `{json.dumps(r.get('stop'))}`",
        "",
        "| check | result |",
        "|---|---|",
        *(f"| {k} | {'pass' if v else 'FAIL'} |" for k, v in r["checks"].items()),
        "",
        "## Clients",
        "",
        "```json",
        json.dumps({k: r.get(k) for k in ("clients_3gib", "clients_5gib")}, indent=2),
        "```",
        "",
        "## What the first container got",
        "",
        "```json",
        json.dumps(r.get("view_0"), indent=2),
        "```",
        "",
        "## The real daemon's outputs (expectations for the simulated binary)",
        "",
    ]
    for cmd, out in r["raw"].items():
        lines += [f"`{cmd}`:", "", "```", out.rstrip("\n") or "(no output)", "```", ""]
    report_dir.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    print(f"report: {path}")


if __name__ == "__main__":
    sys.exit(main())
EOF
}

mps_teardown() { # quit whatever daemon the step left under $1 (on an error or a signal)
  "$py" - "$1" "${MPS_CONTROL:-nvidia-cuda-mps-control}" <<'EOF' >&2 || true
import sys
from pathlib import Path

from deviceplugin.config.settings import Config, MpsConfig
from deviceplugin.health.board import HealthBoard
from deviceplugin.mps.supervisor import MpsSupervisor

root = Path(sys.argv[1])
if root.is_dir():
    config = Config(mps=MpsConfig(control_binary=sys.argv[2], set_compute_mode=False))
    sup = MpsSupervisor(root, lambda: config, HealthBoard(), compute_modes=None)
    print(sup.stop_daemons(None, force=True))
EOF
}

mps_step() {
  echo "== MPS step: real daemon, two pod-like clients at 4 GiB each: 3 GiB works, 5 GiB fails"
  if [[ "${SMOKE_MPS:-1}" == 0 ]]; then echo "skipped (SMOKE_MPS=0)"; return 0; fi
  local control="${MPS_CONTROL:-nvidia-cuda-mps-control}" client_py="${CLIENT_PYTHON:-$py}"
  if ! command -v nvidia-smi >/dev/null; then echo "skipped: no NVIDIA driver"; return 0; fi
  if ! command -v "$control" >/dev/null; then echo "skipped: no $control"; return 0; fi
  if [[ $(id -u) != 0 ]]; then echo "skipped: needs root (mount namespaces)"; return 0; fi
  if ! "$client_py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    2>/dev/null; then
    echo "skipped: $client_py has no PyTorch with CUDA (set CLIENT_PYTHON)"
    return 0
  fi
  # Short root: the daemon's socket path must fit 107 bytes.
  local work
  work="$(mktemp -d /tmp/gfs.XXXXXX)"
  write_mps_helpers "$work"
  trap 'mps_teardown "$work/mps"; rm -rf "$work"' EXIT
  local rc=0
  # A private mount namespace: the shm tmpfs and every bind go away with it.
  unshare --mount --propagation private -- \
    "$py" "$work/mps_smoke.py" --index "${SMOKE_GPU_INDEX:-0}" --work "$work" \
    --control "$control" --client "$work/mps_client.py" --client-python "$client_py" \
    --report-dir "$repo/docs/hardware" --json "$out/mps.json" || rc=$?
  mps_teardown "$work/mps"
  rm -rf "$work"
  trap - EXIT
  if [[ $rc != 0 ]]; then
    echo "MPS step FAILED (details in $out/mps.json and the report)"
    return "$rc"
  fi
  echo "MPS step passed"
}

echo "== nvidia-smi (read-only query)"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=index,uuid,name,memory.total,pci.bus_id,compute_mode,driver_version \
    --format=csv | tee "$out/nvidia-smi.csv"
else
  echo "nvidia-smi not found"
fi

echo "== inventory --json (real driver)"
inventory_json "" | tee "$out/real.json"
inventory_json h200x2 >"$out/h200x2.json"

echo "== field shapes: real (<) vs h200x2 preset (>)"
shapes "$out/real.json" >"$out/real.shapes"
shapes "$out/h200x2.json" >"$out/h200x2.shapes"
if diff "$out/real.shapes" "$out/h200x2.shapes"; then
  echo "same field shapes"
fi
mps_step
echo "== outputs kept in $out"
