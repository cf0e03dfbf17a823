"""SlicePublisher: keeps this node's ResourceSlices equal to the plan, off the gRPC path.

A thread reconciles whenever `republish()` is called (after every kubelet registration, a
plan change, a health change) and when a watch sees one of our slices deleted (the kubelet
wipes them 30 s after a driver disconnects and at its own restart), plus a slow periodic
resync; passes are paced (`updates.Pacer`), so a storm costs at most 5 republishes a second
and the last pass publishes the final state. Every write that changes a slice, taints
included, raises `pool.generation` above every generation still published. What was written
is read back: fields the API server dropped (a feature gate that is off) are reported once;
fractional GPUs are then published without multi-allocation, devices without taints. A slice
the API server refuses (422) names its device by index: that GPU is left out, with the
reason, until the plan changes, and the others are published. A device not yet judged
(`pending`) keeps what the pool already holds for it, or waits when it holds nothing.
Over 400 lines on purpose: one reconcile loop and the state its one lock guards.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from deviceplugin.dra import slices
from deviceplugin.kube.client import Api, Gone, KubeError
from deviceplugin.plan import SlicePlan
from deviceplugin.plumbing import logs
from deviceplugin.plumbing.updates import Pacer

Taints = Mapping[str, Sequence[Mapping[str, str]]]  # device name → its taints

LOG = logs.get("dra.slices")


@dataclass(frozen=True)
class Settings:
    resync: float = 300.0  # seconds between full reconciles without any trigger
    retry_first: float = 0.5  # seconds before retrying a failed reconcile, doubling
    retry_cap: float = 30.0


@dataclass(frozen=True)
class SliceStatus:
    """What the last reconcile achieved; `inventory`, `/readyz` and the state file read it."""

    published: bool = False
    generation: int = 0
    slices: int = 0
    devices: int = 0
    multi_allocation: bool = True
    dropped: tuple[str, ...] = ()  # field paths the API server dropped
    error: str | None = None
    writes: int = 0  # create/replace/delete calls so far
    taints: tuple[tuple[str, str], ...] = ()  # (device, cause) of the published taints
    device_taints: bool = True  # False: the API server drops taints (DRADeviceTaints off)
    refused: tuple[tuple[str, str], ...] = ()  # (device, why) the API server refused
    waiting: tuple[str, ...] = ()  # devices held back until their first health verdict

    def as_dict(self) -> dict[str, Any]:
        return {
            "published": self.published,
            "generation": self.generation,
            "slices": self.slices,
            "devices": self.devices,
            "consumableCapacity": self.multi_allocation,
            "droppedFields": list(self.dropped),
            "error": self.error,
            "taints": dict(self.taints),
            "deviceTaints": self.device_taints,
            "refused": dict(self.refused),
            "awaitingVerdict": list(self.waiting),
        }


def dropped_fields(sent: Any, got: Any, path: str = "") -> list[str]:
    """Paths present in `sent` but missing from `got` (what the API server silently dropped)."""
    if isinstance(sent, Mapping):
        if not isinstance(got, Mapping):
            return [path]
        out: list[str] = []
        for key, value in sent.items():
            sub = f"{path}.{key}" if path else str(key)
            out += dropped_fields(value, got[key], sub) if key in got else [sub]
        return out
    if isinstance(sent, list):
        if not isinstance(got, list) or len(got) != len(sent):
            return [path]
        out = []
        for i, (a, b) in enumerate(zip(sent, got, strict=True)):
            name = a.get("name") if isinstance(a, Mapping) else None
            out += dropped_fields(a, b, f"{path}[{name if name else i}]")
        return out
    return []


def _generation(obj: Mapping[str, Any]) -> int:
    return int(((obj.get("spec") or {}).get("pool") or {}).get("generation") or 0)


def _same(desired: Mapping[str, Any], stored: Mapping[str, Any]) -> bool:
    """The stored slice says what we want (ignoring server-set metadata)."""
    if desired["spec"] != stored.get("spec"):
        return False
    meta, have = desired["metadata"], stored.get("metadata") or {}
    return all(have.get(k) == meta[k] for k in ("labels", "ownerReferences"))


def is_taint_path(path: str) -> bool:
    """A dropped-field path inside a device's taints (`<slice>: devices[gpu-0].taints…`)."""
    return ".taints" in path


