#!/usr/bin/env bash
# make image: the node agent's image, built with no registry. Each step is skipped when its
# result is current, so a second run with nothing changed rebuilds nothing (podman reuses
# every layer):
#  1. base: Debian's essential packages plus python3 and mount (util-linux's nsenter and
#     unshare are essential) and libstdc++6 (grpcio), bootstrapped by mmdebstrap from the Debian mirror into a tar the
#     build owns, imported with `podman import` as localhost/gpu-fraction/base:<suite>-<recipe
#     hash>; a changed recipe makes a new tag. No apt, no compiler, no docs in it.
#  2. wheels: hack/image/wheels.py writes build/image/wheels/ (the project's wheel, its runtime
#     dependencies pinned to the venv's versions, wheels only, and pip's own wheel).
#  3. the Dockerfile, built with podman (runc, --network=none: everything is in the context),
#     tagged gpu-fraction-device-plugin:<version> (or $GPUFRAC_IMAGE_TAG).
#  4. saved as a docker archive, build/image/gpu-fraction-device-plugin-<version>.tar, named
#     docker.io/library/gpu-fraction-device-plugin:<version>, the name the DaemonSet's image
#     resolves to: `ctr -n k8s.io images import` (or `podman load`) it on a node.
# Podman keeps its storage under the cache below, not in /var/lib/containers; run podman on it
# with hack/image/podman.sh. Needs root (mmdebstrap and rootful podman), mmdebstrap, podman and
# runc (`make image-deps`), and the project's venv (`make .venv/.installed`).
#
#   hack/image/build.sh [--refresh-base]   --refresh-base: bootstrap the base again (updates)
#   GPUFRAC_IMAGE_TAG=0.1.0-b hack/image/build.sh   another tag (default: the package version),
#                                                  e.g. a second one for an upgrade test
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
SUITE=bookworm                            # its python3 (3.11) is what wheels.py targets
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
# libstdc++6: the C++ runtime manylinux wheels (grpcio) expect of the system.
BASE_PACKAGES="python3,mount,libstdc++6"
NAME=gpu-fraction-device-plugin
VERSION=$(.venv/bin/python -c 'import deviceplugin; print(deviceplugin.__version__)')
TAG=${GPUFRAC_IMAGE_TAG:-$VERSION}
IMAGE=localhost/$NAME:$TAG
ARCHIVE_NAME=docker.io/library/$NAME:$TAG
ARCHIVE=build/image/$NAME-$TAG.tar
cache=${GPUFRAC_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-fraction-image}
podman=$repo/hack/image/podman.sh
# Where podman puts the build's RUN containers (cgroupfs); removed at the end.
CGROUP_PARENT=gpu-fraction-image

say() { printf 'image: %s\n' "$*"; }
die() { printf 'image: %s\n' "$*" >&2; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

[ "$(id -u)" -eq 0 ] || die "needs root (mmdebstrap into a folder, rootful podman)"
for tool in mmdebstrap podman runc; do
  command -v $tool >/dev/null || die "$tool not found; \`make image-deps\` installs it"
done
[ -x .venv/bin/python ] || die "no .venv; run \`make .venv/.installed\`"

# Documentation and translations go; copyright files stay (Debian policy: shipped with binaries).
DPKG_OPTS=(
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
  --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/lintian/*'
)
SOURCES=("deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main"
  "deb $SECURITY_MIRROR $SUITE-security main")
# merged-usr: /usr merged by symlinks and usr-is-merged installed, not the usrmerge package,
# which would pull in the whole of perl (~46 MB).
HOOKS=(--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr)
recipe="$SUITE|essential|${HOOKS[*]}|$BASE_PACKAGES|${DPKG_OPTS[*]}|${SOURCES[*]}|$(uname -m)"
BASE=localhost/gpu-fraction/base:$SUITE-$(printf '%s' "$recipe" | sha256sum | cut -c1-12)

start=$(now)
t=$(now)
if [ "${1:-}" = --refresh-base ]; then "$podman" rmi -f "$BASE" >/dev/null 2>&1 || true; fi
if "$podman" image exists "$BASE"; then
  say "base $BASE: cached"
else
  mkdir -p "$cache/base"
  tar=$cache/base/rootfs-$SUITE.tar
  say "base $BASE: mmdebstrap $SUITE (essential + $BASE_PACKAGES) ..."
  log=$cache/base/mmdebstrap.log
  mmdebstrap --variant=essential --include="$BASE_PACKAGES" "${HOOKS[@]}" "${DPKG_OPTS[@]}" \
    "$SUITE" "$tar" "${SOURCES[@]}" >"$log" 2>&1 || { tail -20 "$log" >&2; die "mmdebstrap failed ($log)"; }
  "$podman" import --quiet --change 'CMD ["/bin/sh"]' "$tar" "$BASE" >/dev/null
  rm -f "$tar"
  # Bases of an older recipe: no longer used by this Dockerfile.
  "$podman" images --format '{{.Repository}}:{{.Tag}}' localhost/gpu-fraction/base |
    grep -vx "$BASE" | xargs -r "$podman" rmi -f >/dev/null 2>&1 || true
  say "base $BASE: built in $(since "$t") s"
fi

t=$(now)
.venv/bin/python hack/image/wheels.py build/image/wheels >/dev/null
say "wheels: $(ls build/image/wheels/deps/*.whl | wc -l) dependencies and the app in $(since "$t") s"

t=$(now)
"$podman" build --quiet --network=none --pull=never \
  --ulimit nofile=1024:1024 --ulimit nproc=1000:1000 --cgroup-parent "/$CGROUP_PARENT" \
  --build-arg BASE="$BASE" --build-arg VERSION="$VERSION" \
  --layers --tag "$IMAGE" --file Dockerfile . >/dev/null
say "podman build $IMAGE: $(since "$t") s"
for h in /sys/fs/cgroup/*/$CGROUP_PARENT /sys/fs/cgroup/$CGROUP_PARENT; do
  [ -d "$h" ] && find "$h" -depth -type d -exec rmdir {} + 2>/dev/null || true
done

t=$(now)
id=$("$podman" image inspect --format '{{.Id}}' "$IMAGE")
if [ "$(cat "$ARCHIVE.id" 2>/dev/null)" = "$id" ] && [ -f "$ARCHIVE" ]; then
  say "archive $ARCHIVE: current"
else
  "$podman" tag "$IMAGE" "$ARCHIVE_NAME"
  rm -f "$ARCHIVE" "$ARCHIVE.id"
  "$podman" save --quiet --format docker-archive -o "$ARCHIVE" "$ARCHIVE_NAME"
  "$podman" untag "$IMAGE" "$ARCHIVE_NAME" 2>/dev/null || true
  echo "$id" >"$ARCHIVE.id"
  say "archive $ARCHIVE: saved in $(since "$t") s"
fi
size=$("$podman" image inspect --format '{{.Size}}' "$IMAGE")
say "$IMAGE: $((size / 1000000)) MB ($size bytes), ${id:0:12}, total $(since "$start") s"
