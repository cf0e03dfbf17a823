"""Optional Kubernetes integration: ceilings from pods, allocation records, node labels, Events.

Off (one log line, no calls, `kubernetes` never imported) without a service account or
KUBECONFIG. `kube_from_environment` builds it; the daemon calls `start()`/`stop()`, passes it
to the allocator as its `CeilingSource`, and reports health transitions and refusals to it.
"""

from deviceplugin.kube.integration import KubeIntegration, Settings, kube_from_environment

__all__ = ["KubeIntegration", "Settings", "kube_from_environment"]
