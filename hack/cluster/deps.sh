#!/usr/bin/env bash
# make cluster-deps: build every cluster component that is missing into a cache outside the
# work tree, one line per component (built / cached, seconds); nothing to do when all are built.
#
#   hack/cluster/deps.sh              Debian packages, then every component
#   hack/cluster/deps.sh COMPONENT..  only these (kubernetes-1.37.2 etcd containerd runc ...)
#   hack/cluster/deps.sh --print-dir COMPONENT   the bin/ directory of one component
#
# Cache: ${GPUFRAC_CLUSTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-fraction-cluster}/
#   <component>-<version>-go<go version>/bin/
# Each component builds into a temporary directory beside its final one and is renamed into
# place only when complete, so an interrupted build leaves nothing that looks built.
# Go's own caches (module cache, GOCACHE) keep their defaults. -buildvcs=false: the wrapper
# modules sit inside this repository, whose git state says nothing about the binaries.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.sh
. "$here/versions.sh"

say() { printf 'cluster-deps: %s\n' "$*"; }
die() { printf 'cluster-deps: %s\n' "$*" >&2; exit 1; }

cache=${GPUFRAC_CLUSTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-fraction-cluster}
if command -v go >/dev/null; then
  gover=$(go env GOVERSION)        # e.g. go1.26.8
  gover=${gover%% *}
elif [ "${1:-}" = --print-dir ]; then
  gover=""                         # up.sh without Go on PATH (sudo): the newest Go's build
else
  die "needs Go on PATH (the cache is keyed by its version)"
fi

# component name -> version
version_of() {
  case $1 in
    kubernetes-*) echo "${1#kubernetes-}" ;;
    etcd) echo "$ETCD_VERSION" ;;
    containerd) echo "$CONTAINERD_VERSION" ;;
    runc) echo "$RUNC_VERSION" ;;
    *) die "unknown component: $1" ;;
  esac
}
dir_of() {
  local c=$1 base=$1 found
  case $c in kubernetes-*) base=kubernetes ;; esac
  if [ -n "$gover" ]; then echo "$cache/$base-$(version_of "$c")-$gover"; return; fi
  found=$(find "$cache" -maxdepth 1 -name "$base-$(version_of "$c")-go*" ! -name '*.tmp.*' 2>/dev/null | sort -V | tail -1)
  echo "${found:-$cache/$base-$(version_of "$c")-go(none built)}"
}

build_kubernetes() { # $1 version, $2 output bin dir
  local v=$1 out=$2 minor date ldf p
  local mod=$here/k8s-$v
  [ -f "$mod/go.mod" ] || die "no wrapper module $mod (run hack/cluster/gen-k8s-module.sh $v)"
  minor=$(echo "$v" | cut -d. -f2)
  date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  ldf="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldf="$ldf -X $p.gitVersion=v$v -X $p.gitMajor=1 -X $p.gitMinor=$minor"
    ldf="$ldf -X $p.gitTreeState=clean -X $p.buildDate=$date"
  done
  # One go build for all five shares every common package. CGO_ENABLED=0 for all, the kubelet
  # included (upstream links the kubelet with cgo; nothing the node needs here requires it).
  (cd "$mod" && CGO_ENABLED=0 nice -n 10 go build -trimpath -buildvcs=false -tags selinux,notest -ldflags "$ldf" -o "$out/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kubectl)
  "$out/kubelet" --version | grep -qx "Kubernetes v$v" || die "kubelet --version: $("$out/kubelet" --version)"
}

build_etcd() {
  local v=$1 out=$2
  (cd "$here/etcd" && CGO_ENABLED=0 nice -n 10 go build -trimpath -buildvcs=false \
    -ldflags "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=v$v" -o "$out/etcd" go.etcd.io/etcd/server/v3)
  "$out/etcd" --version | grep -q "etcd Version: $v" || die "etcd --version: $("$out/etcd" --version)"
}

build_containerd() {
  local v=$1 out=$2 p=github.com/containerd/containerd/v2
  local ldf="-s -w -X $p/version.Version=v$v -X $p/version.Revision=v$v -X $p/version.Package=$p"
  (cd "$here/containerd" &&
    CGO_ENABLED=0 nice -n 10 go build -trimpath -buildvcs=false -tags "no_btrfs urfave_cli_no_docs" -ldflags "$ldf" -o "$out/" \
      $p/cmd/containerd $p/cmd/ctr &&
    CGO_ENABLED=0 nice -n 10 go build -trimpath -buildvcs=false -tags "no_btrfs no_grpc urfave_cli_no_docs" -ldflags "$ldf" \
      -o "$out/" $p/cmd/containerd-shim-runc-v2)
  "$out/containerd" --version | grep -q "v$v" || die "containerd --version: $("$out/containerd" --version)"
}

build_runc() {
  local v=$1 out=$2 p=github.com/opencontainers/runc
  # cgo with libseccomp, as upstream's release build (tag seccomp).
  (cd "$here/runc" && CGO_ENABLED=1 nice -n 10 go build -trimpath -buildvcs=false -tags "seccomp urfave_cli_no_docs" \
    -ldflags "-s -w -X main.version=$v" -o "$out/runc" $p)
  "$out/runc" --version | grep -q "runc version $v" || die "runc --version: $("$out/runc" --version)"
}

ensure() { # $1 component
  local c=$1 v d tmp t0 t1
  v=$(version_of "$c"); d=$(dir_of "$c")
  if [ -d "$d/bin" ]; then say "$c $v: cached ($d)"; return; fi
  mkdir -p "$cache"
  tmp=$(mktemp -d "$d.tmp.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  t0=$(date +%s)
  say "$c $v: building ..."
  case $c in
    kubernetes-*) build_kubernetes "$v" "$tmp/bin" ;;
    *) "build_$c" "$v" "$tmp/bin" ;;
  esac
  t1=$(date +%s)
  echo "$((t1 - t0))" >"$tmp/build-seconds"
  chmod 755 "$tmp"
  mv -T "$tmp" "$d"
  trap - EXIT
  say "$c $v: built in $((t1 - t0)) s ($d)"
}

install_packages() {
  command -v dpkg-query >/dev/null || die "needs Debian or Ubuntu (apt)"
  local missing="" p sudo=""
  for p in $CLUSTER_PACKAGES; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing="$missing $p"
  done
  if [ -z "$missing" ]; then say "Debian packages: already installed"; return; fi
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  say "Debian packages: installing$missing"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $missing >/dev/null
}

if [ "${1:-}" = --print-dir ]; then dir_of "${2:?component}"; exit 0; fi
if [ $# -gt 0 ]; then comps="$*"; else
  install_packages
  comps="kubernetes-$K8S_VERSION etcd containerd runc kubernetes-$K8S_OLD_VERSION"
fi
start=$(date +%s)
for c in $comps; do ensure "$c"; done
say "all built ($(( $(date +%s) - start )) s), cache $cache"
