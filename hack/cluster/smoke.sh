#!/usr/bin/env bash
# A quick check of a running cluster (make cluster-up first): a busybox pod on the pod network
# is scheduled, started by containerd and runc, gets an address from the bridge CNI, and exits
# 0; its log is printed. One line and exit 1 on failure.
set -euo pipefail
prog=cluster-smoke
. "$(cd "$(dirname "$0")" && pwd)/lib.sh"
x() { "$here/exec.sh" "$@"; }
t0=$(date +%s)
until x kubectl get serviceaccount default >/dev/null 2>&1; do
  [ $(($(date +%s) - t0)) -lt 30 ] || die "no default ServiceAccount within 30 s (kube-controller-manager?)"
  sleep 0.5
done
x kubectl delete pod gf-smoke --ignore-not-found --wait=true >/dev/null
x kubectl apply -f - >/dev/null <<EOF2
apiVersion: v1
kind: Pod
metadata: {name: gf-smoke}
spec:
  restartPolicy: Never
  containers:
  - name: c
    image: $BUSYBOX_IMAGE
    imagePullPolicy: Never
    command: [sh, -c, 'ip -4 -o addr show eth0; ip route; echo smoke-ok']
EOF2
phase=""
until [ "$phase" = Succeeded ]; do
  phase=$(x kubectl get pod gf-smoke -o jsonpath='{.status.phase}')
  [ "$phase" != Failed ] || { x kubectl describe pod gf-smoke | tail -20 >&2; die "pod failed"; }
  [ $(($(date +%s) - t0)) -lt 90 ] || { x kubectl describe pod gf-smoke | tail -20 >&2; die "pod not Succeeded within 90 s (phase $phase)"; }
  sleep 0.5
done
x kubectl logs gf-smoke | sed 's/^/    /'
x kubectl logs gf-smoke | grep -q smoke-ok || die "no smoke-ok in the pod's log"
x kubectl delete pod gf-smoke --wait=true >/dev/null
say "pod ran and exited 0 in $(($(date +%s) - t0)) s"
