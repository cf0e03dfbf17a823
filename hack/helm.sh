#!/usr/bin/env bash
# Build helm from its Go module into the cluster components' cache, only when it is missing,
# and print the binary's path (the last line of stdout). Idempotent and cheap when cached.
#
#   hack/helm.sh            build if missing, print the path
#   hack/helm.sh --print    print the path it has or would have; build nothing
#
# Cache: ${GPUFRAC_CLUSTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-fraction-cluster}/
#   helm-<version>-go<go version>/bin/helm, the layout of hack/cluster/deps.sh. It builds into a
# temporary directory beside the final one and renames it into place when complete, so an
# interrupted build leaves nothing that looks built.
set -euo pipefail

HELM_VERSION=${HELM_VERSION:-4.3.2}

say() { printf 'helm: %s\n' "$*" >&2; }
die() { printf 'helm: %s\n' "$*" >&2; exit 1; }

command -v go >/dev/null || die "needs Go on PATH to build helm.sh/helm/v4@v$HELM_VERSION"
cache=${GPUFRAC_CLUSTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-fraction-cluster}
gover=$(go env GOVERSION)
gover=${gover%% *}
dir=$cache/helm-$HELM_VERSION-$gover

if [ "${1:-}" = --print ] || [ -x "$dir/bin/helm" ]; then
  echo "$dir/bin/helm"
  exit 0
fi

mkdir -p "$cache"
tmp=$(mktemp -d "$dir.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
t0=$(date +%s)
say "building helm.sh/helm/v4 v$HELM_VERSION with $gover (a few minutes, once) ..."
# helm's go.mod has no replace or exclude, so `go install mod@version` works. The -X sets what
# `helm version` prints, as upstream's Makefile does; -trimpath and no cgo as its release build.
CGO_ENABLED=0 GOBIN=$tmp/bin GOFLAGS=-buildvcs=false nice -n 10 go install -trimpath \
  -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=v$HELM_VERSION" \
  "helm.sh/helm/v4/cmd/helm@v$HELM_VERSION"
"$tmp/bin/helm" version --short | grep -q "^v$HELM_VERSION" ||
  die "helm version: $("$tmp/bin/helm" version --short)"
t1=$(date +%s)
echo "$((t1 - t0))" >"$tmp/build-seconds"
chmod 755 "$tmp"
mv -T "$tmp" "$dir"
trap - EXIT
say "built in $((t1 - t0)) s"
echo "$dir/bin/helm"
