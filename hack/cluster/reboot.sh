#!/usr/bin/env bash
# make cluster-reboot: the node goes down hard and comes back, as after a power cut, with
# the control plane (another machine on a real cluster) kept running:
#  1. everything on the node gets SIGKILL: the kubelet, containerd, every container (the
#     kubelet's cgroup tree) and every other process in the node's mount namespace (shims, a
#     node agent run as a host process and its MPS daemons), but the control plane's;
#  2. what a reboot empties is emptied: the node's /run tmpfs (CDI specs in /var/run/cdi, MPS
#     pipes, containerd's state, the pods' network namespaces) and the kubelet's volume mounts
#     (a projected token is a tmpfs); the pods' bridge goes; what is on disk stays
#     (/var/lib/kubelet with its checkpoints, /var/lib/containerd, etcd);
#  3. containerd and the kubelet start again with the command lines and environments they had.
# A node agent run as a host process (the test suite's) is the caller's to start again after,
# as a DaemonSet's pod would be started again by the kubelet.
set -euo pipefail
prog=cluster-reboot
. "$(cd "$(dirname "$0")" && pwd)/lib.sh"
[ "$(id -u)" -eq 0 ] || die "must run as root"
HOLDER=$(holder_pid) || die "no cluster is up (run dir $RUN); run make cluster-up"
mntns=$(cat "$RUN/mntns")

argv_of() { # name -> its command line and environment, NUL-separated, saved for the restart
  local p
  p=$(cat "$RUN/$1.pid") || die "no pid file for $1"
  [ "$(stat -L -c %i "/proc/$p/ns/mnt" 2>/dev/null)" = "$mntns" ] || die "$1 ($p) is not running"
  cp "/proc/$p/cmdline" "$RUN/$1.cmdline"
  cp "/proc/$p/environ" "$RUN/$1.environ"
  echo "$p"
}

CONTROL_PLANE="etcd kube-apiserver kube-controller-manager kube-scheduler"
keep="$HOLDER"
for c in $CONTROL_PLANE; do keep="$keep $(cat "$RUN/$c.pid" 2>/dev/null || true)"; done

node_members() { # the node's processes: its mount namespace and the kubelet's cgroup tree
  python3 - "$mntns" "/$CGROUP_PARENT" "$keep" <<'PY'
import os, sys
mnt, parent, keep = sys.argv[1], sys.argv[2], set(sys.argv[3].split())
for p in os.listdir("/proc"):
    if not p.isdigit() or int(p) == os.getpid() or p in keep:
        continue
    try:
        with open(f"/proc/{p}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                continue
        hit = str(os.stat(f"/proc/{p}/ns/mnt").st_ino) == mnt
        if not hit:
            with open(f"/proc/{p}/cgroup") as f:
                hit = any((line.rstrip("\n").split(":", 2)[2] + "/").startswith(parent + "/")
                          for line in f)
    except OSError:
        continue
    if hit:
        print(p)
PY
}

t0=$(date +%s.%N)
kubelet=$(argv_of kubelet)
containerd=$(argv_of containerd)
for p in $(node_members); do kill -KILL "$p" 2>/dev/null || true; done
deadline=$(($(date +%s) + 15))
while [ -e "/proc/$kubelet" ] || [ -e "/proc/$containerd" ] || [ -n "$(node_members)" ]; do
  [ "$(date +%s)" -lt "$deadline" ] || die "still running after SIGKILL: $(node_members | tr '\n' ' ')"
  sleep 0.1
done

# Inside the node: unmount, deepest first, what lies under /run (but /run itself) and the
# kubelet's pod volumes, then empty /run as a fresh boot has it.
in_ns sh -euc '
  awk '"'"'$5 ~ "^/run/." || $5 ~ "^/var/lib/kubelet/pods/" {print $5}'"'"' /proc/self/mountinfo \
    | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
  find /run -mindepth 1 -maxdepth 1 -exec rm -rf {} +
  mkdir -p /run/cdi
  ! ip link show cni0 >/dev/null 2>&1 || ip link del cni0
'

restart() { # name
  local name=$1
  rm -f "$RUN/$name.pid"
  # env -i and the saved environment, then the saved command line (NUL-separated lists)
  python3 - "$RUN" "$name" "$HOLDER" <<'PY'
import os, subprocess, sys
run, name, holder = sys.argv[1:4]
argv = open(f"{run}/{name}.cmdline", "rb").read().rstrip(b"\0").split(b"\0")
env = [e for e in open(f"{run}/{name}.environ", "rb").read().split(b"\0") if e]
log = open(f"{run}/logs/{name}.log", "ab")
subprocess.Popen(
    ["nsenter", "--target", holder, "--net", "--mount", "--", "setsid", "sh", "-c",
     'echo $$ >"$0"; exec "$@"', f"{run}/{name}.pid", "env", "-i", *env, *argv],
    stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
)
PY
  local i
  for i in $(seq 100); do [ -s "$RUN/$name.pid" ] && return; sleep 0.05; done
  die "$name did not start again (see $RUN/logs/$name.log)"
}

restart containerd
for i in $(seq 200); do in_ns test -S /run/containerd/containerd.sock && break; sleep 0.05; done
in_ns test -S /run/containerd/containerd.sock || die "containerd did not come back (see $RUN/logs/containerd.log)"
restart kubelet
say "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "node rebooted in %.1f s", b - a }')"
