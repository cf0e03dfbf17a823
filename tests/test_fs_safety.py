"""Filesystem and process safety: modes, unsafe roots, validated names, atomic files.

The source is checked for shell use; the real plugin is started over corrupt state files
and unsafe directories; the helpers every writer uses are exercised directly.
"""

from __future__ import annotations

import ast
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from deviceplugin.cdi import specs as cdi_specs
from deviceplugin.health import state as health_state
from deviceplugin.ledger.record import read_records
from deviceplugin.mps import layout
from deviceplugin.plumbing import fsutil
from deviceplugin.plumbing.fsutil import UnsafePathError
from deviceplugin.simulate.inject import InjectError, inject, inject_dir
from tests.conftest import MakePlugin
from tests.plugin_proc import PluginProcess

REPO = Path(__file__).resolve().parent.parent
SOURCES = sorted(
    [*REPO.joinpath("deviceplugin").rglob("*.py"), *REPO.joinpath("hack").rglob("*.py")]
)
SPLIT = """\
version: v1
gpus:
  - match: {index: 0}
    mode: sm-sharing
  - match: {index: 1}
    mode: time-slicing
"""
HOSTILE_UUIDS = ["", "..", "../x", "GPU-../../etc", "GPU-a/b", "GPU-a\n", "GPU-a b", "GPU-a;id",
                 "-GPU-a", "GPU-" + "a" * 200, "GPU-a\x00"]  # fmt: skip


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# ---------------------------------------------------------------------------------------------
# Processes


def _subprocess_calls(tree: ast.AST) -> Iterator[ast.Call]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            yield node


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_shell(path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path))
    for call in _subprocess_calls(tree):
        assert isinstance(call.func, ast.Attribute)
        name = call.func.attr
        owner = call.func.value.id if isinstance(call.func.value, ast.Name) else ""
        where = f"{path.name}:{call.lineno}"
        assert (owner, name) not in {("os", "system"), ("os", "popen")}, where
        assert name not in {"create_subprocess_shell", "getoutput", "getstatusoutput"}, where
        for kw in call.keywords:
            if kw.arg == "shell":
                assert isinstance(kw.value, ast.Constant) and kw.value.value is False, where
        if owner == "subprocess" and call.args:
            # An argument list, never one command string a shell or splitter would parse.
            assert not isinstance(call.args[0], ast.Constant | ast.JoinedStr | ast.BinOp), where


def test_the_shell_check_can_fail() -> None:
    bad = ast.parse("import subprocess\nsubprocess.run(f'ls {x}', shell=True)\n")
    (call,) = [c for c in _subprocess_calls(bad) if getattr(c.func, "attr", "") == "run"]
    assert call.keywords[0].arg == "shell" and isinstance(call.args[0], ast.JoinedStr)


# ---------------------------------------------------------------------------------------------
# Names that become paths or arguments


@pytest.mark.parametrize("uuid", HOSTILE_UUIDS)
def test_hostile_uuid_never_becomes_a_path(short_tmp: Path, uuid: str) -> None:
    with pytest.raises(layout.LayoutError):
        layout.prepare(short_tmp / "mps", uuid)
    with pytest.raises(layout.LayoutError):
        layout.pid_file(short_tmp / "mps", uuid)
    with pytest.raises(health_state.HealthStateError):
        health_state.request_clear(short_tmp / "state", uuid)
    assert not (short_tmp / "mps").exists() or list((short_tmp / "mps").iterdir()) == []
    assert not list(short_tmp.rglob("*etc*"))


@pytest.mark.parametrize(
    "key", [("../../etc/passwd::1",), ("GPU-a/b::1", "GPU-a/b::2"), ("😀::1",), ("-x",)]
)
def test_cdi_names_stay_in_their_dir(short_tmp: Path, key: tuple[str, ...]) -> None:
    name = cdi_specs.device_name(key)
    path = cdi_specs.spec_path(short_tmp, name)
    assert path.parent == short_tmp and "/" not in name and name[0].isalnum()


