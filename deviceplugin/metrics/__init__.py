"""Prometheus metrics and the plugin's HTTP endpoints.

`families` owns every metric family on an injected registry (fed by the daemon and the DRA
front-end); `server` serves `/metrics`, `/healthz` and `/readyz`. Imports only `plumbing`.
"""
