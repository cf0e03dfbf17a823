"""Nothing a container can write is trusted: files planted in an MPS pipe dir.

The pipe dir is the one directory under the MPS root that containers reach (their
CUDA_MPS_PIPE_DIRECTORY). A root container, or anything that wrote there before the mount
became read-only, can leave a symlink to /dev/zero, a FIFO or a huge file at the daemon's
pid file name. The real plugin process must start, serve and stop over each (issue 33).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from deviceplugin.mps import layout
from deviceplugin.plumbing import fsutil
from deviceplugin.simulate.specs import load_spec
from tests.conftest import MakePlugin

SM = "nvidia.com/gpu-fraction.sm-sharing"
SM_ONLY = """\
version: v1
gpus:
  - match: {index: 0}
    mode: sm-sharing
"""
HUGE = 64 * 2**20  # sparse: costs no disk, but a plain read() would take it all


def _plant(path: Path, kind: str) -> None:
    if kind == "symlink":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "huge":
        with path.open("wb") as f:
            f.truncate(HUGE)
    elif kind == "directory":
        path.mkdir()
        (path / "inside").write_text("x")
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "huge", "directory"])
def test_planted_pid_file_neither_stalls_nor_kills_the_agent(
    make_plugin: MakePlugin, kind: str
) -> None:
    plugin = make_plugin(SM_ONLY)
    gpu = load_spec("h200x2").gpus[0].uuid
    layout.prepare(plugin.mps_root, gpu)
    pipe = layout.pipe_dir(plugin.mps_root, gpu)
    _plant(layout.pid_file(plugin.mps_root, gpu), kind)
    # Other names the daemon uses, and one it does not: never read, never followed.
    os.mkfifo(pipe / "control_lock")
    (pipe / "planted").symlink_to("/dev/zero")
    began = time.monotonic()
    plugin.start()
    plugin.wait_registered(1)
    assert plugin.kubelet.wait_for(lambda: len(plugin.kubelet.healthy(SM)) > 0, 30), (
        plugin.log.read_text()[-3000:]
    )
    answer = plugin.kubelet.allocate(SM, 1)
    assert answer.annotations["gpu-fraction.dev/gpu"] == gpu
    assert time.monotonic() - began < 20  # a FIFO read would hold the start for the timeout
    # The fresh daemon's own pid file replaced what was planted.
    assert layout.read_pid(plugin.mps_root, gpu) is not None
    assert (pipe / "planted").is_symlink()  # not ours: left alone, never opened
    assert plugin.terminate(signal.SIGTERM, timeout=15) == 0
    assert "Traceback" not in plugin.log.read_text()


def test_read_pid_refuses_what_a_container_could_plant(short_tmp: Path) -> None:
    root, gpu = short_tmp / "mps", "GPU-a"
    layout.prepare(root, gpu)
    pid = layout.pid_file(root, gpu)
    pid.write_text(f"{os.getpid()}\n")
    assert layout.read_pid(root, gpu) == os.getpid()  # the daemon's own file reads
    pid.unlink()
    for kind in ("symlink", "fifo", "huge", "directory"):
        _plant(pid, kind)
        assert layout.read_pid(root, gpu) is None, kind
        assert layout.clean_pipe_dir(root, gpu) == [layout.PID_FILE]
        assert not os.path.lexists(pid)
    # A symlink to a real pid file is not followed either.
    real = short_tmp / "elsewhere"
    real.write_text(f"{os.getpid()}\n")
    pid.symlink_to(real)
    assert layout.read_pid(root, gpu) is None


def test_read_bounded_limits(short_tmp: Path) -> None:
    small = short_tmp / "small"
    small.write_bytes(b"12345")
    assert fsutil.read_bounded(small, 5) == b"12345"
    with pytest.raises(fsutil.UntrustedFileError, match="over 4"):
        fsutil.read_bounded(small, 4)
    with pytest.raises(fsutil.UntrustedFileError, match="belongs to uid"):
        fsutil.read_bounded(small, 5, owner=os.geteuid() + 1)
