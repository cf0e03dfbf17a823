"""NodePrepareResources and NodeUnprepareResources without gRPC: the Preparer (DESIGN section 10).

Per claim: read it (ClaimSource), check UID and allocation, take this driver's results in this
node's pool, plan them (`claim_plan`: caps exactly as Allocate's, the MPS daemon ensured, no
device prepared beyond its capacity across claims, the last line of defence against a double
allocation), write one CDI spec per claim, and checkpoint Started before the work and
Completed after. Calls are serialised; a completed claim is answered from the checkpoint;
unprepare needs only the checkpoint.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from deviceplugin.cdi import specs as cdi_specs
from deviceplugin.config.settings import Config
from deviceplugin.dra.checkpoint import Checkpoint, ClaimEntry, State
from deviceplugin.dra.claim_plan import ClaimPlanner, Tally, claim_spec
from deviceplugin.dra.results import ClaimError, driver_results
from deviceplugin.model import MIB, GpuUuid, Mode
from deviceplugin.mps.gate import MpsGate
from deviceplugin.plan import SlicePlan
from deviceplugin.plumbing import logs

_log = logs.get("dra.prepare")


class ClaimsUnavailable(Exception):
    """The API server could not be asked (the claim may well exist)."""


class ClaimSource(Protocol):
    def get(self, namespace: str, name: str, uid: str) -> dict[str, Any] | None:
        """The ResourceClaim as the API server's JSON (dict), the cached copy only when it has
        this UID and is allocated, else a GET; None when not found. Raises ClaimsUnavailable."""
        ...


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    name: str
    uid: str


@dataclass(frozen=True)
class PreparedDevice:
    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None


@dataclass(frozen=True)
class PrepareResult:
    devices: tuple[PreparedDevice, ...] = ()
    error: str | None = None


def _answer(entry: ClaimEntry) -> PrepareResult:
    return PrepareResult(
        tuple(
            PreparedDevice((d.request,), d.pool, d.device, d.cdi_device_ids, d.share_id)
            for d in entry.devices
        )
    )


class Preparer:
    """Serialised, idempotent, checkpointed prepare/unprepare for one node's DRA GPUs."""

    def __init__(
        self,
        *,
        driver: str,
        node_name: str,
        config: Callable[[], Config],
        plan: Callable[[], SlicePlan],
        claims: ClaimSource,
        mps: MpsGate | None,
        cdi_dir: Path,
        mps_root: Path,
        checkpoint: Checkpoint,
        on_prepared: Callable[[ClaimEntry, dict[str, Any] | None], None] | None = None,
        on_unprepared: Callable[[str], None] | None = None,
    ) -> None:
        self.driver = driver
        self.node_name = node_name
        self._config = config
        self._plan = plan
        self._claims = claims
        self._mps = mps
        self._cdi_dir = cdi_dir
        self._mps_root = mps_root
        self._checkpoint = checkpoint
        self._planner = ClaimPlanner(node_name, driver, mps, mps_root)
        self._lock = threading.Lock()
        self._restored = False
        # Told (under the lock: must not block) of every completed claim answered, and of
        # every claim undone; the claim-status writer queues them.
        self._on_prepared = on_prepared
        self._on_unprepared = on_unprepared

    # -- start ------------------------------------------------------------------------------

    def restore(self) -> None:
        """At start: load the checkpoint, roll back Started entries, rewrite the CDI spec of
        every completed claim (the kubelet starts containers of prepared claims without asking
        again, and /var/run/cdi is a tmpfs a reboot empties) and nudge their MPS daemons.
        Raises CheckpointError when the file cannot be trusted. Blocking."""
        with self._lock:
            self._restore()

    def _restore(self) -> None:
        cp = self._checkpoint
        cp.load()
        rebooted = cp.rebooted
        rolled_back = rewritten = 0
        for entry in cp:
            if entry.state is State.STARTED:
                self._roll_back(entry, "interrupted prepare")
                rolled_back += 1
                continue
            if entry.cdi_spec is not None:
                cdi_specs.write_spec(self._cdi_dir, entry.cdi_spec, self._spec_path(entry.uid))
                rewritten += 1
            for d in entry.devices:
                if d.mode == Mode.SM_SHARING.value and self._mps is not None:
                    self._mps.ensure(GpuUuid(d.gpu))
        if rebooted:
            cp.save()  # the entries belong to this boot now
        if self._on_prepared is not None:  # a status write a restart cut short is done again
            for entry in cp:
                self._on_prepared(entry, None)
        self._restored = True
        logs.log(
            _log,
            "checkpoint restored",
            claims=len(cp),
            rolled_back=rolled_back,
            specs_rewritten=rewritten,
            rebooted=rebooted,
        )

    def _roll_back(self, entry: ClaimEntry, why: str) -> None:
        cdi_specs.remove_spec(self._spec_path(entry.uid))
        self._checkpoint.remove(entry.uid)
        logs.log(_log, "prepare rolled back", claim=_where(entry), uid=entry.uid, reason=why)

    def _spec_path(self, uid: str) -> Path:
        return cdi_specs.claim_spec_path(self._cdi_dir, uid)

    # -- what others read -------------------------------------------------------------------

    def prepared(self) -> list[ClaimEntry]:
        with self._lock:
            return list(self._checkpoint)

    def gpus_in_use(self) -> set[GpuUuid]:
        with self._lock:
            return {GpuUuid(d.gpu) for e in self._checkpoint for d in e.devices}

    # -- NodePrepareResources ---------------------------------------------------------------

    def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        """An answer for every claim UID: its devices, or its error. Blocking."""
        out: dict[str, PrepareResult] = {}
        with self._lock:
            if not self._restored:
                self._restore()
            fresh: list[tuple[ClaimEntry, dict[str, Any] | None]] = []
            tally = Tally.of(list(self._checkpoint))  # what is prepared, as claims add to it
            for ref in claims:
                try:
                    out[ref.uid] = self._prepare_one(ref, fresh, tally)
                except (ClaimError, OSError, cdi_specs.CdiError) as exc:
                    logs.log(
                        _log,
                        "prepare refused",
                        level=logging.WARNING,
                        claim=f"{ref.namespace}/{ref.name}",
                        uid=ref.uid,
                        reason=str(exc),
                    )
                    out[ref.uid] = PrepareResult(error=str(exc))
            self._make_durable(out)
            if self._on_prepared is not None:  # only what the answer reports prepared
                for entry, claim in fresh:
                    if out[entry.uid].error is None:
                        self._on_prepared(entry, claim)
        return out

    def _make_durable(self, out: dict[str, PrepareResult]) -> None:
        """One durable write per call, before any answer leaves: the claims' Started and
        Completed entries were appended to the checkpoint's journal without a sync, so 8
        claims cost one fdatasync, not 8 (a crash before it leaves their Started entries,
        rolled back at start). Should it fail, no claim is reported prepared; the entries stay
        Completed in memory, so the kubelet's retry answers them (and saves them)."""
        if not any(r.error is None for r in out.values()):
            return
        try:
            if self._checkpoint.compaction_due(slack=4):  # seldom: prepares without unprepares
                self._checkpoint.save()
            else:
                self._checkpoint.sync()
        except OSError as exc:
            for uid, r in out.items():
                if r.error is None:
                    out[uid] = PrepareResult(error=f"checkpoint not saved: {exc}")

    def _prepare_one(
        self,
        ref: ClaimRef,
        fresh: list[tuple[ClaimEntry, dict[str, Any] | None]],
        tally: Tally,
    ) -> PrepareResult:
        """The claim's answer; what it prepared (and the claim as read) goes on `fresh`, what
        it holds onto `tally`."""
        done = self._checkpoint.get(ref.uid)
        if done is not None and done.state is State.COMPLETED:
            if done.cdi_spec is not None:  # cheap when unchanged; brings back a deleted file
                cdi_specs.write_spec(self._cdi_dir, done.cdi_spec, self._spec_path(ref.uid))
            fresh.append((done, None))
            return _answer(done)
        if done is not None:
            self._roll_back(done, "prepare asked again")
            tally.remove(done.devices)
        try:
            claim = self._claims.get(ref.namespace, ref.name, ref.uid)
        except ClaimsUnavailable as exc:
            raise ClaimError(
                f"cannot read ResourceClaim {ref.namespace}/{ref.name}: {exc}"
            ) from None
        if claim is None:
            raise ClaimError(f"ResourceClaim {ref.namespace}/{ref.name} not found")
        results = driver_results(claim, ref.uid, self.driver, self.node_name)
        # planned against a copy: the claim's holdings join the call's once it is prepared
        planned = self._planner.plan(
            ref.uid, claim, results, self._config(), self._plan(), tally.copy()
        )
        spec = claim_spec(planned)
        entry = ClaimEntry(
            ref.uid, ref.namespace, ref.name, State.STARTED, tuple(p.entry for p in planned), spec
        )
        text = (
            cdi_specs.encode_spec(spec) if spec is not None else None
        )  # the file's and the line's
        self._checkpoint.put(entry, durable=False, spec_text=text)  # Completed: durably below
        try:  # each sm-sharing share's daemon was ensured while planning (reclaim needs it)
            if spec is not None:  # a fresh claim: no file of ours to compare against
                cdi_specs.write_spec(
                    self._cdi_dir,
                    spec,
                    self._spec_path(ref.uid),
                    text=text,
                    checked=True,
                    new=True,
                )
            entry = self._checkpoint.complete(ref.uid, save=False)  # prepare() saves once
        except BaseException as exc:
            self._roll_back(entry, f"failed: {exc}")
            raise
        tally.add(entry.devices)
        for p in planned:
            d = p.entry
            logs.log_soon(
                _log,
                "prepared",
                claim=f"{ref.namespace}/{ref.name}",
                uid=ref.uid,
                request=d.request,
                device=d.device,
                gpu=d.gpu,
                mode=d.mode,
                request_mib=d.request_bytes // MIB,
                limit_mib=d.limit_mib if d.limit_mib is not None else "-",
                enforcement=",".join(d.enforcement) or "-",
                share=d.share_id or "-",
            )
        fresh.append((entry, claim))
        return _answer(entry)

    # -- NodeUnprepareResources -------------------------------------------------------------

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str | None]:
        """UID → None when undone (or never prepared), else the error. Blocking."""
        out: dict[str, str | None] = {}
        with self._lock:
            if not self._restored:
                self._restore()
            removed = 0
            for ref in claims:
                entry = self._checkpoint.get(ref.uid)
                if entry is None:
                    out[ref.uid] = None  # unknown or already undone: success
                    continue
                try:
                    cdi_specs.remove_spec(self._spec_path(ref.uid))
                    self._checkpoint.remove(ref.uid, durable=False)  # synced once, below
                except OSError as exc:
                    out[ref.uid] = f"unpreparing {ref.namespace}/{ref.name}: {exc}"
                    continue
                removed += 1
                out[ref.uid] = None
                if self._on_unprepared is not None:
                    self._on_unprepared(ref.uid)
                logs.log_soon(
                    _log,
                    "unprepared",
                    claim=_where(entry),
                    uid=ref.uid,
                    gpus=",".join(dict.fromkeys(d.gpu for d in entry.devices)),
                )
            if removed:  # unknown claims (a kubelet retry after a restart) change nothing
                self._settle_removals()
        return out

    def _settle_removals(self) -> None:
        """One sync for the call's removals (an entry resurrected by a power loss would hold
        its device's capacity against later claims), and the journal folded into the
        snapshot when it has grown: here, off the prepare path. A failure is logged, not
        answered: the claims are undone, and the next change rewrites the snapshot."""
        try:
            if self._checkpoint.compaction_due():
                self._checkpoint.save()
            else:
                self._checkpoint.sync()
        except OSError as exc:
            logs.log(_log, "checkpoint not synced", level=logging.WARNING, error=str(exc))


def _where(entry: ClaimEntry) -> str:
    return f"{entry.namespace}/{entry.name}"
