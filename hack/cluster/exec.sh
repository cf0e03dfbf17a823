#!/usr/bin/env bash
# Run a command inside the cluster's network, mount and PID namespaces (nsenter forks into the
# node's PID namespace and exits with the command's status), with KUBECONFIG naming the
# admin kubeconfig, kubectl's cache in the run dir and the cluster's kubectl first on PATH:
#   hack/cluster/exec.sh kubectl get nodes
#   hack/cluster/exec.sh python3 -m pytest ...
set -euo pipefail
prog=cluster-exec
. "$(cd "$(dirname "$0")" && pwd)/lib.sh"
[ $# -gt 0 ] || die "usage: $0 COMMAND [ARG...]"
[ "$(id -u)" -eq 0 ] || die "must run as root (nsenter)"
HOLDER=$(holder_pid) || die "no cluster is up (run dir $RUN); run make cluster-up"
. "$RUN/env"
exec nsenter --target "$HOLDER" --net --mount --pid --wd="$PWD" -- \
  env KUBECONFIG="$KUBECONFIG" KUBECACHEDIR="$RUN/kube-cache" GPUFRAC_CLUSTER_RUN="$RUN" PATH="$KUBE_BIN:$PATH" "$@"
