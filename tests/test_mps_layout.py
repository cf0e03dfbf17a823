"""The MPS on-disk contract: paths pinned, unsafe roots refused, markers round-trip."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from deviceplugin.mps import layout
from deviceplugin.mps.layout import DaemonMarker, LayoutError, MpsSettings

UUID = "GPU-11111111-2222-3333-4444-555555555555"


def test_layout_is_pinned(tmp_path: Path) -> None:
    root = tmp_path / "mps"
    assert layout.pipe_dir(root, UUID) == root / UUID / "pipe"
    assert layout.log_dir(root, UUID) == root / UUID / "log"
    assert layout.pid_file(root, UUID) == root / UUID / "pipe" / "nvidia-cuda-mps-control.pid"
    assert layout.control_socket(root, UUID) == root / UUID / "pipe" / "control"
    assert layout.privileged_socket(root, UUID) == root / UUID / "pipe" / "control_privileged"
    assert layout.control_log(root, UUID) == root / UUID / "log" / "control.log"
    assert layout.marker_path(root, UUID) == root / UUID / "daemon.json"


@pytest.mark.parametrize("bad", ["", "..", "GPU-../x", "GPU-a/b", "gpu-1234", "/etc", "GPU-a b"])
def test_uuid_checked_before_use_in_paths(tmp_path: Path, bad: str) -> None:
    with pytest.raises(LayoutError):
        layout.pipe_dir(tmp_path, bad)


def test_prepare_creates_dirs_with_explicit_modes(short_tmp: Path) -> None:
    root = short_tmp / "mps"
    old = os.umask(0o077)
    try:
        layout.prepare(root, UUID)
    finally:
        os.umask(old)
    for path in (root, root / UUID, layout.pipe_dir(root, UUID), layout.log_dir(root, UUID)):
        assert stat.S_IMODE(path.stat().st_mode) == 0o755, path
    layout.prepare(root, UUID)  # idempotent


def test_symlink_root_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(LayoutError, match="symlink"):
        layout.prepare(link, UUID)
    assert not (real / UUID).exists()


def test_world_writable_root_refused_but_parents_not_checked(short_tmp: Path) -> None:
    root = short_tmp / "mps"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(LayoutError, match="world-writable"):
        layout.prepare(root, UUID)
    # A world-writable parent (like /tmp) is fine: only the root itself is checked.
    parent = short_tmp / "open"
    parent.mkdir()
    parent.chmod(0o1777)
    layout.prepare(parent / "mps", UUID)
    assert layout.pipe_dir(parent / "mps", UUID).is_dir()


def test_socket_path_over_107_bytes_fails_clearly(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * (107 - len(str(tmp_path))))
    with pytest.raises(LayoutError, match="107-byte"):
        layout.prepare(deep, UUID)
    assert not deep.exists()


def test_socket_length_boundary(tmp_path: Path) -> None:
    suffix = len(f"/{UUID}/pipe/control_privileged")
    ok = Path("/" + "a" * (107 - suffix - 1))
    layout.check_socket_length(ok, UUID)  # exactly 107 bytes
    with pytest.raises(LayoutError):
        layout.check_socket_length(Path(str(ok) + "b"), UUID)


def test_marker_round_trip_and_garbage(short_tmp: Path) -> None:
    layout.prepare(short_tmp, UUID)
    assert layout.read_marker(short_tmp, UUID) is None
    marker = DaemonMarker(
        pid=4242,
        settings=MpsSettings(10240, 25, 2, multiuser=False),
        compute_mode_set=True,
        started_at=1.5,
    )
    layout.write_marker(short_tmp, UUID, marker)
    assert layout.read_marker(short_tmp, UUID) == marker
    layout.marker_path(short_tmp, UUID).write_text("{not json")
    assert layout.read_marker(short_tmp, UUID) is None
    layout.remove_marker(short_tmp, UUID)
    assert not layout.marker_path(short_tmp, UUID).exists()


def test_clean_pipe_dir_removes_only_daemon_files(short_tmp: Path) -> None:
    layout.prepare(short_tmp, UUID)
    pipe = layout.pipe_dir(short_tmp, UUID)
    for name in ("control", "control_privileged", "nvidia-cuda-mps-control.pid", "other"):
        (pipe / name).write_text("x")
    removed = layout.clean_pipe_dir(short_tmp, UUID)
    assert sorted(removed) == ["control", "control_privileged", "nvidia-cuda-mps-control.pid"]
    assert sorted(p.name for p in pipe.iterdir()) == ["other"]


def test_read_pid_and_known_gpus(short_tmp: Path) -> None:
    other = "GPU-99999999-2222-3333-4444-555555555555"
    layout.prepare(short_tmp, UUID)
    layout.prepare(short_tmp, other)
    (short_tmp / "not-a-gpu").mkdir()
    assert layout.known_gpus(short_tmp) == [UUID, other]
    assert layout.read_pid(short_tmp, UUID) is None
    layout.pid_file(short_tmp, UUID).write_text("123\n")
    assert layout.read_pid(short_tmp, UUID) == 123
    layout.pid_file(short_tmp, UUID).write_text("garbage")
    assert layout.read_pid(short_tmp, UUID) is None
