# Shared by up.sh, down.sh and exec.sh (sourced). No side effects at source time.
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/versions.sh"

# The run directory: pid files, logs, certificates, kubeconfigs and every state directory the
# cluster's processes write. Not under /run, which the cluster's mount namespace replaces.
RUN=${GPUFRAC_CLUSTER_RUN:-/tmp/gpu-fraction-cluster}
NODE_NAME=gf-node
NODE_IP=10.200.0.1          # on a veth inside the cluster's network namespace, no route out
SERVICE_CIDR=10.0.0.0/24
POD_CIDR=10.88.0.0/16       # bridge cni0, also only inside the namespace
API_PORT=6443
# The kubelet's cgroupRoot, in every host hierarchy: named after the run dir, so that down.sh
# for one run dir never touches another's.
CGROUP_PARENT=gpu-fraction-cluster-$(printf '%s' "$RUN" | cksum | cut -d' ' -f1)
# Host-wide sysctls the kubelet sets (k/k pkg/kubelet/cm setupKernelTunables); restored by down.sh.
KUBELET_SYSCTLS="vm/overcommit_memory vm/panic_on_oom kernel/panic kernel/panic_on_oops kernel/keys/root_maxkeys kernel/keys/root_maxbytes"

# Inside the mount namespace (the host never sees these, and no host path is created):
# - /run is a fresh tmpfs, as on a booted node (/var/run/cdi, /run/containerd, /run/netns);
# - /etc, /var/lib and /var/log are overlays of the host's with their upper layer in the run
#   dir, so a path the host lacks (/etc/cdi) can exist there;
# - the node's state directories are bind mounts of run-dir directories on top (containerd's
#   overlayfs snapshotter cannot have an overlay upper layer; /etc/cni/net.d hides the host's;
#   /usr/local/sbin holds the node's systemd-run stand-in, first on a container's PATH).
NS_TMPFS="/run"
NS_OVERLAYS="/etc /var/lib /var/log"
NS_BINDS="/var/lib/kubelet /var/lib/containerd /var/lib/cni /var/log/pods /var/log/containers /etc/cdi /etc/cni/net.d /usr/local/sbin"

# Hermetic: no proxy settings reach the cluster's processes or clients.
unset http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY all_proxy ALL_PROXY

prog=${prog:-cluster}
die() { printf '%s: %s\n' "$prog" "$*" >&2; exit 1; }
say() { printf '%s: %s\n' "$prog" "$*"; }

holder_pid() { # the node's PID 1 (host pid), holding the cluster's namespaces, if alive
  local p
  p=$(cat "$RUN/holder.pid" 2>/dev/null) || return 1
  [ -n "$p" ] && [ -e "/proc/$p/ns/net" ] || return 1
  [ "$(stat -L -c %i "/proc/$p/ns/mnt" 2>/dev/null)" = "$(cat "$RUN/mntns" 2>/dev/null)" ] || return 1
  echo "$p"
}

# Run a command inside the cluster's network, mount and PID namespaces (nsenter forks for the
# PID namespace: the command is its child, and nsenter exits with the command's status).
in_ns() { nsenter --target "$HOLDER" --net --mount --pid -- "$@"; }

# The node's own /proc (its PID namespace's, mounted in its mount namespace), read from the
# host: the pid files in the run dir hold pids as the node sees them, like a node's /run/*.pid.
node_proc() { echo "/proc/$HOLDER/root/proc"; }

node_running() { # node pid: alive and not a zombie, as the node sees it
  local st
  st=$(cat "$(node_proc)/$1/stat" 2>/dev/null) || return 1
  st=${st##*) }
  [ "${st%% *}" != Z ]
}

# Every cgroup hierarchy mounted on this host (v1 controllers, named ones, the v2 tree).
cgroup_hierarchies() {
  awk '$3 == "cgroup" || $3 == "cgroup2" {print $2}' /proc/self/mounts
}
