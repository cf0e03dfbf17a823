"""The stand-in API server's `resource.k8s.io/v1` part: ResourceSlices, ResourceClaims and
DeviceClasses, as strict as the real server where the plugin could get it wrong.

Slices: every write is validated against the 1.36 and 1.37 schemas (strict; compiled once,
with the dev extra's kubernetes-validate, which the tests always have) and as the API
server does (at most 128 devices, 64 with taints; a `requestPolicy` only on multi-allocatable
devices, its `default` and `max` on the `min + n*step` grid, `min + step` within the
value; a refusal names the device by index, as the real message does); create (409 when
the name exists), replace (409 on a stale resourceVersion), delete, list and watch with the
`spec.nodeName` / `spec.driver` field selectors and `k=v` label selectors the client sends.
Device taints as the API server validates them (a qualified key, a label value, a known
effect, at most 16 per device). With `drop_consumable` the server plays one with
`DRAConsumableCapacity` off: it silently drops `allowMultipleAllocations` and
`requestPolicy`; with `drop_taints` one with `DRADeviceTaints` off (the default before 1.36):
it silently drops `taints`. Claims: GET, list, watch, and on the `status` subresource UPDATE
(409 on a stale resourceVersion) and server-side apply (`status.devices` merged per field
manager); either way `status.devices[]` only for allocated results, validated against the
schemas, and a changed allocation or reservedFor refused as the real server refuses a caller
without `resourceclaims/binding` (opaque parameters compared as the raw text their creator
sent: `claim_status.py`). Over 400 lines on purpose: the rules of one API group, under one
lock.
"""

from __future__ import annotations

import copy
import datetime
import functools
import importlib.util
import json
import re
import uuid
from collections.abc import Callable
from typing import Any

from deviceplugin.quantity import format_quantity, parse_quantity
from deviceplugin.simulate import claim_status, rbac
from deviceplugin.simulate.api_versions import Versions
from deviceplugin.simulate.claim_status import Conflict, Invalid

__all__ = ["GROUP", "Conflict", "DraStore", "Invalid", "validate_claim_status", "validate_slice"]

Obj = dict[str, Any]
GROUP = ["apis", "resource.k8s.io", "v1"]
APPLY_PATCH = "application/apply-patch+yaml"


