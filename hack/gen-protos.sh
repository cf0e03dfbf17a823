#!/usr/bin/env bash
# Regenerate the Python modules for protos/*.proto into deviceplugin/_pb (or $1).
# grpc_tools writes absolute imports ("import x_pb2"); rewrite them to relative
# ones so the modules live inside the package.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-deviceplugin/_pb}"
python="${PYTHON:-python3}"
mkdir -p "$out"
"$python" -m grpc_tools.protoc -I protos \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  protos/deviceplugin_v1beta1.proto protos/podresources_v1.proto \
  protos/pluginregistration_v1.proto protos/dra_v1.proto protos/dra_v1beta1.proto \
  protos/dra_health_v1alpha1.proto
for f in "$out"/*_pb2_grpc.py; do
  sed -i -E 's/^import ([a-z0-9_]+_pb2) as /from . import \1 as /' "$f"
done
[ -f "$out/__init__.py" ] || printf '"""Generated from protos/ by hack/gen-protos.sh; never edit by hand."""\n' > "$out/__init__.py"
