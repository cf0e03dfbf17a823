#!/usr/bin/env bash
# make cluster-up: a hermetic single-node Kubernetes from the binaries `make cluster-deps` built.
#
#   hack/cluster/up.sh [KUBERNETES_VERSION]      (default: versions.sh K8S_VERSION;
#                                                 or GPUFRAC_CLUSTER_K8S)
#
# It creates a network, a mount and a PID namespace, like a kind node's: the node's PID 1 is our
# static pause binary (it reaps orphans, and its end ends every process of the node), with the
# node's own /proc. It puts the node's address on a veth there with no route out, replaces the
# node's state paths inside the mount namespace, puts the systemd-run stand-in on the node's
# PATH (deviceplugin/simulate/systemd_run.py: this node has no systemd), then starts containerd,
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the kubelet there, each a
# session leader with a pid file (the node's pid, as on a node's /run). Fresh
# certificates, keys and kubeconfigs every time. It waits for the Node to be Ready, checks the
# DRA feature gates, and prints the run directory. Every wait has a deadline; on any failure
# it prints one line (and the failing log's tail), tears down what it started and exits 1.
#
# Environment: GPUFRAC_CLUSTER_RUN (run dir, default /tmp/gpu-fraction-cluster),
# GPUFRAC_CLUSTER_RUNC (a runc binary other than the one built), GPUFRAC_CLUSTER_FEATURE_GATES
# (replaces the release's --feature-gates string from versions.sh), GPUFRAC_CLUSTER_KEEP=1 (keep
# a failed cluster for inspection), GPUFRAC_CLUSTER_READY_TIMEOUT (seconds, default 60).
# Clients: hack/cluster/exec.sh CMD... runs CMD inside the namespaces with KUBECONFIG set.
# From the host, the node's processes are under /proc/$(cat $RUN/holder.pid)/root/proc.
set -euo pipefail
prog=cluster-up
. "$(cd "$(dirname "$0")" && pwd)/lib.sh"
t_start=$(date +%s.%N)