def _selector_match(obj: Obj, field_selector: str, label_selector: str) -> bool:
    spec = obj.get("spec") or {}
    fields = {
        "spec.nodeName": spec.get("nodeName"),
        "spec.driver": spec.get("driver"),
        "metadata.name": obj["metadata"]["name"],
    }
    for term in filter(None, field_selector.split(",")):
        key, _, value = term.partition("=")
        if key not in fields:
            raise Invalid(f"field label not supported: {key}")
        if fields[key] != value:
            return False
    labels = obj["metadata"].get("labels") or {}
    for term in filter(None, label_selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


# Every slice written is checked against these schemas (strict: unknown fields fail), so the
# process tests check every slice the plugin writes.
SCHEMA_VERSIONS = ("1.36.0", "1.37.0")


# The schemas come with the dev extra (kubernetes-validate), which the tests and `make demo`
# install; an installed plugin's `demo` runs without them, on this server's own checks.
SCHEMAS_INSTALLED = importlib.util.find_spec("kubernetes_validate") is not None


@functools.cache
def _validator(version: str, kind: str, api_version: str) -> Any:
    """kubernetes-validate's strict schema of `kind` at `version`, compiled once: its
    `validate` reads and parses the schema files on every call (~20 ms a version), which made
    each write to this fake cost ~40 ms on the plugin's reply paths (the real server takes
    microseconds). The same files, the same validator class and registry as it builds."""
    import jsonschema
    from kubernetes_validate import utils as kv_utils
    from referencing import Registry, Resource

    wanted = kv_utils.major_minor(version)
    resolved = [v for v in kv_utils.all_versions() if kv_utils.major_minor(v) <= wanted][-1]
    # resource.k8s.io/v1 -> resource-v1, as the schema files are named
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    where = f"kubernetes-json-schema/v{resolved}-local-strict"
    schema = kv_utils.schema_contents(f"{where}/{kind.lower()}-{group}.json", version)
    definitions = kv_utils.schema_contents(f"{where}/_definitions.json", version)
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate_schemas(obj: Obj) -> None:
    """Against every version of SCHEMA_VERSIONS, strict (unknown fields fail)."""
    if not SCHEMAS_INSTALLED:
        return
    for version in SCHEMA_VERSIONS:
        error = next(_validator(version, obj["kind"], obj["apiVersion"]).iter_errors(obj), None)
        if error is not None:
            raise Invalid(f"{version} schema: {error.message} at {list(error.path)}")


def validate_slice(obj: Obj) -> None:
    validate_schemas(obj)
    spec = obj.get("spec") or {}
    if not obj.get("metadata", {}).get("name"):
        raise Invalid("metadata.name: Required value")
    if not spec.get("driver"):
        raise Invalid("spec.driver: Required value")
    pool = spec.get("pool") or {}
    if not pool.get("name") or int(pool.get("resourceSliceCount") or 0) < 1:
        raise Invalid("spec.pool: name and resourceSliceCount >= 1 required")
    if int(pool.get("generation") or 0) < 0:
        raise Invalid("spec.pool.generation: must be >= 0")
    devices = spec.get("devices") or []
    limit = 64 if any(d.get("taints") for d in devices) else 128
    if len(devices) > limit:
        raise Invalid(f"spec.devices: Too many: {len(devices)}: must have at most {limit} items")
    names = [d.get("name") for d in devices]
    if len(set(names)) != len(names):
        raise Invalid("spec.devices: Duplicate value")
    # Paths name a device by its index, as field.Path does (the plugin finds the GPU by it).
    for i, d in enumerate(devices):
        if len(d.get("attributes") or {}) + len(d.get("capacity") or {}) > 32:
            raise Invalid(f"spec.devices[{i}]: more than 32 attributes and capacities")
        for cap_name, cap in (d.get("capacity") or {}).items():
            _validate_policy(d, f"spec.devices[{i}]", cap_name, cap)
        _validate_taints(d, f"spec.devices[{i}]")


_QUALIFIED = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
TAINT_EFFECTS = ("NoSchedule", "NoExecute", "None")
MAX_TAINTS = 16  # per device (4 in 1.34)


def _validate_taints(device: Obj, path: str) -> None:
    taints = device.get("taints") or []
    where = f"{path}.taints"
    if len(taints) > MAX_TAINTS:
        raise Invalid(f"{where}: Too many: {len(taints)}: must have at most {MAX_TAINTS} items")
    for i, t in enumerate(taints):
        key, value, effect = t.get("key", ""), t.get("value", ""), t.get("effect")
        if not _QUALIFIED.fullmatch(key):
            raise Invalid(f"{where}[{i}].key: Invalid value: {key!r}: not a qualified name")
        if len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
            raise Invalid(f"{where}[{i}].value: Invalid value: {value!r}: not a label value")
        if effect not in TAINT_EFFECTS:
            raise Invalid(f"{where}[{i}].effect: Unsupported value: {effect!r}")


def _validate_policy(device: Obj, path: str, cap_name: str, cap: Obj) -> None:
    policy = cap.get("requestPolicy")
    if policy is None:
        return
    where = f"{path}.capacity[{cap_name}].requestPolicy"
    if not device.get("allowMultipleAllocations"):
        raise Invalid(f"{where}: only allowed when allowMultipleAllocations is true")
    value = parse_quantity(cap["value"])
    default = parse_quantity(policy["default"]) if "default" in policy else None
    rng = policy.get("validRange")
    if rng is None:
        return
    low = parse_quantity(rng["min"])
    step = parse_quantity(rng["step"]) if "step" in rng else None
    high = parse_quantity(rng["max"]) if "max" in rng else value
    if not low <= high <= value:
        raise Invalid(f"{where}.validRange: need min <= max <= value")
    # k8s pkg/apis/resource/validation/validation.go, validateRequestPolicyRange: a step
    # whose first increment leaves the capacity is refused (and with it the whole slice).
    if step is not None and low + step > value:
        raise Invalid(
            f"{where}.validRange.step: Invalid value: {rng['step']!r}: one step "
            f"{format_quantity(low + step)} is larger than capacity value: {cap['value']}"
        )
    for what, amount in (("max", high), ("default", default)):
        if amount is None:
            continue
        if not low <= amount <= high:
            raise Invalid(f"{where}.{what}: outside the valid range")
        if step is not None and (amount - low) % step:
            raise Invalid(f"{where}.{what}: not on the min + n*step grid")


def rfc3339(value: str) -> str:
    """A metav1.Time as the API server stores and returns it: UTC, seconds, `Z` (the Python
    client sends `+00:00`, having parsed the string into a datetime)."""
    parsed = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    return parsed.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _normalise_taints(obj: Obj) -> None:
    for d in (obj.get("spec") or {}).get("devices") or []:
        for t in d.get("taints") or []:
            if "timeAdded" in t:
                t["timeAdded"] = rfc3339(t["timeAdded"])


_CONDITION_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
MAX_DEVICE_DATA = 10 * 1024  # bytes of status.devices[].data


def validate_claim_status(old: Obj, new: Obj) -> None:
    """What the API server checks on a status UPDATE: the allocation is immutable once set;
    each `devices[]` entry names an allocated result (driver, pool, device) once per shareID,
    with at most 8 well-formed conditions and at most 10 KiB of data."""
    if old.get("allocation") and new.get("allocation") != old["allocation"]:
        raise Invalid("status.allocation: field is immutable")
    results = ((new.get("allocation") or {}).get("devices") or {}).get("results") or []
    allocated = {(r.get("driver"), r.get("pool"), r.get("device")) for r in results}
    seen = set()
    for i, d in enumerate(new.get("devices") or []):
        where = f"status.devices[{i}]"
        key = (d.get("driver"), d.get("pool"), d.get("device"))
        if key not in allocated:
            raise Invalid(
                f"{where}: Invalid value: {key}: must be an allocated device in the claim"
            )
        if (*key, d.get("shareID")) in seen:
            raise Invalid(f"{where}: Duplicate value: {key}")
        seen.add((*key, d.get("shareID")))
        conditions = d.get("conditions") or []
        if len(conditions) > 8:
            raise Invalid(f"{where}.conditions: Too many: {len(conditions)}: at most 8")
        for j, c in enumerate(conditions):
            if c.get("status") not in ("True", "False", "Unknown"):
                raise Invalid(f"{where}.conditions[{j}].status: Unsupported value")
            if not _CONDITION_REASON.fullmatch(c.get("reason") or ""):
                raise Invalid(f"{where}.conditions[{j}].reason: Invalid value")
            try:
                rfc3339(c.get("lastTransitionTime") or "")
            except ValueError:
                raise Invalid(f"{where}.conditions[{j}].lastTransitionTime: Invalid") from None
        if len(json.dumps(d.get("data"))) > MAX_DEVICE_DATA:
            raise Invalid(f"{where}.data: Too long: must have at most {MAX_DEVICE_DATA} bytes")


def _drop_taints(obj: Obj) -> None:
    for d in (obj.get("spec") or {}).get("devices") or []:
        d.pop("taints", None)


def _drop_consumable(obj: Obj) -> None:
    for d in (obj.get("spec") or {}).get("devices") or []:
        d.pop("allowMultipleAllocations", None)
        for cap in (d.get("capacity") or {}).values():
            cap.pop("requestPolicy", None)


class DraStore:
    """State and request handling for `/apis/resource.k8s.io/v1`; guarded by `versions.cond`."""

    def __init__(self, versions: Versions) -> None:
        self.versions = versions
        self.slices: dict[str, Obj] = {}
        self.claims: dict[tuple[str, str], Obj] = {}
        # per claim: its opaque parameters as their creator sent them (config index → text)
        self.raws: dict[tuple[str, str], dict[int, str]] = {}
        # per claim: field manager → the status.devices entries it applied
        self.owners: dict[tuple[str, str], dict[str, set[claim_status.Key]]] = {}
        self.classes: dict[str, Obj] = {}
        self.history: list[tuple[int, str, str, Obj]] = []  # (rv, resource, type, object)
        self.drop_consumable = False
        self.drop_taints = False
        self._caller: rbac.Caller | None = None  # the request being handled

    # ---- driven by tests -----------------------------------------------------------------
    def _bump(self, resource: str, kind: str, obj: Obj) -> None:
        rv = self.versions.bump()
        obj["metadata"]["resourceVersion"] = str(rv)
        self.history.append((rv, resource, kind, copy.deepcopy(obj)))
        self.versions.cond.notify_all()

    def add_claim(self, claim: Obj, raw: str | None = None) -> Obj:
        """Store `claim` as if created (and allocated) from the JSON text `raw`; by default
        the compact JSON a Go client or kubectl sends, not Python's `json.dumps` spacing."""
        text = raw if raw is not None else json.dumps(claim, separators=(",", ":"))
        with self.versions.cond:
            meta = claim["metadata"]
            meta.setdefault("uid", str(uuid.uuid4()))
            key = (meta["namespace"], meta["name"])
            kind = "MODIFIED" if key in self.claims else "ADDED"
            self.claims[key] = claim
            self.raws[key] = claim_status.opaque_raws(claim, text)
            if kind == "ADDED":
                self.owners.pop(key, None)
            self._bump("resourceclaims", kind, claim)
            return copy.deepcopy(claim)

    def delete_claim(self, namespace: str, name: str) -> None:
        with self.versions.cond:
            claim = self.claims.pop((namespace, name))
            self.raws.pop((namespace, name), None)
            self.owners.pop((namespace, name), None)
            self._bump("resourceclaims", "DELETED", claim)

    def wipe_slices(self, node: str, driver: str) -> int:
        """What the kubelet does when a driver is gone: delete its slices for the node."""
        with self.versions.cond:
            gone = [
                n
                for n, s in self.slices.items()
                if s["spec"].get("nodeName") == node and s["spec"]["driver"] == driver
            ]
            for name in gone:
                self._bump("resourceslices", "DELETED", self.slices.pop(name))
            return len(gone)

    def slices_of(self, node: str) -> list[Obj]:
        with self.versions.cond:
            out = [
                copy.deepcopy(s) for s in self.slices.values() if s["spec"].get("nodeName") == node
            ]
        return sorted(out, key=lambda s: s["metadata"]["name"])

    # ---- requests ------------------------------------------------------------------------
    def handle(
        self,
        method: str,
        parts: list[str],
        query: dict[str, str],
        body: Any,
        raw: bytes | None = None,
        content_type: str = "application/json",
        caller: rbac.Caller | None = None,
    ) -> tuple[int, Any]:
        """(status, body) for a request under /apis/resource.k8s.io/v1 (`parts` after it);
        `raw` is the body as it came (Python's JSON of `body` when not given); `caller` is
        who sent it, for the registry's own checks (None: an admin)."""
        text = raw.decode() if raw else json.dumps(body)
        try:
            with self.versions.cond:  # the caller too is this request's, under the lock
                self._caller = caller
                return self._route(method, parts, query, body, (text, content_type))
        except Conflict as err:
            return 409, _failure(409, "Conflict", str(err))
        except Invalid as err:
            # The real message: `<Kind>.<group> "<name>" is invalid: <path>: <why>`.
            meta = body.get("metadata") if isinstance(body, dict) else None
            name = meta.get("name", "") if isinstance(meta, dict) else ""
            return 422, _failure(422, "Invalid", f'{_kind(parts)} "{name}" is invalid: {err}')

    def _route(
        self,
        method: str,
        parts: list[str],
        query: dict[str, str],
        body: Any,
        sent: tuple[str, str],
    ) -> tuple[int, Any]:
        if parts and parts[0] == "resourceslices":
            return self._slices(method, parts[1:], query, body)
        if parts == ["resourceclaims"] and method == "GET":
            return 200, self._list("ResourceClaimList", list(self.claims.values()), query)
        if len(parts) == 4 and parts[0] == "namespaces" and parts[2] == "resourceclaims":
            claim = self.claims.get((parts[1], parts[3]))
            if method == "GET":
                return (200, copy.deepcopy(claim)) if claim else _not_found()
        if (
            parts[:1] == ["namespaces"]
            and parts[2:3] == ["resourceclaims"]
            and parts[4:] == ["status"]
        ):
            claim = self.claims.get((parts[1], parts[3]))
            if claim is None:
                return _not_found()
            if method == "GET":
                return 200, copy.deepcopy(claim)
            if method == "PUT":
                return self._update_claim_status(claim, body, sent[0])
            if method == "PATCH":
                return self._apply_claim_status(claim, body, query, *sent)
        if parts and parts[0] == "deviceclasses":
            return self._classes(method, parts[1:], query, body)
        return _not_found()

    def _update_claim_status(self, claim: Obj, body: Obj, text: str) -> tuple[int, Any]:
        """UPDATE of the status subresource: spec and metadata stay as stored, status is the
        body's, validated as the API server does it."""
        meta, sent = claim["metadata"], body.get("metadata") or {}
        if sent.get("resourceVersion") != meta["resourceVersion"]:
            return 409, _failure(409, "Conflict", "the object has been modified")
        if sent.get("uid") not in (None, meta["uid"]):
            return 409, _failure(409, "Conflict", "Precondition failed: UID in precondition")
        status = copy.deepcopy(body.get("status") or {})
        self._check_status(claim, status, claim_status.opaque_raws(body, text), "update")
        owners = self.owners.setdefault((meta["namespace"], meta["name"]), {})
        present = {claim_status.key(d) for d in status.get("devices") or []}
        for keys in owners.values():  # what the update removed, no applier owns any more
            keys &= present
        return self._store_claim_status(claim, status)

    def _apply_claim_status(
        self, claim: Obj, body: Obj, query: dict[str, str], text: str, content_type: str
    ) -> tuple[int, Any]:
        """Server-side apply on the status subresource (k8s staging/src/k8s.io/apiserver/pkg/
        endpoints/handlers/patch.go, applyPatcher): the body's `status.devices` merged into
        the stored list-map for its field manager; spec ignored, as the status strategy
        resets it; a `metadata.uid` that is not the claim's fails as an immutable field."""
        if content_type.split(";")[0].strip() != APPLY_PATCH:
            message = f"the stand-in serves only {APPLY_PATCH} on a claim's status"
            return 415, _failure(415, "UnsupportedMediaType", message)
        manager = query.get("fieldManager", "")
        if not manager:
            raise Invalid("fieldManager: Required value: is required for apply patch")
        meta, sent = claim["metadata"], body.get("metadata") or {}
        if (
            sent.get("name") != meta["name"]
            or sent.get("namespace", meta["namespace"]) != (meta["namespace"])
        ):
            message = "the name or namespace of the object does not match the request's"
            return 400, _failure(400, "BadRequest", message)
        if sent.get("resourceVersion") not in (None, meta["resourceVersion"]):
            return 409, _failure(409, "Conflict", "the object has been modified")
        if sent.get("uid") not in (None, meta["uid"]):
            raise Invalid(f'metadata.uid: Invalid value: "{sent["uid"]}": field is immutable')
        old, applied = claim.get("status") or {}, body.get("status") or {}
        status = copy.deepcopy(old)
        for name in ("allocation", "reservedFor"):  # the scheduler's; sent, they count
            if name in applied:
                status[name] = copy.deepcopy(applied[name])
        key = (meta["namespace"], meta["name"])
        raws = claim_status.opaque_raws(body, text) if "allocation" in applied else None
        owners = copy.deepcopy(self.owners.get(key, {}))
        devices = claim_status.apply_devices(
            old.get("devices") or [], applied.get("devices") or [], manager, owners,
            query.get("force") in ("true", "1", "True"),
        )  # fmt: skip
        status.pop("devices", None)
        if devices:
            status["devices"] = devices
        self._check_status(claim, status, self.raws.get(key, {}) if raws is None else raws, "patch")
        self.owners[key] = owners
        return self._store_claim_status(claim, status)

    def _check_status(self, claim: Obj, status: Obj, raws: dict[int, str], verb: str) -> None:
        """The status strategy's ValidateUpdate (pkg/registry/resource/resourceclaim/
        strategy.go): the binding check, the per-driver device-status check, the validation."""
        meta = claim["metadata"]
        old = claim.get("status") or {}
        stored = self.raws.get((meta["namespace"], meta["name"]), {})
        errors = []
        if claim_status.binding_changed(old, stored, status, raws):
            errors += self._binding_errors(verb)
        errors += self._device_status_errors(meta["namespace"], old, status, verb)
        try:
            validate_claim_status(old, status)
        except Invalid as err:
            errors.append(str(err))
        if errors:
            raise Invalid(errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]")

    def _binding_errors(self, verb: str) -> list[str]:
        """pkg/registry/resource/utils.go, AuthorizedForBinding: a changed allocation or
        reservedFor needs the request's verb on `resourceclaims/binding`, cluster-wide."""
        why = self._caller.denied(verb, "binding", "", "") if self._caller else None
        if why is None:
            return []
        return [
            "status.allocation: Forbidden: changing status.allocation or status.reservedFor "
            f'requires resource="resourceclaims/binding", verb="{verb}" permission: {why}'
        ]

    def _device_status_errors(self, namespace: str, old: Obj, new: Obj, verb: str) -> list[str]:
        """pkg/registry/resource/utils.go, AuthorizedForDeviceStatus (1.36+,
        DRAResourceClaimGranularStatusAuthorization): each driver whose `status.devices`
        entries the write adds, changes or removes needs `associated-node:<verb>` (a
        ServiceAccount whose pod-bound token names the claim's allocated node) or
        `arbitrary-node:<verb>` on `resourceclaims/driver`, named by the driver."""
        caller = self._caller
        if caller is None:
            return []
        node = claim_status.allocated_node(new.get("allocation"))
        verbs = [f"arbitrary-node:{verb}"]
        on_node = caller.user.name.startswith("system:serviceaccount:") and caller.user.node
        if node and on_node == node:
            verbs.insert(0, f"associated-node:{verb}")
        errors = []
        for driver in sorted(claim_status.modified_drivers(old, new)):
            whys = []
            for each in verbs:  # OR'd: the first allowed ends the check
                why = caller.denied(each, "driver", namespace, driver)
                if why is None:
                    break
                whys.append(why)
            else:
                errors.append(
                    "status.devices: Forbidden: changing status.devices requires "
                    f'resource="resourceclaims/driver", verb="[{" ".join(verbs)}]" '
                    f"permission: {whys[0]}"
                )
        return errors

    def _store_claim_status(self, claim: Obj, status: Obj) -> tuple[int, Any]:
        meta = claim["metadata"]
        key = (meta["namespace"], meta["name"])
        updated = copy.deepcopy(claim)
        updated["status"] = status
        validate_schemas(updated)
        for d in status.get("devices") or []:
            for c in d.get("conditions") or []:
                c["lastTransitionTime"] = rfc3339(c["lastTransitionTime"])
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        owners = self.owners.get(key, {})
        updated["metadata"]["managedFields"] = claim_status.managed_fields(owners, now)
        if not owners:
            del updated["metadata"]["managedFields"]
        self.claims[key] = updated
        self._bump("resourceclaims", "MODIFIED", updated)
        return 200, copy.deepcopy(updated)

    def _list(self, kind: str, items: list[Obj], query: dict[str, str]) -> Obj:
        field, label = query.get("fieldSelector", ""), query.get("labelSelector", "")
        chosen = [copy.deepcopy(i) for i in items if _selector_match(i, field, label)]
        return {
            "kind": kind,
            "apiVersion": "resource.k8s.io/v1",
            "metadata": {"resourceVersion": str(self.versions.rv)},
            "items": chosen,
        }

    def _slices(
        self, method: str, rest: list[str], query: dict[str, str], body: Any
    ) -> tuple[int, Any]:
        if not rest:
            if method == "GET":
                return 200, self._list("ResourceSliceList", list(self.slices.values()), query)
            if method == "POST":
                return self._create_slice(body)
            return _not_found()
        name = rest[0]
        current = self.slices.get(name)
        if method == "GET":
            return (200, copy.deepcopy(current)) if current else _not_found()
        if method == "DELETE":
            if current is None:
                return _not_found()
            del self.slices[name]
            self._bump("resourceslices", "DELETED", current)
            return 200, {"kind": "Status", "status": "Success"}
        if method == "PUT":
            if current is None:
                return _not_found()
            sent_rv = (body.get("metadata") or {}).get("resourceVersion")
            if sent_rv != current["metadata"]["resourceVersion"]:
                return 409, _failure(409, "Conflict", "the object has been modified")
            return self._store_slice(body, current, "MODIFIED", 200)
        return _not_found()

    def _create_slice(self, body: Obj) -> tuple[int, Any]:
        name = (body.get("metadata") or {}).get("name")
        if name in self.slices:
            return 409, _failure(409, "AlreadyExists")
        return self._store_slice(body, None, "ADDED", 201)

    def _store_slice(
        self, body: Obj, current: Obj | None, kind: str, status: int
    ) -> tuple[int, Any]:
        obj = copy.deepcopy(body)
        validate_slice(obj)
        if self.drop_consumable:
            _drop_consumable(obj)
        _normalise_taints(obj)
        if self.drop_taints:
            _drop_taints(obj)
        meta = obj["metadata"]
        meta["uid"] = current["metadata"]["uid"] if current else str(uuid.uuid4())
        meta["generation"] = (current["metadata"].get("generation", 1) + 1) if current else 1
        self.slices[meta["name"]] = obj
        self._bump("resourceslices", kind, obj)
        return status, copy.deepcopy(obj)

    def _classes(
        self, method: str, rest: list[str], query: dict[str, str], body: Any
    ) -> tuple[int, Any]:
        if not rest and method == "GET":
            return 200, self._list("DeviceClassList", list(self.classes.values()), query)
        if not rest and method == "POST":
            name = body["metadata"]["name"]
            if name in self.classes:
                return 409, _failure(409, "AlreadyExists")
            obj = copy.deepcopy(body)
            obj["metadata"]["uid"] = str(uuid.uuid4())
            self.classes[name] = obj
            self._bump("deviceclasses", "ADDED", obj)
            return 201, copy.deepcopy(obj)
        if len(rest) == 1 and method == "GET":
            found = self.classes.get(rest[0])
            return (200, copy.deepcopy(found)) if found else _not_found()
        return _not_found()

    def watch_filter(
        self, parts: list[str], query: dict[str, str]
    ) -> Callable[[str, Obj], bool] | None:
        """Which history entries a watch request wants, or None when it is not a watch."""
        if query.get("watch") not in ("true", "1", "True"):
            return None
        resource = parts[0] if parts else ""
        field, label = query.get("fieldSelector", ""), query.get("labelSelector", "")
        return lambda res, obj: res == resource and _selector_match(obj, field, label)


def _failure(code: int, reason: str, message: str = "") -> Obj:
    return {
        "kind": "Status",
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }


def _kind(parts: list[str]) -> str:
    resource = parts[0] if parts else ""
    if resource == "namespaces" and len(parts) > 2:
        resource = parts[2]
    kinds = {"resourceslices": "ResourceSlice", "resourceclaims": "ResourceClaim",
             "deviceclasses": "DeviceClass"}  # fmt: skip
    return f"{kinds.get(resource, resource)}.resource.k8s.io"


def _not_found() -> tuple[int, Any]:
    return 404, _failure(404, "NotFound")
