#!/usr/bin/env bash
# Build the cluster's two images as OCI archives into DIR: the pod sandbox (our pause.c, static)
# and busybox (Debian's busybox-static). No registry is involved; up.sh imports them with
# `ctr -n k8s.io images import`.
#   hack/cluster/images/build.sh DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: $0 DIR}
. "$here/../versions.sh"
mkdir -p "$out"
gcc -Os -Wall -Werror -static -s -o "$out/pause" "$here/pause.c"
python3 "$here/mkimage.py" "$out/pause.tar" --name "$PAUSE_IMAGE" --entrypoint /pause --file "$out/pause:pause"

bb=/bin/busybox   # Debian's busybox-static
[ -x "$bb" ] || { echo "images: $bb missing (apt-get install busybox-static)" >&2; exit 1; }
links=()
for a in $("$bb" --list); do [ "$a" = busybox ] || links+=(--link "bin/$a:busybox"); done
python3 "$here/mkimage.py" "$out/busybox.tar" --name "$BUSYBOX_IMAGE" --cmd sh \
  --file "$bb:bin/busybox" "${links[@]}" --dir tmp --dir etc --dir root