K8S=${1:-${GPUFRAC_CLUSTER_K8S:-$K8S_VERSION}}
K8S=${K8S#v}
READY_TIMEOUT=${GPUFRAC_CLUSTER_READY_TIMEOUT:-60}

# ---------------------------------------------------------------- preflight: one line each
[ "$(id -u)" -eq 0 ] || die "must run as root (namespaces, mounts, cgroups)"
for t in ip nsenter unshare setsid openssl gcc python3 ss mount; do
  command -v "$t" >/dev/null || die "$t not found (make cluster-deps installs what is missing)"
done
KBIN=$("$here/deps.sh" --print-dir "kubernetes-$K8S")/bin
EBIN=$("$here/deps.sh" --print-dir etcd)/bin
CBIN=$("$here/deps.sh" --print-dir containerd)/bin
RUNC=${GPUFRAC_CLUSTER_RUNC:-$("$here/deps.sh" --print-dir runc)/bin/runc}
for b in "$KBIN"/{kube-apiserver,kube-controller-manager,kube-scheduler,kubelet,kubectl} "$EBIN/etcd" \
  "$CBIN"/{containerd,ctr,containerd-shim-runc-v2} "$RUNC"; do
  [ -x "$b" ] || die "$(basename "$b") missing: $b (run make cluster-deps; other releases: hack/cluster/deps.sh kubernetes-<version>)"
done
for p in bridge host-local loopback; do
  [ -x "/usr/lib/cni/$p" ] || die "CNI plugin /usr/lib/cni/$p missing (apt-get install containernetworking-plugins)"
done
[ -x /bin/busybox ] || die "/bin/busybox missing (apt-get install busybox-static)"
[ -c /dev/kmsg ] || die "/dev/kmsg missing: the kubelet's OOM watcher needs it (ln -s /dev/console /dev/kmsg)"
head -c0 /dev/kmsg 2>/dev/null || die "/dev/kmsg cannot be read"
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then       # cgroup v2
  for c in cpu cpuset memory pids; do
    grep -qw "$c" /sys/fs/cgroup/cgroup.controllers || die "cgroup controller $c not available (cgroup v2)"
  done
else
  for c in cpu cpuacct cpuset memory pids devices freezer; do
    [ -f "/sys/fs/cgroup/$c/cgroup.procs" ] || die "cgroup controller $c not mounted at /sys/fs/cgroup/$c"
  done
fi
if holder_pid >/dev/null; then die "a cluster is already up (run dir $RUN); run make cluster-down first"; fi
if [ -e "$RUN" ]; then die "$RUN exists from an earlier run; run make cluster-down first"; fi
# One cluster per host: the kubelet's host-wide sysctls could not be restored right otherwise.
for h in $(cgroup_hierarchies); do
  for c in "$h"/gpu-fraction-cluster*; do
    [ ! -e "$c" ] || die "another cluster is up on this host, or its remains (cgroup $c); stop it with make cluster-down and its GPUFRAC_CLUSTER_RUN"
  done
done

# ---------------------------------------------------------------- helpers
fail() { # one line, the log's tail, then tear down
  local msg=$1 log=${2:-}
  printf '%s: %s\n' "$prog" "$msg" >&2
  if [ -n "$log" ] && [ -f "$log" ]; then tail -n 15 "$log" | sed 's/^/    /' >&2; fi
  if [ "${GPUFRAC_CLUSTER_KEEP:-}" = 1 ]; then
    printf '%s: kept for inspection: %s (make cluster-down removes it)\n' "$prog" "$RUN" >&2
  else
    "$here/down.sh" >/dev/null 2>&1 || true
  fi
  exit 1
}
trap 'fail "interrupted"' INT TERM
trap 'rc=$?; [ $rc -eq 0 ] || fail "failed at line $LINENO (exit $rc)"' ERR

wait_for() { # description seconds log command... (fails at once if the log's process exits)
  local what=$1 secs=$2 log=$3 deadline name; shift 3
  name=$(basename "$log" .log)
  deadline=$(($(date +%s) + secs))
  until "$@" >/dev/null 2>&1; do
    [ ! -s "$RUN/$name.pid" ] || alive "$name"
    [ "$(date +%s)" -lt "$deadline" ] || fail "$what: not within ${secs} s" "$log"
    sleep 0.2
  done
}

phase() { # seconds since cluster-up started, into logs/phases.log
  python3 -c "import sys,time; print(f'{time.time() - float(sys.argv[1]):6.1f} s  {sys.argv[2]}')" \
    "$t_start" "$1" >>"$RUN/logs/phases.log"
}

port_free() { # inside the namespace: nothing listens on the port yet
  [ -z "$(in_ns ss -Hltn "sport = :$1")" ] || fail "port $1 is busy inside the cluster's namespace"
}

start() { # name command... : a session leader inside the namespaces, pid in $RUN/<name>.pid
  local name=$1; shift
  in_ns setsid sh -c 'echo $$ >"$0"; exec "$@"' "$RUN/$name.pid" "$@" \
    >"$RUN/logs/$name.log" 2>&1 </dev/null &
  disown $!
  local i
  for i in $(seq 50); do [ -s "$RUN/$name.pid" ] && return; sleep 0.05; done
  fail "$name did not start" "$RUN/logs/$name.log"
}

alive() { node_running "$(cat "$RUN/$1.pid")" || fail "$1 exited" "$RUN/logs/$1.log"; }

kubectl() { in_ns "$KBIN/kubectl" --kubeconfig "$RUN/admin.kubeconfig" --cache-dir "$RUN/kube-cache" "$@"; }

# ---------------------------------------------------------------- namespaces
mkdir -p "$RUN"/{logs,pki,etc,manifests,etcd,images,root/usr/local/sbin}
echo "$K8S" >"$RUN/kubernetes-version"
# The node's PID 1: the pause binary, static (it needs nothing from the host's libraries).
gcc -Os -Wall -Werror -static -s -o "$RUN/init" "$here/images/pause.c" 2>"$RUN/logs/init.log" ||
  fail "building the node's init (pause.c)" "$RUN/logs/init.log"
# unshare forks the init into the new PID namespace (--kill-child: the node ends with unshare)
# and mounts the node's own /proc; the init's host pid is unshare's one child.
setsid sh -c 'echo $$ >"$0"; exec "$@"' "$RUN/unshare.pid" unshare --net --mount --pid --fork \
  --kill-child --mount-proc --propagation private -- "$RUN/init" </dev/null >/dev/null 2>&1 &
disown $!
HOLDER=""
for _ in $(seq 50); do
  if [ -s "$RUN/unshare.pid" ]; then
    u=$(cat "$RUN/unshare.pid")
    HOLDER=$(cat "/proc/$u/task/$u/children" 2>/dev/null || true)
    HOLDER=${HOLDER// }
    [ -z "$HOLDER" ] || break
  fi
  sleep 0.05
done
[ -n "$HOLDER" ] || fail "unshare could not create the namespaces"
echo "$HOLDER" >"$RUN/holder.pid"
# unshare has replaced its namespaces once /proc/<pid>/ns/mnt differs from ours
for _ in $(seq 50); do
  [ "$(stat -L -c %i "/proc/$HOLDER/ns/mnt")" != "$(stat -L -c %i /proc/self/ns/mnt)" ] && break; sleep 0.05
done
stat -L -c %i "/proc/$HOLDER/ns/mnt" >"$RUN/mntns"
stat -L -c %i "/proc/$HOLDER/ns/net" >"$RUN/netns"
stat -L -c %i "/proc/$HOLDER/ns/pid" >"$RUN/pidns"
[ "$(cat "$RUN/pidns")" != "$(stat -L -c %i /proc/self/ns/pid)" ] || fail "unshare did not create a PID namespace"
[ -d "$(node_proc)/1" ] && [ "$(in_ns sh -c 'echo $PPID')" = 0 ] ||
  fail "the node's PID namespace has no /proc of its own"
[ "$(cat "$RUN/mntns")" != "$(stat -L -c %i /proc/self/ns/mnt)" ] || fail "unshare did not create a mount namespace"

# Cgroups: the kubelet's cgroupRoot in every hierarchy (cpuset needs its cpus and mems filled).
for h in $(cgroup_hierarchies); do
  mkdir "$h/$CGROUP_PARENT"
  if [ -f "$h/cpuset.cpus" ] && [ -f "$h/$CGROUP_PARENT/cpuset.cpus" ]; then
    cat "$h/cpuset.cpus" >"$h/$CGROUP_PARENT/cpuset.cpus"
    cat "$h/cpuset.mems" >"$h/$CGROUP_PARENT/cpuset.mems"
  fi
done

in_ns bash -euo pipefail -c '
  run=$1 node_ip=$2 node_name=$3 tmpfs=$4 overlays=$5 binds=$6
  ip link set lo up
  ip link add gf0 type veth peer name gf1
  ip addr add "$node_ip/24" dev gf0
  ip link set gf0 up
  ip link set gf1 up
  mount --make-rshared /
  for d in $tmpfs; do mount -t tmpfs -o mode=0755 tmpfs "$d"; done
  mkdir -p /run/cdi                       # = /var/run/cdi, the plugin'"'"'s CDI directory
  for d in $overlays; do
    o=$run/overlay$d; mkdir -p "$o/upper" "$o/work"
    mount -t overlay overlay -o "lowerdir=$d,upperdir=$o/upper,workdir=$o/work" "$d"
  done
  for d in $binds; do mkdir -p "$run/root$d" "$d"; mount --bind "$run/root$d" "$d"; done
  # No name server (a lookup stays on the loopback); the node name resolves to its address.
  rm -f /etc/hosts /etc/resolv.conf     # in the overlay: the host keeps its own (or links)
  printf "127.0.0.1 localhost\n::1 localhost\n%s %s\n" "$node_ip" "$node_name" >/etc/hosts
  : >/etc/resolv.conf
' sh "$RUN" "$NODE_IP" "$NODE_NAME" "$NS_TMPFS" "$NS_OVERLAYS" "$NS_BINDS"
[ -z "$(in_ns ip route show default)" ] || fail "the cluster's namespace has a default route"

# systemd-run on the node's PATH (/usr/local/sbin, bound from the run dir in the node's mount
# namespace only): the stand-in that starts transient units as systemd would, in cgroups under
# the kubelet's cgroupRoot (mps.launcher host-systemd: nsenter -t 1 -m -- systemd-run ...).
cat >"$RUN/root/usr/local/sbin/systemd-run" <<EOF
#!/bin/sh
# This node has no systemd: deviceplugin/simulate/systemd_run.py stands in (hack/cluster/up.sh).
SYSTEMD_RUN_SIM_CGROUP_ROOT='/$CGROUP_PARENT' exec '$(command -v python3)' -I '$(cd "$here/../.." && pwd)/deviceplugin/simulate/systemd_run.py' "\$@"
EOF
chmod 755 "$RUN/root/usr/local/sbin/systemd-run"

# ---------------------------------------------------------------- containerd
# Where this host denies lowering oom_score_adj (no CAP_SYS_RESOURCE in the bounding set, as in
# some VM sandboxes), runc cannot give the sandbox containerd's -998 and every pod fails; then
# containerd's own knob for that case keeps each container's score at or above its own.
restrict_oom=false
if ! sh -c 'echo -1 >/proc/self/oom_score_adj' 2>/dev/null; then
  restrict_oom=true
  echo "this host denies a negative oom_score_adj: containerd restrict_oom_score_adj = true" >"$RUN/logs/notes.log"
fi
cat >"$RUN/etc/containerd.toml" <<EOF
version = 4
root = '/var/lib/containerd'
state = '/run/containerd'
imports = []
[plugins.'io.containerd.server.v1.grpc']
  address = '/run/containerd/containerd.sock'
[plugins.'io.containerd.server.v1.ttrpc']
  address = '/run/containerd/containerd.sock.ttrpc'
# Defaults that would write outside the private paths (/opt/containerd, /run/nri).
[plugins.'io.containerd.internal.v1.opt']
  path = '/var/lib/containerd/opt'
[plugins.'io.containerd.nri.v1.nri']
  socket_path = '/run/containerd/nri/nri.sock'
[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = '$PAUSE_IMAGE'
[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = $restrict_oom
  enable_cdi = true
  cdi_spec_dirs = ['/etc/cdi', '/var/run/cdi']
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = 'runc'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = '$RUNC'
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['/usr/lib/cni']
    conf_dir = '/etc/cni/net.d'
    max_conf_num = 1
[plugins.'io.containerd.grpc.v1.cri']
  disable_tcp_service = true
  stream_server_address = '127.0.0.1'
EOF
cat >"$RUN/root/etc/cni/net.d/10-gf.conflist" <<EOF
{"cniVersion": "1.0.0", "name": "gf-net", "plugins": [{"type": "bridge", "bridge": "cni0",
 "isGateway": true, "ipMasq": false, "hairpinMode": true,
 "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}]}}]}
EOF
phase "containerd"
start containerd env PATH="$CBIN:/usr/sbin:/usr/bin:/sbin:/bin" "$CBIN/containerd" --config "$RUN/etc/containerd.toml"

# ---------------------------------------------------------------- etcd
port_free 2379; port_free 2380
phase "etcd"
start etcd "$EBIN/etcd" --name gf --data-dir "$RUN/etcd" \
  --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
  --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
  --initial-cluster gf=http://127.0.0.1:2380 --log-level warn

# ---------------------------------------------------------------- certificates and kubeconfigs
# (while etcd and containerd start). ECDSA P-256 throughout: an RSA key costs about a second
# of a busy 2-core machine, eleven of them most of the Ready budget.
(
  cd "$RUN/pki"
  exec 2>"$RUN/logs/pki.log"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ca.key -out ca.crt -days 7 -subj /CN=gf-cluster-ca
  sign() { # file CN O extensions
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$1.key" -out "$1.csr" -subj "/CN=$2${3:+/O=$3}"
    openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 7 -out "$1.crt" \
      -extfile <(printf '%s\n' "$4")
    rm "$1.csr"
  }
  sign apiserver kube-apiserver "" "subjectAltName=DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:127.0.0.1,IP:$NODE_IP,IP:10.0.0.1
extendedKeyUsage=serverAuth"
  sign admin admin system:masters extendedKeyUsage=clientAuth
  sign kcm system:kube-controller-manager "" extendedKeyUsage=clientAuth
  sign scheduler system:kube-scheduler "" extendedKeyUsage=clientAuth
  sign kubelet "system:node:$NODE_NAME" system:nodes extendedKeyUsage=clientAuth
  sign apiserver-kubelet kube-apiserver-kubelet-client "" extendedKeyUsage=clientAuth
  # The request-header (front-proxy) CA and the API server's client for aggregated APIs;
  # without them the controller-manager and the scheduler log a missing CA bundle forever.
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout front-proxy-ca.key -out front-proxy-ca.crt -days 7 \
    -subj /CN=gf-front-proxy-ca
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout front-proxy-client.key -out front-proxy-client.csr -subj /CN=front-proxy-client
  openssl x509 -req -in front-proxy-client.csr -CA front-proxy-ca.crt -CAkey front-proxy-ca.key -CAcreateserial \
    -days 7 -out front-proxy-client.crt -extfile <(echo extendedKeyUsage=clientAuth)
  rm front-proxy-client.csr
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out sa.key
  openssl pkey -in sa.key -pubout -out sa.pub
) >/dev/null || fail "certificates" "$RUN/logs/pki.log"
for u in admin kcm scheduler kubelet; do
  cat >"$RUN/$u.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters: [{name: gf, cluster: {server: 'https://127.0.0.1:$API_PORT', certificate-authority: '$RUN/pki/ca.crt'}}]
users: [{name: $u, user: {client-certificate: '$RUN/pki/$u.crt', client-key: '$RUN/pki/$u.key'}}]
contexts: [{name: gf, context: {cluster: gf, user: $u}}]
current-context: gf
EOF
done

# ---------------------------------------------------------------- feature gates per release
case $K8S in
  1.36.*) GATES=$FEATURE_GATES_1_36; RUNTIME_CONFIG=$RUNTIME_CONFIG_1_36 ;;
  1.37.*) GATES=$FEATURE_GATES_1_37; RUNTIME_CONFIG=$RUNTIME_CONFIG_1_37 ;;
  *) fail "no feature-gate table for Kubernetes $K8S (versions.sh)" ;;
esac
# An experiment may replace the string (the required gates are still checked below).
GATES=${GPUFRAC_CLUSTER_FEATURE_GATES-$GATES}

# ---------------------------------------------------------------- kube-apiserver
phase "wait for etcd /health"
wait_for "etcd /health" 20 "$RUN/logs/etcd.log" in_ns python3 -c '
import json, sys, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
sys.exit(json.load(opener.open("http://127.0.0.1:2379/health", timeout=1)).get("health") != "true")'
port_free "$API_PORT"
phase "kube-apiserver"
start kube-apiserver "$KBIN/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 \
  --bind-address=0.0.0.0 --secure-port="$API_PORT" --advertise-address="$NODE_IP" \
  --tls-cert-file="$RUN/pki/apiserver.crt" --tls-private-key-file="$RUN/pki/apiserver.key" \
  --client-ca-file="$RUN/pki/ca.crt" \
  --kubelet-client-certificate="$RUN/pki/apiserver-kubelet.crt" --kubelet-client-key="$RUN/pki/apiserver-kubelet.key" \
  --service-account-issuer=https://kubernetes.default.svc --service-account-key-file="$RUN/pki/sa.pub" \
  --service-account-signing-key-file="$RUN/pki/sa.key" --service-cluster-ip-range="$SERVICE_CIDR" \
  --kubelet-preferred-address-types=InternalIP,Hostname \
  --requestheader-client-ca-file="$RUN/pki/front-proxy-ca.crt" --requestheader-allowed-names=front-proxy-client \
  --requestheader-username-headers=X-Remote-User --requestheader-group-headers=X-Remote-Group \
  --requestheader-extra-headers-prefix=X-Remote-Extra- \
  --proxy-client-cert-file="$RUN/pki/front-proxy-client.crt" --proxy-client-key-file="$RUN/pki/front-proxy-client.key" \
  --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction --allow-privileged=true \
  ${GATES:+--feature-gates="$GATES"} ${RUNTIME_CONFIG:+--runtime-config="$RUNTIME_CONFIG"} --v=1

# ---------------------------------------------------------------- images (while the API server starts)
phase "images"
"$here/images/build.sh" "$RUN/images" >"$RUN/logs/images.log" 2>&1 || fail "building images" "$RUN/logs/images.log"
wait_for "containerd socket" 20 "$RUN/logs/containerd.log" \
  in_ns "$CBIN/ctr" --address /run/containerd/containerd.sock version
for i in pause busybox; do
  in_ns "$CBIN/ctr" --address /run/containerd/containerd.sock -n k8s.io images import \
    --platform linux/amd64 "$RUN/images/$i.tar" >>"$RUN/logs/images.log" 2>&1 ||
    fail "importing the $i image" "$RUN/logs/images.log"
done

phase "wait for kube-apiserver /readyz"
wait_for "kube-apiserver /readyz" 60 "$RUN/logs/kube-apiserver.log" kubectl get --raw /readyz
kubectl create clusterrolebinding gf-apiserver-kubelet --clusterrole=system:kubelet-api-admin \
  --user=kube-apiserver-kubelet-client >/dev/null

# ---------------------------------------------------------------- controller-manager, scheduler
port_free 10257; port_free 10259
phase "kube-controller-manager and kube-scheduler"
start kube-controller-manager "$KBIN/kube-controller-manager" --kubeconfig="$RUN/kcm.kubeconfig" \
  --authentication-kubeconfig="$RUN/kcm.kubeconfig" --authorization-kubeconfig="$RUN/kcm.kubeconfig" \
  --service-account-private-key-file="$RUN/pki/sa.key" --root-ca-file="$RUN/pki/ca.crt" \
  --cluster-signing-cert-file="$RUN/pki/ca.crt" --cluster-signing-key-file="$RUN/pki/ca.key" \
  --use-service-account-credentials --controllers='*' --leader-elect=false --bind-address=127.0.0.1 \
  ${GATES:+--feature-gates="$GATES"} --v=1
cat >"$RUN/etc/scheduler.yaml" <<EOF
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection: {kubeconfig: '$RUN/scheduler.kubeconfig'}
leaderElection: {leaderElect: false}
EOF
start kube-scheduler "$KBIN/kube-scheduler" --config="$RUN/etc/scheduler.yaml" \
  --authentication-kubeconfig="$RUN/scheduler.kubeconfig" --authorization-kubeconfig="$RUN/scheduler.kubeconfig" \
  --bind-address=127.0.0.1 ${GATES:+--feature-gates="$GATES"} --v=1

# ---------------------------------------------------------------- kubelet
gates_yaml="{}"
if [ -n "$GATES" ]; then
  gates_yaml="{$(echo "$GATES" | sed 's/=/: /g; s/,/, /g')}"
fi
cat >"$RUN/etc/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /$CGROUP_PARENT
failSwapOn: false
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: '$RUN/pki/ca.crt'}
authorization: {mode: Webhook}
resolvConf: /etc/resolv.conf   # the namespace's: empty
staticPodPath: '$RUN/manifests'
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
featureGates: $gates_yaml
EOF
# The kubelet sets host-wide kernel tunables (vm.overcommit_memory, kernel.panic, ...) where
# protectKernelDefaults is false; down.sh writes back what they were.
for k in $KUBELET_SYSCTLS; do echo "$k $(cat "/proc/sys/$k")"; done >"$RUN/sysctl.saved"
port_free 10250
phase "kubelet"
start kubelet "$KBIN/kubelet" --config="$RUN/etc/kubelet.yaml" --kubeconfig="$RUN/kubelet.kubeconfig" \
  --hostname-override="$NODE_NAME" --node-ip="$NODE_IP" --v=1

# ---------------------------------------------------------------- Node Ready
deadline=$(( ${t_start%.*} + READY_TIMEOUT ))
until [ "$(kubectl get node "$NODE_NAME" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ]; do
  for c in containerd etcd kube-apiserver kube-controller-manager kube-scheduler kubelet; do alive "$c"; done
  [ "$(date +%s)" -lt "$deadline" ] || fail "Node $NODE_NAME not Ready within ${READY_TIMEOUT} s of cluster-up" "$RUN/logs/kubelet.log"
  sleep 0.5
done
phase "(Node Ready)"
t_ready=$(date +%s.%N)

# ---------------------------------------------------------------- the DRA gates, as the components report them
gates_off() { # metrics path -> the required gates not reported enabled (empty: all on)
  local m g off=""
  m=$(kubectl get --raw "$1" 2>/dev/null | grep '^kubernetes_feature_enabled{') || { echo "(no metrics)"; return; }
  for g in $REQUIRED_GATES; do echo "$m" | grep -q "name=\"$g\".* 1\$" || off="$off $g"; done
  echo "$off"
}
phase "feature gates"
off=$(gates_off /metrics)
[ -z "$off" ] || fail "feature gates not enabled on kube-apiserver $K8S:$off"
deadline=$(($(date +%s) + 20))     # the kubelet's metrics answer through the API server's proxy
until off=$(gates_off "/api/v1/nodes/$NODE_NAME/proxy/metrics"); [ -z "$off" ]; do
  [ "$(date +%s)" -lt "$deadline" ] || fail "feature gates not enabled on the kubelet $K8S:$off" "$RUN/logs/kubelet.log"
  sleep 0.5
done

cat >"$RUN/env" <<EOF
# Sourced by hack/cluster/exec.sh and by tests.
GPUFRAC_CLUSTER_RUN='$RUN'
KUBECONFIG='$RUN/admin.kubeconfig'
KUBECACHEDIR='$RUN/kube-cache'
KUBERNETES_VERSION='$K8S'
KUBE_BIN='$KBIN'
NODE_NAME='$NODE_NAME'
NODE_IP='$NODE_IP'
EOF
trap - ERR INT TERM
say "Kubernetes v$K8S: Node $NODE_NAME Ready in $(python3 -c "print(f'{$t_ready - $t_start:.1f}')") s"
say "run dir $RUN (kubeconfig $RUN/admin.kubeconfig, logs $RUN/logs); clients: hack/cluster/exec.sh kubectl get nodes"
