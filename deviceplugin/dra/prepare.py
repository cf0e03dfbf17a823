"""NodePrepareResources and NodeUnprepareResources without gRPC: the Preparer (DESIGN section 10).

Per claim: read it (ClaimSource: one GET each, concurrent, before any lock is taken), check UID
and allocation, take this driver's results in this node's pool, plan them (`claim_plan`: caps
exactly as Allocate's, the MPS daemon ensured, no device prepared beyond its capacity across
claims, the last line of defence against a double allocation), write one CDI spec per claim,
and checkpoint Started before the work and Completed after. Work is serialised per claim and
per GPU, never per node: a claim waiting for its GPU's MPS daemon holds up no other GPU. With
rolling updates, plugin instances of one node take turns (`locks.InstanceLock`). A completed
claim is answered from the checkpoint; unprepare needs only the checkpoint. Over 400 lines on
purpose: prepare and unprepare share their locks, checkpoint lines and rollbacks, read as one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from deviceplugin.cdi import specs as cdi_specs
from deviceplugin.config.settings import Config
from deviceplugin.dra.checkpoint import Checkpoint, ClaimEntry, State
from deviceplugin.dra.claim_plan import ClaimPlanner, Tally, claim_spec
from deviceplugin.dra.locks import InstanceLock, KeyedLocks
from deviceplugin.dra.results import ClaimError, base_request, driver_results
from deviceplugin.model import MIB, GpuUuid, Mode
from deviceplugin.mps.gate import MpsGate
from deviceplugin.plan import SlicePlan
from deviceplugin.plumbing import logs

_log = logs.get("dra.prepare")

ClaimKey = tuple[str, str]  # (namespace, name)


class ClaimsUnavailable(Exception):
    """The API server could not be asked (the claim may well exist)."""


class ClaimSource(Protocol):
    def get_many(
        self, keys: Sequence[ClaimKey]
    ) -> Mapping[ClaimKey, dict[str, Any] | ClaimsUnavailable | None]:
        """Each ResourceClaim as the API server's JSON now (a GET each, concurrently), None
        when not found, or why it could not be read."""
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
    # The kubelet hands a container the devices whose request_names hold the request name
    # it names, compared exactly (claiminfo.go, cdiDevicesAsList), and a container names a
    # request, never a subrequest: `request/subrequest` goes out as `request`, as the
    # upstream helper's stripSubrequestNames does. The checkpoint keeps the full name.
    return PrepareResult(
        tuple(
            PreparedDevice(
                (base_request(d.request),), d.pool, d.device, d.cdi_device_ids, d.share_id
            )
            for d in entry.devices
        )
    )


def _gpu_key(gpu: str) -> str:
    return f"gpu:{gpu}"


def _claim_key(uid: str) -> str:
    return f"claim:{uid}"


class Preparer:
    """Idempotent, checkpointed prepare/unprepare for one node's DRA GPUs, serialised per
    claim and per GPU."""

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
        instance_lock: Path | None = None,
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
        self._state = threading.Lock()  # the checkpoint (memory and files); held briefly
        self._keys = KeyedLocks()  # per claim, then per GPU: who waits on whom
        self._restore_lock = threading.Lock()
        self._restored = False
        # Another instance's changes since ours: `stamp` as we left the files.
        self._left: tuple[Any, ...] | None = None
        self.instances = InstanceLock(instance_lock, self._instance_acquired, self._leaving)
        self.reloads = 0  # checkpoints read again after another instance changed them
        # Told (must not block) of every completed claim answered, and of every claim undone;
        # the claim-status writer queues them.
        self._on_prepared = on_prepared
        self._on_unprepared = on_unprepared

    # -- start ------------------------------------------------------------------------------

    def restore(self) -> None:
        """At start: load the checkpoint, roll back Started entries, rewrite the CDI spec of
        every completed claim (the kubelet starts containers of prepared claims without asking
        again, and /var/run/cdi is a tmpfs a reboot empties) and nudge their MPS daemons.
        Raises CheckpointError when the file cannot be trusted. Blocking."""
        with self.instances.held():
            self._ensure_restored(force=True)

    def _ensure_restored(self, force: bool = False) -> None:
        with self._restore_lock:
            if self._restored and not force:
                return
            with self._state:
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

    def _instance_acquired(self) -> None:
        """This instance's turn: read the checkpoint again if another instance changed it."""
        with self._state:
            if not self._restored or self._left is None:
                return
            if self._checkpoint.stamp() == self._left:
                return
            self._checkpoint.load()
            self.reloads += 1
        logs.log(_log, "checkpoint changed by another instance; read again",
                 claims=len(self._checkpoint))  # fmt: skip

    def _leaving(self) -> None:
        """Before another instance may take its turn: our changes are in the files."""
        with self._state:
            try:
                self._checkpoint.flush()
            except OSError as exc:
                logs.log(_log, "checkpoint not flushed", level=logging.WARNING, error=str(exc))
            self._left = self._checkpoint.stamp()

    def _roll_back(self, entry: ClaimEntry, why: str) -> None:
        """Under the state lock."""
        cdi_specs.remove_spec(self._spec_path(entry.uid))
        self._checkpoint.remove(entry.uid)
        logs.log(_log, "prepare rolled back", claim=_where(entry), uid=entry.uid, reason=why)

    def _spec_path(self, uid: str) -> Path:
        return cdi_specs.claim_spec_path(self._cdi_dir, uid)

    # -- what others read -------------------------------------------------------------------

    def prepared(self) -> list[ClaimEntry]:
        with self._state:
            return list(self._checkpoint)

    def gpus_in_use(self) -> set[GpuUuid]:
        with self._state:
            return {GpuUuid(d.gpu) for e in self._checkpoint for d in e.devices}

    @contextmanager
    def _call(self) -> Iterator[None]:
        with self.instances.held():
            self._ensure_restored()
            yield

    # -- NodePrepareResources ---------------------------------------------------------------

    def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        """An answer for every claim UID: its devices, or its error. Blocking."""
        out: dict[str, PrepareResult] = {}
        # The GETs go first, holding nothing: only claims not prepared yet need one.
        with self._state:
            done = {r.uid for r in claims if self._completed(r.uid) is not None}
        read = self._read([r for r in claims if r.uid not in done])
        with self._call():
            fresh: list[tuple[ClaimEntry, dict[str, Any] | None]] = []
            for ref in claims:
                try:
                    out[ref.uid] = self._prepare_one(ref, read, fresh)
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

    def _completed(self, uid: str) -> ClaimEntry | None:
        entry = self._checkpoint.get(uid)
        return entry if entry is not None and entry.state is State.COMPLETED else None

    def _read(
        self, refs: Sequence[ClaimRef]
    ) -> dict[ClaimKey, dict[str, Any] | ClaimsUnavailable | None]:
        if not refs:
            return {}
        return dict(self._claims.get_many([(r.namespace, r.name) for r in refs]))

    def _make_durable(self, out: dict[str, PrepareResult]) -> None:
        """One durable write per call, before any answer leaves: the claims' Started and
        Completed entries were appended to the checkpoint's journal without a sync, so 8
        claims cost one fdatasync, not 8 (a crash before it leaves their Started entries,
        rolled back at start). Should it fail, no claim is reported prepared; the entries stay
        Completed in memory, so the kubelet's retry answers them (and saves them)."""
        if not any(r.error is None for r in out.values()):
            return
        try:
            with self._state:
                if self._checkpoint.compaction_due(slack=4):  # seldom: no unprepares
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
        read: dict[ClaimKey, dict[str, Any] | ClaimsUnavailable | None],
        fresh: list[tuple[ClaimEntry, dict[str, Any] | None]],
    ) -> PrepareResult:
        """The claim's answer; what it prepared (and the claim as read) goes on `fresh`."""
        with self._keys.hold([_claim_key(ref.uid)]):
            with self._state:
                done = self._checkpoint.get(ref.uid)
                if done is not None and done.state is State.COMPLETED:
                    if done.cdi_spec is not None:  # cheap when unchanged; brings back a file
                        cdi_specs.write_spec(self._cdi_dir, done.cdi_spec, self._spec_path(ref.uid))
                    fresh.append((done, None))
                    return _answer(done)
                if done is not None:
                    self._roll_back(done, "prepare asked again")
            key = (ref.namespace, ref.name)
            if key not in read:  # answered from the checkpoint when the GETs went out
                read.update(self._read([ref]))
            claim = read[key]
            if isinstance(claim, ClaimsUnavailable):
                raise ClaimError(f"cannot read ResourceClaim {ref.namespace}/{ref.name}: {claim}")
            if claim is None:
                raise ClaimError(f"ResourceClaim {ref.namespace}/{ref.name} not found")
            results = driver_results(claim, ref.uid, self.driver, self.node_name)
            plan = self._plan()
            gpus = self._planner.gpus(plan, results)
            with self._keys.hold(_gpu_key(g) for g in gpus):
                return self._prepare_held(ref, claim, results, plan, fresh)

    def _prepare_held(
        self,
        ref: ClaimRef,
        claim: dict[str, Any],
        results: Sequence[Any],
        plan: SlicePlan,
        fresh: list[tuple[ClaimEntry, dict[str, Any] | None]],
    ) -> PrepareResult:
        """With the claim's and its GPUs' locks: plan, write, checkpoint."""
        with self._state:  # what is prepared on its GPUs (stable while we hold them)
            tally = Tally.of(list(self._checkpoint))
        planned = self._planner.plan(ref.uid, claim, results, self._config(), plan, tally)
        spec = claim_spec(planned)
        entry = ClaimEntry(
            ref.uid, ref.namespace, ref.name, State.STARTED, tuple(p.entry for p in planned), spec
        )
        text = cdi_specs.encode_spec(spec) if spec is not None else None  # file's and line's
        with self._state:
            self._checkpoint.put(entry, durable=False, spec_text=text)  # Completed: below
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
            with self._state:
                entry = self._checkpoint.complete(ref.uid, save=False)  # prepare() saves
        except BaseException as exc:
            with self._state:
                self._roll_back(entry, f"failed: {exc}")
            raise
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
        with self._call():
            removed = 0
            for ref in claims:
                error, gone = self._unprepare_one(ref)
                out[ref.uid] = error
                removed += gone
            if removed:  # unknown claims (a kubelet retry after a restart) change nothing
                self._settle_removals()
        return out

    def _unprepare_one(self, ref: ClaimRef) -> tuple[str | None, int]:
        with self._keys.hold([_claim_key(ref.uid)]):
            with self._state:
                entry = self._checkpoint.get(ref.uid)
            if entry is None:
                return None, 0  # unknown or already undone: success
            with self._keys.hold(_gpu_key(d.gpu) for d in entry.devices):
                try:
                    cdi_specs.remove_spec(self._spec_path(ref.uid))
                    with self._state:
                        self._checkpoint.remove(ref.uid, durable=False)  # synced once, below
                except OSError as exc:
                    return f"unpreparing {ref.namespace}/{ref.name}: {exc}", 0
        if self._on_unprepared is not None:
            self._on_unprepared(ref.uid)
        logs.log_soon(
            _log,
            "unprepared",
            claim=_where(entry),
            uid=ref.uid,
            gpus=",".join(dict.fromkeys(d.gpu for d in entry.devices)),
        )
        return None, 1

    def _settle_removals(self) -> None:
        """One sync for the call's removals (an entry resurrected by a power loss would hold
        its device's capacity against later claims), and the journal folded into the
        snapshot when it has grown: here, off the prepare path. A failure is logged, not
        answered: the claims are undone, and the next change rewrites the snapshot."""
        try:
            with self._state:
                if self._checkpoint.compaction_due():
                    self._checkpoint.save()
                else:
                    self._checkpoint.sync()
        except OSError as exc:
            logs.log(_log, "checkpoint not synced", level=logging.WARNING, error=str(exc))


def _where(entry: ClaimEntry) -> str:
    return f"{entry.namespace}/{entry.name}"