def test_inject_refuses_hostile_gpu(short_tmp: Path) -> None:
    fsutil.ensure_dir(inject_dir(short_tmp), 0o700)
    with pytest.raises(InjectError):
        inject(short_tmp, "GPU-x", "frobnicate")
    with pytest.raises(InjectError):  # nobody consumes it: refused, and the request removed
        inject(short_tmp, "../../x", "lost", timeout=0.2)
    assert list(inject_dir(short_tmp).iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Roots and modes


def test_root_symlink_refused_symlinked_parent_fine(short_tmp: Path) -> None:
    real = short_tmp / "real"
    real.mkdir()
    (short_tmp / "link").symlink_to(real)
    with pytest.raises(UnsafePathError, match="symlink"):
        fsutil.ensure_dir(short_tmp / "link")
    # /var/run -> /run style: the parent is a link, the root itself is a real directory
    assert fsutil.ensure_dir(short_tmp / "link" / "cdi", 0o755).is_dir()
    assert _mode(real / "cdi") == 0o755
    with pytest.raises(layout.LayoutError, match="symlink"):
        layout.prepare(short_tmp / "link", "GPU-a")


@pytest.mark.parametrize("mode", [0o777, 0o1777])
def test_world_writable_root_refused(short_tmp: Path, mode: int) -> None:
    root = short_tmp / "open"
    root.mkdir()
    root.chmod(mode)
    with pytest.raises(layout.LayoutError, match="world-writable"):
        layout.prepare(root, "GPU-a")
    if mode == 0o777:
        with pytest.raises(UnsafePathError, match="world-writable"):
            fsutil.ensure_dir(root)


def test_modes_explicit_despite_umask(short_tmp: Path) -> None:
    old = os.umask(0o077)
    try:
        fsutil.ensure_dir(short_tmp / "a" / "cdi", 0o755)
        layout.prepare(short_tmp / "mps", "GPU-abc")
        fsutil.atomic_write(short_tmp / "f.json", b"{}", 0o644)
    finally:
        os.umask(old)
    assert _mode(short_tmp / "a" / "cdi") == 0o755
    assert _mode(layout.pipe_dir(short_tmp / "mps", "GPU-abc")) == layout.DIR_MODE
    assert _mode(short_tmp / "f.json") == 0o644


# ---------------------------------------------------------------------------------------------
# Atomic files


def test_atomic_write_failure_keeps_old_file(short_tmp: Path) -> None:
    target = short_tmp / "allocations.json"
    fsutil.atomic_write(target, b'{"old": true}')
    with pytest.raises(TypeError):
        fsutil.atomic_write(target, "not bytes")  # type: ignore[arg-type]
    assert json.loads(target.read_text()) == {"old": True}
    assert [p.name for p in short_tmp.iterdir()] == ["allocations.json"]  # no temp left


def test_atomic_write_replaces_a_temp_file_a_dead_process_with_our_pid_left(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import itertools

    monkeypatch.setattr(fsutil, "_tmp_serial", itertools.count(7))
    stale = short_tmp / f".spec.json.{os.getpid()}.7.tmp"  # a crash mid-write, PID reused
    stale.write_bytes(b"half a spec")
    fsutil.atomic_write(short_tmp / "spec.json", b"{}", 0o644, durable=False)
    assert (short_tmp / "spec.json").read_bytes() == b"{}"
    assert [p.name for p in short_tmp.iterdir()] == ["spec.json"]


def test_writers_use_atomic_write() -> None:
    # Every state/CDI writer replaces its file by rename (fsutil.atomic_write or a temp file
    # and os.replace); none writes its target in place.
    for module in ("cdi/specs.py", "ledger/store.py", "health/state.py", "mps/layout.py"):
        text = (REPO / "deviceplugin" / module).read_text()
        assert "atomic_write(" in text or "os.replace(" in text, module
        assert ".write_text(" not in text and ".write_bytes(" not in text, module


# ---------------------------------------------------------------------------------------------
# The real plugin


@pytest.fixture
def plugin(make_plugin: MakePlugin) -> PluginProcess:
    return make_plugin(SPLIT)


def test_corrupt_state_files_reported_and_rebuilt(plugin: PluginProcess) -> None:
    plugin.state.mkdir(mode=0o700)
    (plugin.state / "allocations.json").write_text('{"version": 1, "allocations": [{"devi')
    (plugin.state / "health.json").write_bytes(b"\x00\xff not json")
    plugin.start()
    plugin.wait_registered(2)
    plugin.kubelet.allocate("nvidia.com/gpu-fraction", 2)
    assert plugin.kubelet.wait_for(
        lambda: "gpus" in json.loads((plugin.state / "health.json").read_text() or "{}"), 20
    )
    assert len(read_records(plugin.state)) == 1
    assert list(plugin.state.glob("allocations.json.corrupt-*"))  # kept for a human
    log = plugin.log.read_text()
    assert "ledger unreadable" in log and "Traceback" not in log
    assert plugin.terminate() == 0


def test_dirs_and_sockets_have_explicit_modes(plugin: PluginProcess) -> None:
    # As a hostPath DirectoryOrCreate leaves it, with files an older version wrote.
    plugin.state.mkdir(mode=0o755)
    plugin.state.chmod(0o755)
    (plugin.state / "health.json").write_text("{}")
    (plugin.state / "health.json").chmod(0o644)
    old = os.umask(0)  # the child inherits it: modes must not depend on it
    try:
        plugin.start()
    finally:
        os.umask(old)
    plugin.wait_registered(2)
    sm = (
        plugin.kubelet.allocate("nvidia.com/gpu-fraction.sm-sharing", 1)
        if plugin.kubelet.wait_for(
            lambda: len(plugin.kubelet.healthy("nvidia.com/gpu-fraction.sm-sharing")) > 0, 30
        )
        else None
    )
    assert sm is not None
    assert _mode(plugin.state) == 0o700
    assert _mode(plugin.cdi) == 0o755 and _mode(plugin.mps_root) == 0o755
    for sock in plugin.kubelet_dir.glob("gfp-*.sock"):
        assert _mode(sock) == 0o600, sock
    for spec in plugin.cdi.glob("gpu-fraction*.json"):
        assert not _mode(spec) & 0o022, spec  # nobody else may rewrite a CDI spec
    gpu = sm.annotations["gpu-fraction.dev/gpu"]
    assert _mode(layout.pipe_dir(plugin.mps_root, gpu)) == layout.DIR_MODE
    # State files only the agent reads (issue 33: 0755 with 0644 files in deployment).
    assert plugin.kubelet.wait_for(lambda: bool(list(plugin.state.glob("allocations*"))), 10)
    for path in plugin.state.rglob("*"):
        if path.is_relative_to(plugin.state / "simulate"):
            continue  # the simulated node's own (its fake binaries), not the agent's state
        if path.is_file() and not path.is_symlink():
            assert _mode(path) & 0o077 == 0, (path, oct(_mode(path)))
    # The agent's own umask: what the MPS daemon it started creates is not world-writable.
    created = [p for p in layout.gpu_dir(plugin.mps_root, gpu).rglob("*") if p.is_file()]
    assert created, "the daemon wrote nothing"
    for path in created:
        assert not _mode(path) & 0o022, (path, oct(_mode(path)))
    assert plugin.terminate() == 0


@pytest.mark.parametrize("which", ["state", "cdi", "mps"])
def test_plugin_refuses_unsafe_roots(short_tmp: Path, which: str) -> None:
    p = PluginProcess(short_tmp, config=SPLIT)
    real = short_tmp / "elsewhere"
    real.mkdir()
    target = {"state": p.state, "cdi": p.cdi, "mps": p.mps_root}[which]
    target.symlink_to(real)
    result = subprocess.run(
        [sys.executable, "-m", "deviceplugin", "run", *p.args()],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode in (1, 2), result.stderr[-2000:]
    assert "symlink" in result.stderr and "Traceback" not in result.stderr
    assert list(real.iterdir()) == []
