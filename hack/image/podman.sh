#!/usr/bin/env bash
# podman on the image build's own storage (hack/image/build.sh), kept off the host's defaults:
#   hack/image/podman.sh images
#   hack/image/podman.sh run --rm --ulimit nofile=1024:1024 --ulimit nproc=1000:1000 \
#     localhost/gpu-fraction-device-plugin:0.1.0 --version
#   hack/image/podman.sh --hold   set up the namespace, print "ready", keep it until stdin closes;
#                                 then `nsenter --mount=/proc/PID/ns/mnt -- env GPUFRAC_IMAGE_NS=1
#                                 hack/image/podman.sh ...` shares one run root between calls
#                                 (a detached container, then exec and stop, as the tests do)
# Rootful, runc (crun fails on hybrid cgroup hosts), cgroupfs, no events. Each call runs in a
# private mount namespace with a fresh tmpfs on /run (podman's run root, runc's state) and an
# overlay on /var/lib (podman's blob-info cache) whose upper layer is on that tmpfs, so nothing
# lands in /run/containers, /run/runc or /var/lib/containers, which the e2e suite checks stay
# absent. Images persist under the cache.
set -euo pipefail
cache=${GPUFRAC_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-fraction-image}
r=/run/gpu-fraction-image
if [ -n "${GPUFRAC_IMAGE_NS:-}" ]; then   # inside the namespace already
  export TMPDIR=$r/tmp CONTAINERS_CONF=$cache/containers.conf
  exec podman --root "$cache/storage" --runroot $r/runroot --tmpdir $r/tmp --runtime runc \
    --cgroup-manager cgroupfs --events-backend none --network-config-dir "$cache/networks" "$@"
fi
mkdir -p "$cache/storage" "$cache/networks"
cat >"$cache/containers.conf" <<CONF
[engine]
events_logger = "none"
runtime = "runc"
cgroup_manager = "cgroupfs"
[network]
network_config_dir = "$cache/networks"
CONF
setup="set -e
mount -t tmpfs -o mode=755,nosuid,nodev tmpfs /run
mkdir -p $r/runroot $r/tmp $r/varlib-up $r/varlib-work
mount -t overlay overlay -o lowerdir=/var/lib,upperdir=$r/varlib-up,workdir=$r/varlib-work /var/lib"
if [ "${1:-}" = --hold ]; then
  exec unshare --mount --propagation private -- sh -c "$setup
echo ready
read -r _ || true"
fi
exec unshare --mount --propagation private -- sh -c "$setup
GPUFRAC_IMAGE_NS=1 exec \"\$0\" \"\$@\"" "$0" "$@"
