#!/usr/bin/env bash
# Real-GPU smoke check: the inventory of this machine's GPUs as the plugin reads it through
# the real NVML driver, and a diff of its field shapes against the simulated h200x2 preset
# (a shape is a JSON path with its value type; a difference is a fact the fake gets wrong).
#
# Read-only by design: it only queries NVML. It changes no GPU setting (compute mode, MIG,
# clocks), starts no MPS daemon and leaves no process behind. Safe on a shared machine.
#
# Usage: hack/gpu-smoke.sh [OUT_DIR]   (default OUT_DIR: a temp dir; files are kept there)
# Env:   PYTHON=/path/to/python        (default: .venv/bin/python, else a fresh venv)
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

from deviceplugin.inventory import read_inventory
from deviceplugin.inventory_view import inventory_report
from deviceplugin.nvml import NvmlSession, NvmlUnavailable

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
echo "== outputs kept in $out"
