"""The real plugin process (`python -m deviceplugin run --simulate`) with the kubelet simulator.

Everything lives under one short temp root (unix socket paths must stay under 108 bytes).
The plugin gets its own session, like a container; `close()` stops it and any MPS daemons.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from deviceplugin.mps import layout
from deviceplugin.simulate.kubelet import KubeletSimulator


class PluginError(Exception):
    """The plugin did not come up as expected; the message carries its log's tail."""


def fs_type(path: Path) -> str:
    """The filesystem type /proc/mounts gives for the mount holding `path`."""
    best, kind = "", "unknown"
    target = str(path.resolve())
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1]
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, fields[2]
    return kind


class Plugin:
    """`root` holds the state (on disk, as /var/lib is on a node); `cdi_dir` defaults to one
    under it, and the bench passes one on a tmpfs, as /var/run/cdi is on a node."""

    def __init__(
        self, root: Path, preset: str, config: str | None, cdi_dir: Path | None = None
    ) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.preset = preset
        self.state = root / "state"
        self.mps_root = root / "mps"
        self.cdi_dir = cdi_dir if cdi_dir is not None else root / "cdi"
        self.log = root / "plugin.log"
        self.config: Path | None = None
        if config is not None:
            # its own directory, as a ConfigMap mount is: nothing else is written beside it
            self.config = root / "etc" / "config.yaml"
            self.config.parent.mkdir(exist_ok=True)
            self.config.write_text(config)
        self.kubelet = KubeletSimulator(root / "dp")
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0  # time.monotonic() just before the process was spawned
        self.extra_args: list[str] = []  # e.g. the DRA socket directories
        self.extra_env: dict[str, str] = {}  # e.g. KUBECONFIG and NODE_NAME for DRA

    def args(self) -> list[str]:
        args = [
            "--simulate", self.preset,
            "--kubelet-dir", str(self.kubelet.dir),
            "--state-dir", str(self.state),
            "--mps-root", str(self.mps_root),
            "--cdi-dir", str(self.cdi_dir),
            "--pod-resources-socket", str(self.root / "pr.sock"),
            "--metrics-address", "127.0.0.1:0",
        ]  # fmt: skip
        if self.config is not None:
            args += ["--config", str(self.config)]
        return args + self.extra_args

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise PluginError("plugin not started")
        return self.proc.pid

    def start(self) -> None:
        self.kubelet.start()
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_FRACTION_")}
        env.pop("KUBECONFIG", None)  # no API server unless given: the integration stays off
        env.update(self.extra_env)
        with self.log.open("ab") as log:
            self.started_at = time.monotonic()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "deviceplugin", "run", *self.args()],
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=True,
            )

    def wait_listed(self, resources: int, timeout: float = 120.0) -> None:
        """Until `resources` resources are registered and each got its first full list."""
        if not self.kubelet.wait_for(lambda: len(self.kubelet.resources()) >= resources, timeout):
            raise PluginError(f"no {resources} resources listed in {timeout}s:\n{self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text()[-chars:] if self.log.exists() else ""

    def mps_pids(self) -> list[int]:
        """PIDs of MPS control daemons the plugin started (own session, so not children)."""
        pids = []
        if self.mps_root.is_dir():
            for gpu in self.mps_root.iterdir():
                pid = layout.read_pid(self.mps_root, gpu.name)
                if pid is not None:
                    pids.append(pid)
        return pids

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self.kubelet.stop()
        subprocess.run(
            [sys.executable, "-m", "deviceplugin", "mps", "stop", "--all", "--force",
             "--mps-root", str(self.mps_root), "--state-dir", str(self.state),
             "--simulate", self.preset],
            capture_output=True, check=False, timeout=60,
        )  # fmt: skip
