"""Allocation ledger: persistence across restarts, corruption, counts, reconcile."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.ledger.record import (
    FOLDING_FILE,
    JOURNAL_FILE,
    LEDGER_FILE,
    AllocationRecord,
    Listing,
    read_records,
)
from deviceplugin.ledger.store import Ledger
from deviceplugin.model import Delivery, Enforcement, GpuUuid, Mode, SliceId
from deviceplugin.plumbing import fsutil

GPU = GpuUuid("GPU-aaaa")


def record(
    *ids: str, mode: Mode = Mode.SM_SHARING, created: float = 0.0, spec: str | None = None
) -> AllocationRecord:
    return AllocationRecord(
        device_ids=tuple(SliceId(i) for i in sorted(ids)),
        resource="nvidia.com/gpu-fraction.sm-sharing",
        gpus=(GpuUuid(ids[0].split("::")[0]),),
        mode=mode,
        request_mib=1024 * len(ids),
        limit_mib=1024 * len(ids),
        enforcement=(Enforcement.MPS_PINNED_LIMIT,),
        delivery=Delivery.CDI,
        ceiling_source=None,
        ceiling_policy=None,
        cdi_spec=spec,
        created=created,
    )


def test_survives_restart(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    a = record("GPU-aaaa::1", "GPU-aaaa::0")
    ledger.add(a)
    ledger.add(record("GPU-bbbb::0"))
    again = Ledger(tmp_path)
    assert again.records() == ledger.records()
    assert again.get(("GPU-aaaa::0", "GPU-aaaa::1")) == a
    assert a.key == ("GPU-aaaa::0", "GPU-aaaa::1")


def test_counts_and_used_ids(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    ledger.add(record("GPU-aaaa::0"))
    ledger.add(record("GPU-aaaa::1", "GPU-aaaa::2"))
    ledger.add(record("GPU-aaaa::1", "GPU-aaaa::2"))  # same key replaces
    ledger.add(record("GPU-bbbb::0"))
    assert ledger.live_count(GPU, Mode.SM_SHARING) == 2
    assert ledger.live_count(GPU, Mode.TIME_SLICING) == 0
    assert ledger.used_ids("nvidia.com/gpu-fraction.sm-sharing") == {
        "GPU-aaaa::0",
        "GPU-aaaa::1",
        "GPU-aaaa::2",
        "GPU-bbbb::0",
    }
    assert ledger.used_ids("nvidia.com/gpu") == set()


def test_corrupt_file_is_set_aside_and_rebuilt(tmp_path: Path) -> None:
    (tmp_path / LEDGER_FILE).write_text("{not json")
    ledger = Ledger(tmp_path, clock=lambda: 1234.0)
    assert ledger.records() == []
    assert (tmp_path / f"{LEDGER_FILE}.corrupt-1234").read_text() == "{not json"
    assert json.loads((tmp_path / LEDGER_FILE).read_text()) == {"version": 1, "allocations": []}
    ledger.add(record("GPU-aaaa::0"))
    assert len(Ledger(tmp_path).records()) == 1


def test_wrong_shape_counts_as_corrupt(tmp_path: Path) -> None:
    (tmp_path / LEDGER_FILE).write_text(json.dumps({"version": 1, "allocations": [{"x": 1}]}))
    assert Ledger(tmp_path, clock=lambda: 5.0).records() == []
    assert (tmp_path / f"{LEDGER_FILE}.corrupt-5").exists()


def test_remove_deletes_spec(tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text("{}")
    ledger = Ledger(tmp_path / "state")
    ledger.add(record("GPU-aaaa::0", spec=str(spec)))
    assert ledger.remove(("GPU-aaaa::0",)) is not None
    assert not spec.exists()
    assert ledger.remove(("GPU-aaaa::0",)) is None
    assert Ledger(tmp_path / "state").records() == []


def test_reconcile(tmp_path: Path) -> None:
    now = [1000.0]
    specs = []
    for n in range(4):
        p = tmp_path / f"spec{n}.json"
        p.write_text("{}")
        specs.append(p)
    ledger = Ledger(tmp_path / "state", clock=lambda: now[0], startup_grace=0.0)
    ledger.add(record("GPU-aaaa::0", created=0.0, spec=str(specs[0])))  # gone
    ledger.add(record("GPU-aaaa::1", "GPU-aaaa::2", created=0.0, spec=str(specs[1])))  # live
    ledger.add(record("GPU-aaaa::3", "GPU-aaaa::4", created=0.0, spec=str(specs[2])))  # overlaps
    ledger.add(record("GPU-aaaa::5", created=990.0, spec=str(specs[3])))  # too young
    gone = ledger.reconcile(
        Listing.of([{"GPU-aaaa::1", "GPU-aaaa::2"}, ["GPU-aaaa::3"]]), grace=60.0
    )
    assert [r.key for r in gone] == [("GPU-aaaa::0",)]
    assert [s.exists() for s in specs] == [False, True, True, True]
    assert len(Ledger(tmp_path / "state").records()) == 3
    now[0] = 2000.0
    gone = ledger.reconcile(Listing.of([]), grace=60.0)
    assert len(gone) == 3
    assert not any(s.exists() for s in specs)


def test_journal_replays_after_a_crash_and_skips_a_torn_line(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    ledger.add(record("GPU-aaaa::0"))
    ledger.add(record("GPU-aaaa::1"))
    ledger.remove(("GPU-aaaa::0",))
    # what an Allocate writes is one appended line, not a rewrite of every record
    assert len((tmp_path / JOURNAL_FILE).read_text().splitlines()) == 3
    with (tmp_path / JOURNAL_FILE).open("a") as journal:
        journal.write('{"op": "add", "record": {"devi')  # the plugin died mid-append
    again = Ledger(tmp_path)
    assert [r.key for r in again.records()] == [("GPU-aaaa::1",)]
    # loading folds the journal into the snapshot
    assert not (tmp_path / JOURNAL_FILE).exists()
    snapshot = json.loads((tmp_path / LEDGER_FILE).read_text())
    assert [a["deviceIds"] for a in snapshot["allocations"]] == [["GPU-aaaa::1"]]


def _journal_lines(state: Path) -> list[str]:
    journal = state / JOURNAL_FILE
    return journal.read_text().splitlines() if journal.exists() else []  # folded whole


def test_journal_is_compacted_as_it_grows(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    for n in range(200):
        ledger.add(record(f"GPU-aaaa::{n}"))
        if n % 2:
            ledger.remove((f"GPU-aaaa::{n - 1}",))
    assert ledger.wait_durable()  # the syncer folds what grew
    assert len(_journal_lines(tmp_path)) <= 2 * 100 + 1
    assert len(Ledger(tmp_path).records()) == 100


def test_a_crash_in_a_compaction_the_syncer_did_not_keep_up_with_loses_no_removal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # When the syncer falls far behind, a change writes the snapshot itself; a crash before
    # the old journal is removed leaves it beside the new snapshot, and replayed there it must
    # end in the same records: a removal it lacks would bring an allocation back.
    monkeypatch.setattr(Ledger, "_fold", lambda self: None)  # the syncer never keeps up
    ledger = Ledger(tmp_path)
    ledger.add(record("GPU-aaaa::kept"))  # an odd line: the first compaction is a removal's
    real = Ledger._compact
    crashes: list[tuple[Path, list[Any]]] = []

    def compact(self: Ledger, records: Any) -> None:
        journal = tmp_path / JOURNAL_FILE
        old = journal.read_bytes() if journal.exists() else b""
        real(self, records)
        crashed = tmp_path / f"crash-{len(crashes)}"
        crashed.mkdir()
        (crashed / LEDGER_FILE).write_bytes((tmp_path / LEDGER_FILE).read_bytes())
        (crashed / JOURNAL_FILE).write_bytes(old)
        crashes.append((crashed, sorted(records)))

    monkeypatch.setattr(Ledger, "_compact", compact)
    for n in range(300):
        ledger.add(record(f"GPU-aaaa::{n}"))
        ledger.remove((f"GPU-aaaa::{n}",))
    assert crashes and crashes[0][1] == [("GPU-aaaa::kept",)]
    for crashed, expected in crashes:
        assert sorted(r.key for r in read_records(crashed)) == expected


def test_a_compaction_that_fails_fails_no_change_already_journaled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Ledger, "_fold", lambda self: None)  # the syncer never keeps up
    real = fsutil.atomic_write

    def full_disk(path: Path, *args: Any, **kwargs: Any) -> None:
        if Path(path).name == LEDGER_FILE:
            raise OSError(28, "No space left on device")
        real(path, *args, **kwargs)

    ledger = Ledger(tmp_path)
    monkeypatch.setattr(fsutil, "atomic_write", full_disk)
    ledger.add(record("GPU-aaaa::kept"))
    for n in range(200):  # 401 lines: past the 256 at which a change compacts by itself
        ledger.add(record(f"GPU-aaaa::{n}"))
        ledger.remove((f"GPU-aaaa::{n}",))
    assert len(_journal_lines(tmp_path)) == 401  # every change still in the journal
    assert read_records(tmp_path) == ledger.records() == [record("GPU-aaaa::kept")]


def test_a_grown_journal_is_folded_by_the_syncer_not_by_an_allocate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = Ledger(tmp_path)
    writers: list[str] = []
    real = fsutil.atomic_write

    def recording(path: Path, *args: Any, **kwargs: Any) -> None:
        if Path(path).name == LEDGER_FILE:
            writers.append(threading.current_thread().name)
        real(path, *args, **kwargs)

    monkeypatch.setattr(fsutil, "atomic_write", recording)
    for n in range(150):  # the same ten devices again and again: a line each, past 64
        ledger.add(record(f"GPU-aaaa::{n % 10}"))
    assert ledger.wait_durable()
    assert writers and set(writers) == {"ledger-sync"}  # never the caller's thread
    assert len(_journal_lines(tmp_path)) < 150
    assert not (tmp_path / FOLDING_FILE).exists()
    assert len(Ledger(tmp_path).records()) == 10


def test_a_fold_cut_short_by_a_crash_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = fsutil.atomic_write

    def dies_on_the_snapshot(path: Path, *args: Any, **kwargs: Any) -> None:
        if Path(path).name == LEDGER_FILE:
            raise OSError("killed before the snapshot was written")
        real(path, *args, **kwargs)

    ledger = Ledger(tmp_path)
    monkeypatch.setattr(fsutil, "atomic_write", dies_on_the_snapshot)
    for n in range(70):  # past the fold's threshold: the syncer renames the journal aside
        ledger.add(record(f"GPU-aaaa::{n % 2}"))
    assert ledger.wait_durable()
    assert (tmp_path / FOLDING_FILE).exists() and not (tmp_path / JOURNAL_FILE).exists()
    ledger.remove(("GPU-aaaa::0",))  # appends go on into a new journal, not the folded one
    ledger.add(record("GPU-aaaa::2"))
    assert [json.loads(line)["op"] for line in _journal_lines(tmp_path)] == ["remove", "add"]
    monkeypatch.setattr(fsutil, "atomic_write", real)
    again = Ledger(tmp_path)
    assert [r.key for r in again.records()] == [("GPU-aaaa::1",), ("GPU-aaaa::2",)]
    assert not (tmp_path / FOLDING_FILE).exists()
    assert [r.key for r in read_records(tmp_path)] == [("GPU-aaaa::1",), ("GPU-aaaa::2",)]


def test_reconcile_drops_a_listed_then_unlisted_record_at_once(tmp_path: Path) -> None:
    now = [1000.0]
    ledger = Ledger(tmp_path, clock=lambda: now[0], startup_grace=0.0)
    ledger.add(record("GPU-aaaa::0", created=999.0))
    assert ledger.reconcile(Listing.of([]), grace=60.0) == []  # never listed, young
    assert ledger.reconcile(Listing.of([["GPU-aaaa::0"]]), grace=60.0) == []
    gone = ledger.reconcile(Listing.of([]), grace=60.0)  # listed before, not now: gone
    assert [r.key for r in gone] == [("GPU-aaaa::0",)]


def test_reconcile_keeps_an_init_container_but_not_a_stale_overlap(tmp_path: Path) -> None:
    now = [5000.0]
    ledger = Ledger(tmp_path, clock=lambda: now[0], startup_grace=0.0)
    ledger.add(record("GPU-aaaa::0", "GPU-aaaa::1", created=4000.0))  # init container
    ledger.add(record("GPU-aaaa::0", created=4000.2))  # its app container, same admission
    ledger.add(record("GPU-aaaa::5", "GPU-aaaa::6", created=1000.0))  # an old pod's
    ledger.add(record("GPU-aaaa::5", created=4900.0))  # a new pod got one of its slices
    gone = ledger.reconcile(Listing.of([["GPU-aaaa::0"], ["GPU-aaaa::5"]]), grace=60.0)
    assert [r.key for r in gone] == [("GPU-aaaa::5", "GPU-aaaa::6")]
    assert [r.key for r in ledger.records()] == [
        ("GPU-aaaa::0",),
        ("GPU-aaaa::0", "GPU-aaaa::1"),
        ("GPU-aaaa::5",),
    ]


def listing(*held: tuple[str, str, list[str]], pods: tuple[str, ...] = ()) -> Listing:
    """A pod-resources List: (pod, container, devices) held, plus pods shown without them."""
    return Listing(
        {tuple(sorted(ids)): ("ns", pod) for pod, _container, ids in held},
        frozenset(("ns", p) for p in {*pods, *(pod for pod, _, _ in held)}),
    )


def test_a_finished_init_containers_record_stays_while_its_pod_is_listed(tmp_path: Path) -> None:
    now = [1000.0]
    spec = tmp_path / "init.json"
    spec.write_text("{}")
    ledger = Ledger(tmp_path / "state", clock=lambda: now[0], startup_grace=0.0)
    # The init container asked for 2 slices, the app container for another 1 (no overlap).
    ledger.add(record("GPU-aaaa::0", "GPU-aaaa::1", created=1000.0, spec=str(spec)))
    ledger.add(record("GPU-aaaa::7", created=1000.5))
    ledger.reconcile(listing(("web", "init", ["GPU-aaaa::0", "GPU-aaaa::1"])))
    now[0] = 5000.0  # long past every grace: the init container finished, its pod runs on
    gone = ledger.reconcile(listing(("web", "app", ["GPU-aaaa::7"])))
    assert gone == [] and spec.exists()  # a restart of the init container replays its answer
    assert Ledger(tmp_path / "state").get(("GPU-aaaa::0", "GPU-aaaa::1")) is not None
    gone = ledger.reconcile(listing(pods=("other",)))  # the pod is gone
    assert sorted(r.key for r in gone) == [("GPU-aaaa::0", "GPU-aaaa::1"), ("GPU-aaaa::7",)]
    assert not spec.exists()


def test_the_owner_survives_a_restart(tmp_path: Path) -> None:
    now = [1000.0]
    ledger = Ledger(tmp_path, clock=lambda: now[0], startup_grace=0.0)
    ledger.add(record("GPU-aaaa::0", created=1000.0))
    ledger.reconcile(listing(("web", "init", ["GPU-aaaa::0"])))
    again = Ledger(tmp_path, clock=lambda: now[0], startup_grace=0.0)
    assert again.get(("GPU-aaaa::0",)) is not None
    assert again.reconcile(listing(pods=("web",))) == []  # init done, pod alive
    assert len(again.reconcile(listing())) == 1


def test_the_same_devices_again_start_a_fresh_record(tmp_path: Path) -> None:
    now = [1000.0]
    ledger = Ledger(tmp_path, clock=lambda: now[0], startup_grace=0.0)
    ledger.add(record("GPU-aaaa::0", created=1000.0))
    ledger.reconcile(listing(("old", "c", ["GPU-aaaa::0"])))
    # The old pod ended and the kubelet gave its slice to a new pod before we saw it go:
    now[0] = 2000.0
    ledger.add(record("GPU-aaaa::0", created=2000.0))
    # The new container is not committed yet; the old one is no longer listed.
    assert ledger.reconcile(listing(pods=("new",))) == []
    assert ledger.get(("GPU-aaaa::0",)) is not None


def test_nothing_is_dropped_in_the_first_minute_after_start(tmp_path: Path) -> None:
    now = [1000.0]
    first = Ledger(tmp_path, clock=lambda: now[0], startup_grace=0.0)
    first.add(record("GPU-aaaa::0", created=10.0))
    first.reconcile(listing(("web", "c", ["GPU-aaaa::0"])))
    # A reboot: the kubelet restores its pods and lists nothing yet.
    now[0] = 2000.0
    ledger = Ledger(tmp_path, clock=lambda: now[0])
    assert ledger.reconcile(listing()) == []
    now[0] += 59.0
    assert ledger.reconcile(listing()) == []
    now[0] += 2.0
    assert [r.key for r in ledger.reconcile(listing())] == [("GPU-aaaa::0",)]


def test_cdi_body_and_owner_are_kept_and_old_records_still_load(tmp_path: Path) -> None:
    body = {"cdiVersion": "0.3.0", "kind": "gpu-fraction.dev/gpu", "devices": []}
    ledger = Ledger(tmp_path)
    ledger.add(replace(record("GPU-aaaa::0"), cdi_body=body, owner=("ns", "p")))
    (loaded,) = Ledger(tmp_path).records()
    assert loaded.cdi_body == body and loaded.owner == ("ns", "p")
    # A snapshot written before either field existed.
    old = record("GPU-aaaa::1").to_json()
    del old["cdiBody"], old["owner"]
    (tmp_path / JOURNAL_FILE).unlink(missing_ok=True)
    (tmp_path / LEDGER_FILE).write_text(json.dumps({"version": 1, "allocations": [old]}))
    (again,) = Ledger(tmp_path).records()
    assert again.cdi_body is None and again.owner is None


def test_the_syncer_syncs_only_what_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each fsync is a hand-off of the GIL that can land in a reply: an append syncs the
    journal (and its directory when the journal is new), not the snapshot."""
    synced: list[Path] = []
    real = fsutil.fsync_path

    def recording(path: Path) -> None:
        synced.append(Path(path))
        real(path)

    ledger = Ledger(tmp_path)
    ledger.add(record("GPU-a::0"))
    assert ledger.wait_durable()
    monkeypatch.setattr(fsutil, "fsync_path", recording)
    ledger.add(record("GPU-a::1"))
    assert ledger.wait_durable()
    assert synced == [tmp_path / JOURNAL_FILE]
    ledger.remove(("GPU-a::0",))
    ledger.remove(("GPU-a::1",))
    assert ledger.wait_durable()
    assert set(synced) == {tmp_path / JOURNAL_FILE}