_DEVICE_PATH = re.compile(r"spec\.devices\[(\d+)\]")


def refused_devices(body: Mapping[str, Any], message: str) -> list[str]:
    """The devices of a refused slice that the API server's message names (its field paths
    index `spec.devices`); every device of the slice when it names none."""
    devices = [d["name"] for d in body["spec"]["devices"]]
    named = [devices[int(i)] for i in _DEVICE_PATH.findall(message) if int(i) < len(devices)]
    return list(dict.fromkeys(named)) or devices


def _stored_taints(listed: Sequence[Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Device name → the taints the pool's newest generation holds for it."""
    newest = max((_generation(s) for s in listed), default=0)
    return {
        d["name"]: [dict(t) for t in d.get("taints") or ()]
        for s in listed
        if _generation(s) == newest
        for d in (s.get("spec") or {}).get("devices") or ()
    }


def _taint_list(desired: list[dict[str, Any]]) -> str:
    return ",".join(
        f"{d['name']}={t['value']}"
        for body in desired
        for d in body["spec"]["devices"]
        for t in d.get("taints") or ()
    )


class SlicePublisher:
    """`start()`/`stop()` (idempotent); `republish()` never blocks."""

    def __init__(
        self,
        api: Api,
        node: str,
        plan: Callable[[], SlicePlan],
        driver_version: str,
        *,
        driver: str = slices.DRIVER,
        on_dropped: Callable[[list[str]], None] | None = None,
        on_status: Callable[[SliceStatus], None] | None = None,
        settings: Settings | None = None,
        taints: Callable[[], Taints] | None = None,
        on_republish: Callable[[], None] | None = None,
        pacer: Pacer | None = None,
        max_clients: Callable[[], int | None] | None = None,
        pending: Callable[[], Collection[str]] | None = None,
        on_refused: Callable[[str, str], None] | None = None,
    ) -> None:
        self._api = api
        self._node = node
        self._plan = plan
        self._driver_version = driver_version
        self._driver = driver
        self._on_dropped = on_dropped
        self._on_status = on_status
        self._settings = settings or Settings()
        self._taints = taints
        self._on_republish = on_republish
        self._pacer = pacer or Pacer()
        self._max_clients = max_clients
        self._pending = pending
        self._on_refused = on_refused
        self._refused: dict[str, str] = {}  # device → why the API server refused it
        self._owner: slices.Owner | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._response: Any = None
        self._lock = threading.Lock()
        self._status = SliceStatus()
        self._multi = True
        self._taints_ok = True  # False once the API server dropped them (no churn after)
        self._written = 0  # the highest generation this process wrote
        self.reconciles = 0  # tests and metrics read it

    # ---- public ------------------------------------------------------------------------
    def republish(self) -> None:
        self._wake.set()

    def plan_changed(self) -> None:
        """A new plan may have fixed what made the server drop fields: try them again."""
        self._multi = True
        self._taints_ok = True
        self._refused = {}
        self._wake.set()

    @property
    def status(self) -> SliceStatus:
        with self._lock:
            return self._status

    def start(self) -> None:
        if self._threads:
            return
        for target, name in ((self._loop, "dra-slices"), (self._watch_loop, "dra-slice-watch")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        self._wake.set()

    def stop(self) -> None:
        """Stop reconciling; the slices stay (the kubelet wipes them if we do not come back)."""
        self._stop.set()
        self._wake.set()
        response = self._response
        if response is not None:
            with contextlib.suppress(Exception):  # already closed
                response.shutdown()
        for thread in self._threads:
            thread.join(timeout=5.0)

    # ---- reconcile ---------------------------------------------------------------------
    def _loop(self) -> None:
        failures = 0
        while not self._stop.is_set():
            timeout = self._settings.resync
            if failures:
                s = self._settings
                timeout = min(s.retry_first * 2 ** (failures - 1), s.retry_cap)
            self._wake.wait(timeout)
            # Paced: what changes meanwhile is read by this pass (a storm is coalesced).
            if self._stop.wait(self._pacer.delay()):
                return
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.reconcile()
                failures = 0
            except KubeError as err:
                failures += 1
                self._set(error=str(err), published=False)
                if failures == 1:
                    logs.log(LOG, "publishing resourceslices failed; retrying",
                             level=logging.WARNING, error=str(err))  # fmt: skip
            finally:
                # Paced from the pass's end: its write came before, so writes are at least the
                # gap apart however long a pass's list took (from its start, a slow list then
                # a fast one put two writes closer than the gap).
                self._pacer.sent()

    def _owner_ref(self) -> slices.Owner:
        if self._owner is None:
            node = self._api.get_node(self._node)
            self._owner = slices.Owner(self._node, str((node.get("metadata") or {})["uid"]))
        return self._owner

    def reconcile(self) -> None:
        """One pass: list ours, write what differs at a new generation, delete extras."""
        self.reconciles += 1
        owner = self._owner_ref()
        plan = self._plan()
        taints = dict(self._taints()) if self._taints is not None and self._taints_ok else {}
        listed = self._api.list_resource_slices(self._node, self._driver).get("items") or []
        stored = {s["metadata"]["name"]: s for s in listed}
        current = max((_generation(s) for s in listed), default=0)
        # Not yet judged: what the pool holds for it stays (a restart never shows a taint the
        # domain has not earned); a device the pool does not hold waits for its verdict.
        held = _stored_taints(listed)
        pending = set(self._pending()) if self._pending is not None else set()
        for name in pending:
            taints.pop(name, None)
            if held.get(name) and self._taints_ok:
                taints[name] = held[name]
        waiting = tuple(sorted(pending - held.keys()))
        withheld = {*waiting, *self._refused}
        desired = self._build(plan, owner, current, taints, withheld)
        names = {d["metadata"]["name"] for d in desired}
        if stored.keys() == names and all(_same(d, stored[d["metadata"]["name"]]) for d in desired):
            self._set_published(desired, waiting)
            return
        # Above everything still published, and above what we wrote before a wipe, so a
        # scheduler that saw the old pool never mistakes the new one for it.
        generation = max(current, self._written) + 1
        self._written = generation
        desired = self._build(plan, owner, generation, taints, withheld)
        if self._on_republish is not None:
            self._on_republish()
        dropped: list[str] = []
        refused = False
        for body in desired:
            try:
                got = self._write(body, stored)
            except KubeError as err:
                if err.status != 422:
                    raise
                refused = self._refuse(plan, body, str(err)) or refused
                continue
            name = body["metadata"]["name"]
            dropped += [f"{name}: {p}" for p in dropped_fields(body["spec"], got.get("spec"))]
        for name in stored.keys() - names:
            with contextlib.suppress(KubeError):  # already gone is fine; others on the next pass
                self._api.delete_resource_slice(name)
                self._count_write()
        logs.log(LOG, "resourceslices published", node=self._node, generation=generation,
                 slices=len(desired), devices=sum(len(d["spec"]["devices"]) for d in desired),
                 consumable=self._multi, taints=_taint_list(desired) or "-",
                 waiting=",".join(waiting) or "-")  # fmt: skip
        if refused:
            self._wake.set()  # publish the others now, without what was refused
            return
        if not (dropped and self._dropped(dropped)):
            self._set_published(desired, waiting)

    def _write(self, body: dict[str, Any], stored: Mapping[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        if name in stored:
            version = stored[name]["metadata"]["resourceVersion"]
            body = {**body, "metadata": {**body["metadata"], "resourceVersion": version}}
            got = self._api.replace_resource_slice(name, body)
        else:
            got = self._api.create_resource_slice(body)
        self._count_write()
        return got

    def _refuse(self, plan: SlicePlan, body: Mapping[str, Any], message: str) -> bool:
        """The API server refused a slice (the whole slice, for one device's fault): leave the
        devices it names out until the plan changes, and say which GPU and why. Raises when
        it names none not already left out (the pass fails and is retried)."""
        uuids = {slices.device_name(gp): gp.uuid for gp in plan.dra_gpus}
        culprits = [d for d in refused_devices(body, message) if d not in self._refused]
        for device in culprits:
            self._refused[device] = message
            logs.log(LOG, "the API server refused a resourceslice; its GPU is left out",
                     level=logging.WARNING, device=device, gpu=uuids.get(device, "-"),
                     error=message)  # fmt: skip
            if self._on_refused is not None:
                self._on_refused(f"{device} ({uuids.get(device, '-')})", message)
        self._set(refused=tuple(sorted(self._refused.items())))
        if not culprits:
            raise KubeError("publish resourceslices", 422, message)
        return True

    def _build(
        self,
        plan: SlicePlan,
        owner: slices.Owner,
        generation: int,
        taints: Taints,
        withheld: Collection[str] = (),
    ) -> list[dict[str, Any]]:
        return slices.build(
            plan,
            owner=owner,
            generation=generation,
            driver_version=self._driver_version,
            multi_allocation=self._multi,
            driver=self._driver,
            taints=taints,
            max_clients=self._max_clients() if self._max_clients is not None else None,
            withheld=withheld,
        )

    def _dropped(self, paths: list[str]) -> bool:
        """Report dropped fields (once per distinct set); True when a fallback publish is due:
        fractional GPUs without multi-allocation, devices without taints."""
        lost_taints = [p for p in paths if is_taint_path(p)]
        lost_capacity = [p for p in paths if not is_taint_path(p)]
        fallback = []
        if lost_capacity and self._multi:
            self._multi = False
            fallback.append("fractional GPUs published without consumable capacity")
        if lost_taints and self._taints_ok:
            self._taints_ok = False
            fallback.append("devices published without taints (the health stream and claim "
                            "status still report them)")  # fmt: skip
        known = set(self.status.dropped)
        if not fallback and known.issuperset(paths):
            return False  # reported already (no Event storm)
        logs.log(LOG, "the API server dropped resourceslice fields", level=logging.WARNING,
                 fields=";".join(paths[:8]), count=len(paths),
                 consequence="; ".join(fallback) or "none")  # fmt: skip
        self._set(
            dropped=tuple(dict.fromkeys([*self.status.dropped, *paths])),
            multi_allocation=self._multi,
            device_taints=self._taints_ok,
            published=False,
        )
        if self._on_dropped is not None:
            self._on_dropped(paths)
        if fallback:
            self._wake.set()  # publish the fallback now
        return bool(fallback)

    def _count_write(self) -> None:
        with self._lock:
            self._status = replace(self._status, writes=self._status.writes + 1)

    def _set_published(self, desired: list[dict[str, Any]], waiting: tuple[str, ...]) -> None:
        self._set(
            published=True,
            waiting=waiting,
            refused=tuple(sorted(self._refused.items())),
            generation=_generation(desired[0]),
            slices=len(desired),
            devices=sum(len(d["spec"]["devices"]) for d in desired),
            multi_allocation=self._multi,
            error=None,
            taints=tuple(
                (d["name"], t["value"])
                for body in desired
                for d in body["spec"]["devices"]
                for t in d.get("taints") or ()
            ),
        )

    def _set(self, **changes: Any) -> None:
        with self._lock:
            before = self._status
            self._status = replace(self._status, **changes)
            after = self._status
        if self._on_status is not None and after != before:
            self._on_status(after)

    # ---- wipe detection ----------------------------------------------------------------
    def _watch_loop(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                for event in self._events():
                    if self._stop.is_set():
                        return
                    if event.get("type") == "DELETED":
                        meta = (event.get("object") or {}).get("metadata") or {}
                        logs.log(LOG, "resourceslice deleted; republishing", name=meta.get("name"))
                        self._wake.set()
                failures = 0
            except (Gone, KubeError):
                if self._stop.is_set():
                    return
                failures += 1
                self._stop.wait(min(self._settings.retry_first * 2**failures, 30.0))
                self._wake.set()  # deletions may have been missed while away

    def _events(self) -> Iterator[dict[str, Any]]:
        listed = self._api.list_resource_slices(self._node, self._driver)
        version = str((listed.get("metadata") or {}).get("resourceVersion", ""))
        return self._api.watch_resource_slices(self._node, self._driver, version, self._opened)

    def _opened(self, response: Any) -> None:
        self._response = response
        if self._stop.is_set():
            response.shutdown()
