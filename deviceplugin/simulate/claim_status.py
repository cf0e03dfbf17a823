"""What the stand-in API server checks on a write of a ResourceClaim's status, as the real one.

Two rules a driver can trip over. The allocation and reservedFor belong to the scheduler:
changing them needs `resourceclaims/binding`, which a node agent never has (the API server
asks RBAC: `dra_apiserver.py`), and "changed"
is decided on opaque parameters as the raw bytes their creator sent (a RawExtension), so a
client that decodes and re-encodes them changes them. `status.devices` is a list-map keyed
by driver/device/pool/shareID whose entries a server-side apply merges per field manager.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Sequence
from typing import Any

Obj = dict[str, Any]
Key = tuple[Any, Any, Any, Any]  # (driver, device, pool, shareID), the list-map keys
# Where the opaque parameters of a claim's allocation sit, in a claim or a status write.
CONFIG = ("status", "allocation", "devices", "config")


class Invalid(Exception):
    """422: the object fails the API server's validation."""


class Conflict(Exception):
    """409: an apply without force would take fields another field manager owns."""


_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")


def _skip(text: str, at: int) -> int:
    return _SPACE.match(text, at).end()  # type: ignore[union-attr]  # always matches


def _member(text: str, at: int, step: str | int) -> int | None:
    """Where the value of `step` (an object's key, an array's index) in the value at `at`
    begins, or None."""
    opening = text[at]
    if opening not in "{[" or (opening == "{") != isinstance(step, str):
        return None
    closing = "}" if opening == "{" else "]"
    at, index = _skip(text, at + 1), 0
    while text[at] != closing:
        hit = index == step
        if opening == "{":
            key, at = _DECODER.raw_decode(text, at)
            at = _skip(text, _skip(text, at) + 1)  # past the ':'
            hit = key == step
        if hit:
            return at
        _, at = _DECODER.raw_decode(text, at)
        at = _skip(text, at)
        if text[at] == ",":
            at = _skip(text, at + 1)
        index += 1
    return None


def raw_at(text: str, path: Sequence[str | int]) -> str | None:
    """The exact text of the JSON value at `path` in the document `text`, or None."""
    at: int | None = _skip(text, 0)
    for step in path:
        at = _member(text, at, step) if at is not None else None
    if at is None:
        return None
    _, end = _DECODER.raw_decode(text, at)
    return text[at:end]


def opaque_raws(obj: Obj, text: str) -> dict[int, str]:
    """config index → the raw text of its opaque parameters, in a claim (or a status write)
    `obj` that arrived as `text`."""
    configs = ((obj.get("status") or {}).get("allocation") or {}).get("devices") or {}
    out = {}
    for i, c in enumerate(configs.get("config") or []):
        raw = raw_at(text, [*CONFIG, i, "opaque", "parameters"])
        if (c.get("opaque") or {}).get("parameters") is not None and raw is not None:
            out[i] = raw
    return out


def _pruned(value: Any) -> Any:
    """Empty and absent alike, as equality.Semantic.DeepEqual treats nil and empty."""
    if isinstance(value, dict):
        out = {k: _pruned(v) for k, v in value.items()}
        return {k: v for k, v in out.items() if v not in (None, {}, [])}
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    return value


def _binding(status: Obj, raws: dict[int, str]) -> Any:
    allocation = copy.deepcopy(status.get("allocation"))
    for i, c in enumerate(((allocation or {}).get("devices") or {}).get("config") or []):
        if (c.get("opaque") or {}).get("parameters") is not None:
            c["opaque"]["parameters"] = raws.get(i)  # the bytes, as a RawExtension compares
    return _pruned({"allocation": allocation, "reservedFor": status.get("reservedFor")})


