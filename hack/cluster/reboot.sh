#!/usr/bin/env bash
# make cluster-reboot: the node goes down hard and comes back, as after a power cut, with
# the control plane (another machine on a real cluster) kept running:
#  1. everything in the node's PID namespace gets SIGKILL but its PID 1 and the control plane:
#     the kubelet, containerd, the shims, every container, a node agent run as a host process,
#     the MPS daemons (the systemd-run stand-in's units too);
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
proc=$(node_proc)   # the node's /proc: the pid files hold pids as the node sees them

argv_of() { # name -> its command line and environment, NUL-separated, saved for the restart
  local p
  p=$(cat "$RUN/$1.pid") || die "no pid file for $1"
  node_running "$p" || die "$1 ($p) is not running"
  cp "$proc/$p/cmdline" "$RUN/$1.cmdline"
  cp "$proc/$p/environ" "$RUN/$1.environ"
}

# Kept: the node's PID 1 (the namespaces' holder) and the control plane, another machine on
# a real cluster. Everything else in the node's PID namespace is the node's (the containers
# and shims are in it too, in namespaces of their own below it).
CONTROL_PLANE="etcd kube-apiserver kube-controller-manager kube-scheduler"
keep=1
for c in $CONTROL_PLANE; do keep="$keep $(cat "$RUN/$c.pid" 2>/dev/null || true)"; done

node_processes() { # SIGNAL: the node's processes (node pids), signalled when SIGNAL is given
  in_ns python3 - "$keep" "${1:-}" <<'PY'
import os, sys
keep, sig = set(sys.argv[1].split()), sys.argv[2]
for p in os.listdir("/proc"):
    if not p.isdigit() or int(p) == os.getpid() or p in keep:
        continue
    try:
        with open(f"/proc/{p}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                continue
        if sig:
            os.kill(int(p), int(sig))
    except OSError:
        continue
    print(p)
PY
}

t0=$(date +%s.%N)
argv_of kubelet
argv_of containerd
node_processes 9 >/dev/null
deadline=$(($(date +%s) + 15))
while [ -n "$(node_processes)" ]; do
  [ "$(date +%s)" -lt "$deadline" ] || die "still running after SIGKILL: $(node_processes | tr '\n' ' ')"
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
    ["nsenter", "--target", holder, "--net", "--mount", "--pid", "--", "setsid", "sh", "-c",
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
