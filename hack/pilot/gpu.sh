#!/usr/bin/env bash
# The pilot on a real GPU: two PyTorch services under the plugin's own MPS daemon, each with
# the variables of the plugin's own Allocate answer (pinned memory limit = its ceiling), under
# each shortage policy, compared with each service alone on the GPU (the dedicated baseline).
#
# Prerequisites: one NVIDIA GPU (Volta or newer, MIG off) with its driver and
# nvidia-cuda-mps-control on PATH; .venv with this project and PyTorch with CUDA
# (`.venv/bin/pip install -e '.[dev]' torch`), or PYTHON=/path/to/such/python. No root needed.
#
# Shared-machine safe: it changes no GPU setting (compute mode, MIG, clocks: the plugin runs
# with mps.setComputeMode false, so MPS uses the GPU's current mode), starts its MPS daemon
# in its own temp directory and quits it, and kills its workers on any exit.
#
# Usage: hack/pilot/gpu.sh [GPU_INDEX]    env: PILOT_SECONDS (per run, default 60)
# Output: docs/hardware/pilot-<date>-<gpu>.md (+ raw JSON beside it). About 5 × PILOT_SECONDS.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"
py="${PYTHON:-.venv/bin/python}"
index="${1:-0}"
seconds="${PILOT_SECONDS:-60}"
work="$(mktemp -d -t gpu-pilot.XXXXXX)"
mps_root="$work/mps"
pids=()

cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  "$py" hack/pilot/hw.py teardown --mps-root "$mps_root" >&2 || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

command -v nvidia-smi >/dev/null || { echo "gpu.sh: no NVIDIA driver (nvidia-smi)" >&2; exit 2; }
command -v nvidia-cuda-mps-control >/dev/null || { echo "gpu.sh: no nvidia-cuda-mps-control" >&2; exit 2; }
"$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || { echo "gpu.sh: $py has no PyTorch with CUDA" >&2; exit 2; }

"$py" hack/pilot/hw.py setup --gpu-index "$index" --mps-root "$mps_root" --out "$work/grants.json"

run_worker() { # $1 run name, $2 grant key, $3 service, $4 policy, $5 seed
  "$py" hack/pilot/gpu_worker.py --grants "$work/grants.json" --grant "$2" --service "$3" \
    --policy "$4" --seconds "$seconds" --seed "$5" --out "$work/$1-$3.json" &
  pids+=("$!")
}

# dedicated baseline: each service alone with the whole GPU, one after the other
for svc in chat rag; do
  run_worker dedicated dedicated "$svc" queue "$([[ $svc == chat ]] && echo 1 || echo 2)"
  wait "${pids[-1]}"
done
# shared: both at once, under the plugin's MPS daemon, same seeds
for policy in queue shed refuse; do
  run_worker "shared-$policy" chat chat "$policy" 1
  run_worker "shared-$policy" rag rag "$policy" 2
  wait "${pids[-2]}" "${pids[-1]}"
done

date="$(date -u +%Y-%m-%d)"
gpu="$(nvidia-smi -i "$index" --query-gpu=name --format=csv,noheader | tr ' ' '-' | tr -cd 'A-Za-z0-9-')"
out="docs/hardware/pilot-$date-$gpu.md"
mkdir -p docs/hardware/pilot-raw
cp "$work"/*.json docs/hardware/pilot-raw/
"$py" hack/pilot/hw.py report --grants "$work/grants.json" --out "$out" --date "$date" \
  "$work"/dedicated-*.json "$work"/shared-*.json
