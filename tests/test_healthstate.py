"""The health state file and operator clear requests: the contract between monitor and CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from deviceplugin.health import state as health_state
from deviceplugin.health.state import (
    HealthStateError,
    format_health_table,
    pending_clears,
    read_health,
    request_clear,
    take_clears,
    write_health,
)

GPU_A = "GPU-aaaaaaaa-1111-4222-8333-444444444444"
GPU_B = "GPU-bbbbbbbb-1111-4222-8333-444444444444"
T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z


def sample() -> dict[str, object]:
    return {
        "version": 1,
        "updatedAt": T0 + 60,
        "monitor": {"running": True, "pid": 4242},
        "gpus": {
            GPU_B: {"index": 1, "mode": "time-slicing", "health": "Healthy", "faults": {}},
            GPU_A: {
                "index": 0,
                "mode": "sm-sharing",
                "health": "Unhealthy",
                "faults": {
                    "gpu": {
                        "cause": "xid=79 class=reboot",
                        "since": T0,
                        "phase": "quiet",
                        "quietUntil": T0 + 30,
                    },
                    "mps-server": {"cause": "xid=43 class=application", "since": T0 + 5},
                },
            },
        },
    }


def test_write_then_read_round_trips(tmp_path: Path) -> None:
    write_health(tmp_path, sample())
    assert read_health(tmp_path) == sample()
    # Atomic write leaves no temp files behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["health.json"]


def test_read_missing_names_the_state_dir(tmp_path: Path) -> None:
    with pytest.raises(HealthStateError, match="is the plugin running with --state-dir"):
        read_health(tmp_path)


@pytest.mark.parametrize("body", ["{not json", "[]", '{"gpus": []}'])
def test_read_rejects_damaged_files(tmp_path: Path, body: str) -> None:
    health_state.state_path(tmp_path).write_text(body)
    with pytest.raises(HealthStateError):
        read_health(tmp_path)


def test_table_has_one_row_per_fault_and_per_healthy_gpu() -> None:
    text = format_health_table(sample())
    lines = text.splitlines()
    assert lines[0] == "monitor: running (pid 4242), updated 2023-11-14T22:14:20Z"
    assert lines[1].split() == [
        "INDEX", "GPU", "MODE", "HEALTH", "DOMAIN", "CAUSE", "SINCE", "PHASE",
    ]  # fmt: skip
    rows = lines[2:]
    assert len(rows) == 3
    # Index order: GPU A (index 0) first, its domains sorted.
    assert rows[0].startswith("0") and GPU_A in rows[0] and " gpu " in rows[0]
    assert "xid=79 class=reboot" in rows[0]
    assert "2023-11-14T22:13:20Z" in rows[0]
    assert rows[0].endswith("quiet until 2023-11-14T22:13:50Z")
    assert "mps-server" in rows[1] and "xid=43 class=application" in rows[1]
    assert rows[2].startswith("1") and GPU_B in rows[2] and "Healthy" in rows[2]
    # Columns line up: every row's CAUSE column starts at the header's CAUSE offset.
    col = lines[1].index("CAUSE")
    assert rows[0][col:].startswith("xid=79")
    assert rows[1][col:].startswith("xid=43")


def test_table_says_when_the_monitor_stopped() -> None:
    data = sample()
    data["monitor"] = {"running": False, "pid": 1}
    assert format_health_table(data).startswith("monitor: not running,")


def test_clear_request_round_trip(tmp_path: Path) -> None:
    request_clear(tmp_path, GPU_B, wall=T0)
    request_clear(tmp_path, GPU_A)
    assert pending_clears(tmp_path) == [GPU_A, GPU_B]
    body = json.loads((health_state.clear_dir(tmp_path) / f"{GPU_B}.json").read_text())
    assert body == {"gpu": GPU_B, "requestedAt": T0}
    assert take_clears(tmp_path) == [GPU_A, GPU_B]
    assert pending_clears(tmp_path) == []
    assert take_clears(tmp_path) == []


def test_repeated_request_is_one_request(tmp_path: Path) -> None:
    request_clear(tmp_path, GPU_A)
    request_clear(tmp_path, GPU_A)
    assert take_clears(tmp_path) == [GPU_A]


@pytest.mark.parametrize("bad", ["../etc/passwd", "GPU-a/b", "gpu-aaaa", "", "GPU-" + "a" * 80])
def test_clear_refuses_names_that_are_not_uuids(tmp_path: Path, bad: str) -> None:
    with pytest.raises(HealthStateError, match="not a GPU UUID"):
        request_clear(tmp_path, bad)
    assert not health_state.clear_dir(tmp_path).exists()


def test_clear_needs_an_existing_state_dir(tmp_path: Path) -> None:
    with pytest.raises(HealthStateError, match="does not exist"):
        request_clear(tmp_path / "missing", GPU_A)


def test_take_removes_junk_and_skips_temp_files(tmp_path: Path) -> None:
    directory = health_state.clear_dir(tmp_path)
    directory.mkdir()
    (directory / "junk.txt").write_text("x")
    (directory / ".GPU-x.json.tmp").write_text("partial")
    (directory / f"{GPU_A}.json").write_text("{}")
    assert take_clears(tmp_path) == [GPU_A]
    assert sorted(os.listdir(directory)) == [".GPU-x.json.tmp"]
