"""restore_cdi_specs: every recorded allocation's spec written again from the ledger."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from deviceplugin.cdi import specs as cdi_specs
from deviceplugin.ledger.replay import restore_cdi_specs
from deviceplugin.ledger.store import Ledger
from tests.test_allocator import SM, TS, Rig


def test_specs_come_back_byte_for_byte_and_old_records_are_counted(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    grants = [
        rig.allocator.allocate(TS, rig.ids(0, 0, 1)),
        rig.allocator.allocate(SM, rig.ids(1, 4)),
    ]
    files = {
        Path(str(g.record.cdi_spec)): Path(str(g.record.cdi_spec)).read_bytes() for g in grants
    }
    for path in files:
        path.unlink()  # a reboot empties the CDI tmpfs
    ledger = Ledger(tmp_path / "state")  # a fresh process reads the ledger
    assert restore_cdi_specs(ledger, rig.cdi_dir) == (2, 0)
    assert {p: p.read_bytes() for p in files} == files
    assert all(cdi_specs.validate_spec(json.loads(b)) == [] for b in files.values())


def test_a_record_without_a_body_is_not_guessed(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    grant = rig.allocator.allocate(TS, rig.ids(0, 2))
    rig.ledger.add(replace(grant.record, cdi_body=None))  # written by an older plugin
    Path(str(grant.record.cdi_spec)).unlink()
    assert restore_cdi_specs(Ledger(tmp_path / "state"), rig.cdi_dir) == (0, 1)
    assert not Path(str(grant.record.cdi_spec)).exists()


def test_a_moved_cdi_dir_gets_the_spec_and_the_record_follows(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    grant = rig.allocator.allocate(TS, rig.ids(0, 3))
    moved = tmp_path / "other-cdi"
    ledger = Ledger(tmp_path / "state")
    assert restore_cdi_specs(ledger, moved) == (1, 0)
    (record,) = ledger.records()
    assert Path(str(record.cdi_spec)).parent == moved and Path(str(record.cdi_spec)).exists()
    assert record.key == grant.record.key
