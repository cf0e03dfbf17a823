"""What talks to the API server on behalf of both front-ends: the client, backoff, watches.

`client` configures itself from the service account or KUBECONFIG (off, with `kubernetes`
never imported, without either) and retries with backoff; `pods` keeps the pods bound to this
node by list and watch. What one front-end writes or reads (the device-plugin side's ceilings,
allocation records and node labels, the DRA side's slices and claims) lives in that front-end.
Imports only `model` and `plumbing`; it never imports the core's policy or a front-end.
"""
