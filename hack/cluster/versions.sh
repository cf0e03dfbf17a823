# Versions of the cluster components (sourced by hack/cluster/*.sh).
K8S_VERSION=1.37.2          # the release the suite runs by default
K8S_OLD_VERSION=1.36.3      # the oldest release whose staging modules the module proxy serves (v0.36.x)
ETCD_VERSION=3.6.17
CONTAINERD_VERSION=2.3.7
RUNC_VERSION=1.4.4
CLUSTER_PACKAGES="gcc libc6-dev pkgconf libseccomp-dev containernetworking-plugins iproute2 openssl busybox-static util-linux"
# Images built locally (hack/cluster/images) and imported; never pulled.
PAUSE_IMAGE=localhost/gpu-fraction/pause:1
BUSYBOX_IMAGE=localhost/gpu-fraction/busybox:1
# DRA feature gates the plugin needs: up.sh fails unless kube-apiserver reports each enabled.
REQUIRED_GATES="DRAConsumableCapacity DRADeviceTaints DRAResourceClaimDeviceStatus ResourceHealthStatus"
# What each release needs set beyond its defaults (one string for every component), and the
# API versions to serve. 1.36: DeviceTaintRule is beta and off by default (v1beta2).
FEATURE_GATES_1_36="DRADeviceTaintRules=true"
RUNTIME_CONFIG_1_36="resource.k8s.io/v1beta2=true"
FEATURE_GATES_1_37=""
RUNTIME_CONFIG_1_37=""
