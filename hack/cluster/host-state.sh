#!/usr/bin/env bash
# Print what cluster-down must leave as cluster-up found it, for a before/after diff:
#   hack/cluster/host-state.sh >before; make cluster-up; ...; make cluster-down
#   hack/cluster/host-state.sh | diff before -
# Host mounts, network, mount and PID namespaces in use, interfaces, cgroup directories (two levels),
# the kubelet's sysctls, the node paths up.sh may create, and processes with their start time
# (so a pid reused in between still shows).
set -euo pipefail
. "$(cd "$(dirname "$0")" && pwd)/lib.sh"
echo "# mounts"; awk '{print $5, $9}' /proc/self/mountinfo | sort
echo "# namespaces"
for p in /proc/[0-9]*; do
  [ "${p#/proc/}" = $$ ] && continue
  readlink "$p/ns/net" "$p/ns/mnt" "$p/ns/pid" 2>/dev/null || true
done | sort -u
echo "# interfaces"; ip -o link | awk -F': ' '{print $2}' | sort
echo "# cgroups"; for h in $(cgroup_hierarchies); do find "$h" -mindepth 1 -maxdepth 2 -type d; done | sort
echo "# sysctls"; for k in $KUBELET_SYSCTLS; do echo "$k $(cat "/proc/sys/$k")"; done
echo "# paths"; for d in "$RUN" $NS_BINDS /run/containerd /run/cdi /run/netns /run/nri /opt/containerd "$HOME/.kube"; do
  [ -e "$d" ] && ls -a "$d" | sed "s|^|$d/|"; done; true
echo "# processes"
ps -eo pid=,lstart=,comm= | grep -vE ' (ps|grep|sed|sort|awk|host-state.sh|bash)$' | sort -n