def binding_changed(old: Obj, old_raws: dict[int, str], new: Obj, new_raws: dict[int, str]) -> bool:
    """k8s pkg/registry/resource/utils.go, AuthorizedForBinding (called by the status
    strategy's ValidateUpdate in pkg/registry/resource/resourceclaim/strategy.go): a status
    write whose allocation or reservedFor is not semantically equal to the stored one needs
    `resourceclaims/binding` with the request's verb (the agent never has it)."""
    return bool(_binding(old, old_raws) != _binding(new, new_raws))


def modified_drivers(old: Obj, new: Obj) -> set[str]:
    """pkg/registry/resource/utils.go, getModifiedDrivers: the drivers whose
    `status.devices` entries were added, changed or removed."""
    before = {key(d): d for d in old.get("devices") or []}
    drivers = set()
    for d in new.get("devices") or []:
        if _pruned(before.pop(key(d), None)) != _pruned(d):
            drivers.add(d.get("driver"))
    return drivers | {d.get("driver") for d in before.values()}


def allocated_node(allocation: Obj | None) -> str:
    """pkg/registry/resource/utils.go, nodeNameFromAllocation: the node of a selector with
    one term of one `metadata.name In [node]` field, else none."""
    terms = ((allocation or {}).get("nodeSelector") or {}).get("nodeSelectorTerms") or []
    if len(terms) != 1 or terms[0].get("matchExpressions"):
        return ""
    fields = terms[0].get("matchFields") or []
    if len(fields) != 1:
        return ""
    f = fields[0]
    values = f.get("values") or []
    if f.get("key") != "metadata.name" or f.get("operator") != "In" or len(values) != 1:
        return ""
    return str(values[0])


def key(entry: Obj) -> Key:
    """staging/src/k8s.io/api/resource/v1/types.go, ResourceClaimStatus.Devices:
    `+listType=map`, `+listMapKey=driver`, `device`, `pool`, `shareID`."""
    return (entry.get("driver"), entry.get("device"), entry.get("pool"), entry.get("shareID"))


def apply_devices(
    live: list[Obj], applied: list[Obj], manager: str, owners: dict[str, set[Key]], force: bool
) -> list[Obj]:
    """A server-side apply of `applied` as `manager` to the list-map `live`: the entries the
    manager applied before and no longer sends go (unless another manager owns them too),
    the ones it sends are set, every other entry stays. Ownership is per entry here (the
    real server tracks each field; one driver writes a whole entry). Updates `owners`."""
    sent = {key(e): e for e in applied}
    if len(sent) != len(applied):
        raise Invalid("status.devices: Duplicate value: an entry is listed twice")
    others = {k for m, keys in owners.items() if m != manager for k in keys}
    current = {key(e): e for e in live}
    taken = [k for k in sent if k in others and current.get(k) != sent[k]]
    if taken and not force:
        raise Conflict(f"Apply failed with {len(taken)} conflict(s): .status.devices{taken}")
    dropped = owners.get(manager, set()) - set(sent) - others
    out = [sent.get(key(e), e) for e in live if key(e) not in dropped]
    out += [e for k, e in sent.items() if k not in current]
    for m in owners:
        if m != manager and force:
            owners[m] -= set(sent)
    owners[manager] = set(sent)
    return copy.deepcopy(out)


def managed_fields(owners: dict[str, set[Key]], now: str) -> list[Obj]:
    """`metadata.managedFields` for the status appliers, as the real server lists them."""

    def element(k: Key) -> str:
        fields = dict(zip(("driver", "device", "pool", "shareID"), k, strict=True))
        present = {n: v for n, v in sorted(fields.items()) if v is not None}
        return "k:" + json.dumps(present, separators=(",", ":"))

    return [
        {
            "manager": m,
            "operation": "Apply",
            "apiVersion": "resource.k8s.io/v1",
            "time": now,
            "fieldsType": "FieldsV1",
            "fieldsV1": {
                "f:status": {"f:devices": {element(k): {".": {}} for k in sorted(keys, key=str)}}
            },
            "subresource": "status",
        }
        for m, keys in sorted(owners.items())
    ]
