"""Allocation ledger: persistence across restarts, corruption, counts, reconcile."""

from __future__ import annotations

import json
from pathlib import Path

from deviceplugin.ledger import LEDGER_FILE, AllocationRecord, Ledger
from deviceplugin.model import Delivery, Enforcement, GpuUuid, Mode, SliceId

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
    ledger = Ledger(tmp_path / "state", clock=lambda: now[0])
    ledger.add(record("GPU-aaaa::0", created=0.0, spec=str(specs[0])))  # gone
    ledger.add(record("GPU-aaaa::1", "GPU-aaaa::2", created=0.0, spec=str(specs[1])))  # live
    ledger.add(record("GPU-aaaa::3", "GPU-aaaa::4", created=0.0, spec=str(specs[2])))  # overlaps
    ledger.add(record("GPU-aaaa::5", created=990.0, spec=str(specs[3])))  # too young
    gone = ledger.reconcile([{"GPU-aaaa::1", "GPU-aaaa::2"}, ["GPU-aaaa::3"]], grace=60.0)
    assert [r.key for r in gone] == [("GPU-aaaa::0",)]
    assert [s.exists() for s in specs] == [False, True, True, True]
    assert len(Ledger(tmp_path / "state").records()) == 3
    now[0] = 2000.0
    gone = ledger.reconcile([], grace=60.0)
    assert len(gone) == 3
    assert not any(s.exists() for s in specs)