def test_a_journal_line_embeds_the_spec_text_it_was_given(tmp_path: Path) -> None:
    body = {"cdiVersion": "0.3.0", "kind": "gpu-fraction.dev/gpu", "devices": [{"name": "x"}]}
    text = json.dumps(body, separators=(",", ":"))
    plain = replace(record("GPU-a::0", spec="/cdi/x.json"), cdi_body=body)
    given = replace(plain, cdi_json=text)
    assert text.encode() in given.journal_line()
    assert json.loads(given.journal_line()) == json.loads(plain.journal_line())
    ledger = Ledger(tmp_path)
    ledger.add(given)
    (again,) = Ledger(tmp_path).records()
    assert again.cdi_body == body and again == given


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"owner": ("default", "web")},
        {"ceiling_source": 'pod "a" container b', "ceiling_policy": "applied", "limit_mib": 4096},
        {
            "mode": Mode.EXCLUSIVE,
            "gpus": (GpuUuid("GPU-a"), GpuUuid("GPU-b")),
            "request_mib": None,
            "limit_mib": None,
            "enforcement": (),
            "delivery": Delivery.ENV,
        },
        {"created": 1765000000.123456789, "cdi_spec": "/var/run/cdi/a b\u00e9.json"},
    ],
)
def test_a_journal_add_line_from_shared_pieces_reads_as_the_record(change: dict[str, Any]) -> None:
    """The shape's shared members are encoded once and reused: two records sharing them but
    for their devices and times must each read back as themselves."""
    body = {"cdiVersion": "0.5.0", "kind": "gpu-fraction.dev/gpu", "devices": [{"name": "x"}]}
    text = json.dumps(body, separators=(",", ":"))
    first = replace(record("GPU-a::0", spec="/cdi/x.json"), cdi_body=body, cdi_json=text)
    for base in (first, replace(first, device_ids=(SliceId("GPU-a::7"),), created=9.5)):
        given = replace(base, **change)
        line = given.journal_line()
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        assert json.loads(line) == {"op": "add", "record": given.to_json()}
        assert AllocationRecord.from_json(json.loads(line)["record"]) == given


