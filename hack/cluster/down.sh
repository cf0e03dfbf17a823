#!/usr/bin/env bash
# make cluster-down: stop the cluster that up.sh started and leave nothing behind: no process,
# mount, namespace, cgroup, interface or file. Safe to run twice, or after a failed cluster-up.
#
# The daemons get SIGTERM first (the kubelet first); then the node's PID 1 gets SIGKILL, which
# ends every process in the node's PID namespace (the daemons, containerd's shims and the
# containers, MPS daemons, anything run with exec.sh). A last sweep finds by id whatever is
# left in the node's mount, network or PID namespace or in the kubelet's cgroup tree (nsenter
# and unshare themselves live on the host's side). Mounts, the veth, cni0 and the pods'
# network namespaces live only in the cluster's namespaces and go with them.
set -euo pipefail
prog=cluster-down
. "$(cd "$(dirname "$0")" && pwd)/lib.sh"
[ "$(id -u)" -eq 0 ] || die "must run as root"

mntns=$(cat "$RUN/mntns" 2>/dev/null || true)
netns=$(cat "$RUN/netns" 2>/dev/null || true)
pidns=$(cat "$RUN/pidns" 2>/dev/null || true)
# Never the host's own namespaces (a half-made run dir must not turn this into a host sweep).
[ "$mntns" != "$(stat -L -c %i /proc/self/ns/mnt)" ] || mntns=""
[ "$netns" != "$(stat -L -c %i /proc/self/ns/net)" ] || netns=""
[ "$pidns" != "$(stat -L -c %i /proc/self/ns/pid)" ] || pidns=""
HOLDER=$(holder_pid || true)

members() { # host pids of the cluster's processes (one python3, no fork per pid)
  python3 - "$mntns" "$netns" "$pidns" "/$CGROUP_PARENT" <<'PY'
import os, sys
mnt, net, pid, parent = sys.argv[1:5]
for p in os.listdir("/proc"):
    if not p.isdigit() or int(p) == os.getpid():
        continue
    try:
        with open(f"/proc/{p}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # exited, awaiting its parent's wait: holds no namespace
        ino = lambda ns: str(os.stat(f"/proc/{p}/ns/{ns}").st_ino)
        hit = (mnt and ino("mnt") == mnt) or (net and ino("net") == net) or (
            pid and ino("pid") == pid)
        if not hit:
            with open(f"/proc/{p}/cgroup") as f:
                hit = any(line.rstrip("\n").split(":", 2)[2] == parent or
                          line.rstrip("\n").split(":", 2)[2].startswith(parent + "/") for line in f)
    except OSError:
        continue
    if hit:
        print(p)
PY
}

wait_gone() { # seconds; 0 when no member is left
  local deadline=$(($(date +%s) + $1))
  while [ -n "$(members)" ]; do
    [ "$(date +%s)" -lt "$deadline" ] || return 1
    sleep 0.2
  done
}

signal_pidfiles() { # signal name... : the node's pids in the pid files, signalled inside it
  local c p pids=""
  for c in "${@:2}"; do
    p=$(cat "$RUN/$c.pid" 2>/dev/null) || continue
    ! node_running "$p" || pids="$pids $p"
  done
  [ -z "$pids" ] || in_ns kill "-$1" $pids 2>/dev/null || true
}

n=$(members | wc -l)
if [ "$n" -gt 0 ]; then
  if [ -n "$HOLDER" ]; then
    # The kubelet first, so that it restarts nothing; then the control plane and containerd.
    signal_pidfiles TERM kubelet
    signal_pidfiles TERM kube-scheduler kube-controller-manager kube-apiserver containerd etcd
    deadline=$(($(date +%s) + 5))
    for c in kubelet kube-scheduler kube-controller-manager kube-apiserver containerd etcd; do
      p=$(cat "$RUN/$c.pid" 2>/dev/null) || continue
      while node_running "$p" && [ "$(date +%s)" -lt "$deadline" ]; do sleep 0.1; done
    done
    # The node's PID 1: the kernel kills every process of its PID namespace with it.
    kill -KILL "$HOLDER" 2>/dev/null || true
  fi
  # Then whatever is left (nsenter and unshare on the host's side; all of it after a cluster-up
  # that failed before the PID namespace), at once.
  for p in $(members); do kill -KILL "$p" 2>/dev/null || true; done
  wait_gone 15 || die "processes still running after SIGKILL: $(members | tr '\n' ' ')"
fi

# The host-wide kernel tunables the kubelet changed.
if [ -f "$RUN/sysctl.saved" ]; then
  while read -r k v; do
    [ "$(cat "/proc/sys/$k")" = "$v" ] || echo "$v" >"/proc/sys/$k"
  done <"$RUN/sysctl.saved"
fi

# The kubelet's cgroups, deepest first, in every hierarchy.
for h in $(cgroup_hierarchies); do
  [ -d "$h/$CGROUP_PARENT" ] || continue
  find "$h/$CGROUP_PARENT" -depth -type d -exec rmdir {} + 2>/dev/null ||
    die "cannot remove cgroup $h/$CGROUP_PARENT: $(find "$h/$CGROUP_PARENT" -name cgroup.procs -size +0 2>/dev/null | head -1)"
done

if [ -e "$RUN" ]; then
  rm -rf "$RUN"
  say "stopped $n processes; removed $RUN"
else
  say "no cluster (run dir $RUN absent)"
fi
