"""What an allocated ResourceClaim asks of this driver: its results and the opaque share config.

Pure functions over the API server's JSON (`resource.k8s.io/v1`): `driver_results` checks the UID
and the allocation and keeps this driver's results in this node's pool; `share_config` merges the
opaque `GpuShareConfig` entries that apply to one result (class config first, then the claim's,
later entries winning), refusing unknown fields and bad values with the field's path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from deviceplugin.quantity import QuantityError, parse_quantity

CONFIG_API_VERSION = "gpu-fraction.dev/v1"
CONFIG_KIND = "GpuShareConfig"
_CONFIG_FIELDS = {"apiVersion", "kind", "memoryLimit", "activeThreadPercentage"}


class ClaimError(Exception):
    """The claim cannot be prepared as it stands; the message goes into that claim's `error`."""


@dataclass(frozen=True)
class Result:
    """One allocation result of this driver (`status.allocation.devices.results[]`)."""

    request: str
    pool: str
    device: str
    share_id: str | None
    consumed_memory: int | None  # bytes, from consumedCapacity.memory; None when absent
    admin_access: bool


@dataclass(frozen=True)
class ShareConfig:
    memory_limit: int | None  # bytes: the ceiling declared for the share
    active_thread_percentage: int | None
    source: str | None  # where the ceiling came from, for records; None without config


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if type(value) is dict:  # what JSON decodes to: skip the ABC check
        return value
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ClaimError(f"{path}: not an object")
    return value


def driver_results(claim: Mapping[str, Any], uid: str, driver: str, pool: str) -> list[Result]:
    """This driver's results in `pool`; raises ClaimError for a replaced or unallocated claim."""
    meta = _mapping(claim.get("metadata"), "metadata")
    where = f"ResourceClaim {meta.get('namespace')}/{meta.get('name')}"
    if meta.get("uid") != uid:
        raise ClaimError(f"{where} has UID {meta.get('uid')}, not {uid}: it was replaced")
    allocation = _mapping(claim.get("status"), "status").get("allocation")
    if not allocation:
        raise ClaimError(f"{where} is not allocated")
    devices = _mapping(_mapping(allocation, "status.allocation").get("devices"), "devices")
    results: list[Result] = []
    for i, raw in enumerate(devices.get("results") or []):
        r = _mapping(raw, f"status.allocation.devices.results[{i}]")
        if r.get("driver") != driver or r.get("pool") != pool:
            continue  # another driver's device, or (never expected) another node's
        results.append(_result(r, i))
    if not results:
        raise ClaimError(f"{where} has no device of driver {driver} in pool {pool}")
    return results


def _result(r: Mapping[str, Any], i: int) -> Result:
    path = f"status.allocation.devices.results[{i}]"
    consumed = _mapping(r.get("consumedCapacity"), f"{path}.consumedCapacity")
    memory: int | None = None
    if "memory" in consumed:
        try:
            memory = parse_quantity(consumed["memory"])
        except QuantityError as exc:
            raise ClaimError(f"{path}.consumedCapacity.memory: {exc}") from None
    share = r.get("shareID")
    return Result(
        request=str(r.get("request", "")),
        pool=str(r.get("pool")),
        device=str(r.get("device", "")),
        share_id=str(share) if share else None,
        consumed_memory=memory,
        admin_access=bool(r.get("adminAccess")),
    )


def base_request(request: str) -> str:
    """`request` of a `request/subrequest` result (a `firstAvailable` request's choice), as
    pods name it (k8s.io/dynamic-resource-allocation `resourceclaim.BaseRequestRef`)."""
    return request.split("/", 1)[0]


def _applies(requests: Sequence[str], request: str) -> bool:
    # An entry names requests, or subrequests as `request/sub`; none named means all of them.
    return not requests or request in requests or base_request(request) in requests


def share_config(claim: Mapping[str, Any], driver: str, request: str) -> ShareConfig:
    """The merged GpuShareConfig of this driver that applies to `request`."""
    meta = _mapping(claim.get("metadata"), "metadata")
    allocation = _mapping(_mapping(claim.get("status"), "status").get("allocation"), "allocation")
    configs = _mapping(allocation.get("devices"), "devices").get("config") or []
    limit: int | None = None
    threads: int | None = None
    source: str | None = None
    for i, raw in enumerate(configs):
        path = f"status.allocation.devices.config[{i}]"
        entry = _mapping(raw, path)
        opaque = _mapping(entry.get("opaque"), f"{path}.opaque")
        if opaque.get("driver") != driver or not _applies(entry.get("requests") or [], request):
            continue
        params = _mapping(opaque.get("parameters"), f"{path}.opaque.parameters")
        p = f"{path}.opaque.parameters"
        unknown = sorted(set(params) - _CONFIG_FIELDS)
        if unknown:
            raise ClaimError(f"{p}: unknown fields {unknown} (known: {sorted(_CONFIG_FIELDS)})")
        if params.get("apiVersion") != CONFIG_API_VERSION or params.get("kind") != CONFIG_KIND:
            raise ClaimError(
                f"{p}: want apiVersion {CONFIG_API_VERSION} and kind {CONFIG_KIND}, got "
                f"{params.get('apiVersion')!r} and {params.get('kind')!r}"
            )
        if "memoryLimit" in params:
            try:
                limit = parse_quantity(params["memoryLimit"])
            except QuantityError as exc:
                raise ClaimError(f"{p}.memoryLimit: {exc}") from None
            origin = str(entry.get("source") or "FromClaim")
            source = f"claim {meta.get('namespace')}/{meta.get('name')} config ({origin})"
        if "activeThreadPercentage" in params:
            value = params["activeThreadPercentage"]
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100:
                raise ClaimError(f"{p}.activeThreadPercentage: must be a whole number 1-100")
            threads = value
    return ShareConfig(limit, threads, source)