def test_changes_are_made_durable_off_the_callers_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kubelet fsyncs its checkpoint of an answer and replays it after a reboot: the record
    must become durable too, but not on Allocate's reply path."""
    synced: list[Path] = []
    release = threading.Event()
    real = fsutil.fsync_path

    def slow_fsync(path: Path) -> None:
        release.wait(10)  # a disk that takes its time
        synced.append(path)
        real(path)

    monkeypatch.setattr(fsutil, "fsync_path", slow_fsync)
    ledger = Ledger(tmp_path)
    ledger.add(record("GPU-a::0", "GPU-a::1"))  # returns while the fsync still waits
    assert synced == [] and not ledger.wait_durable(timeout=0.05)
    release.set()
    assert ledger.wait_durable(timeout=10)
    assert tmp_path / JOURNAL_FILE in synced and tmp_path in synced
    assert os.path.getsize(tmp_path / JOURNAL_FILE) > 0


def test_a_journal_deleted_behind_its_back_is_rebuilt_from_memory(tmp_path: Path) -> None:
    """The journal stays open between appends: one deleted under it is noticed by the sync
    thread, which writes every record into the snapshot and starts a new journal."""
    ledger = Ledger(tmp_path)
    ledger.add(record("GPU-aaaa::0"))
    assert ledger.wait_durable()
    (tmp_path / JOURNAL_FILE).unlink()
    ledger.add(record("GPU-aaaa::1"))  # written into the deleted file
    assert ledger.wait_durable()
    ledger.add(record("GPU-aaaa::2"))  # a new journal
    assert [r.key for r in Ledger(tmp_path).records()] == [
        ("GPU-aaaa::0",),
        ("GPU-aaaa::1",),
        ("GPU-aaaa::2",),
    ]
