"""The real `gpu-fraction-plugin run --simulate` in a subprocess, with the kubelet simulator."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from deviceplugin.mps import layout
from deviceplugin.simulate.dra_kubelet import DraKubeletSimulator
from deviceplugin.simulate.kubelet import KubeletSimulator


class PluginProcess:
    def __init__(
        self,
        root: Path,
        preset: str = "h200x2",
        config: str | None = None,
        wrapper: Sequence[str] = (),
    ) -> None:
        self.root = root
        self.preset = preset
        # argv prefix for the plugin and its `mps stop` (e2e: nsenter into a mount namespace)
        self.wrapper = list(wrapper)
        self.kubelet_dir = root / "dp"
        self.state = root / "state"
        self.mps_root = root / "mps"
        self.cdi = root / "cdi"
        self.config = root / "config.yaml"
        self.log = root / "plugin.log"
        if config is not None:
            self.config.write_text(config)
        self.kubelet = KubeletSimulator(self.kubelet_dir)
        # DRA: the plugin's sockets; the DRA kubelet is started by tests that use it
        self.plugins_dir = root / "plugins"
        self.registry_dir = root / "registry"
        self.dra_kubelet = DraKubeletSimulator(self.registry_dir)
        self.proc: subprocess.Popen[bytes] | None = None

    def args(self) -> list[str]:
        args = [
            "--simulate", self.preset,
            "--kubelet-dir", str(self.kubelet_dir),
            "--state-dir", str(self.state),
            "--mps-root", str(self.mps_root),
            "--cdi-dir", str(self.cdi),
            "--pod-resources-socket", str(self.root / "pr.sock"),
            "--metrics-address", "127.0.0.1:0",
            "--kubelet-plugins-dir", str(self.plugins_dir),
            "--kubelet-registry-dir", str(self.registry_dir),
        ]  # fmt: skip
        if self.config.exists():
            args += ["--config", str(self.config)]
        return args

    def start(self, extra_env: dict[str, str] | None = None) -> None:
        if self.kubelet._server is None:
            self.kubelet.start()
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_FRACTION_")}
        env.pop("KUBECONFIG", None)
        env.update(extra_env or {})
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [*self.wrapper, sys.executable, "-m", "deviceplugin", "run", *self.args()],
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=True,  # its own process group, like a container
            )

    def wait_registered(self, count: int, timeout: float = 30.0) -> None:
        ok = self.kubelet.wait_for(lambda: len(self.kubelet.resources()) >= count, timeout)
        assert ok, self.log.read_text()[-3000:]

    def metrics_port(self, timeout: float = 10.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.findall(r"metrics serving.*?port=(\d+)", self.log.read_text())
            if found:
                return int(found[-1])
            time.sleep(0.05)
        raise AssertionError("metrics port not logged")

    def terminate(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        proc, self.proc = self.proc, None
        assert proc is not None
        proc.send_signal(sig)
        return proc.wait(timeout)

    def kill_group(self) -> None:
        proc, self.proc = self.proc, None
        assert proc is not None
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.kubelet.stop()
        self.dra_kubelet.stop()
        subprocess.run(
            [*self.wrapper, sys.executable, "-m", "deviceplugin", "mps", "stop", "--all", "--force",
             "--mps-root", str(self.mps_root), "--state-dir", str(self.state),
             "--simulate", self.preset],
            capture_output=True, check=False, timeout=60,
        )  # fmt: skip


def reboot(plugin: PluginProcess, gpus: Iterable[str]) -> None:
    """What a reboot leaves: no plugin, no MPS daemon, an empty CDI tmpfs and MPS root."""
    plugin.kill_group()
    for gpu in gpus:
        with contextlib.suppress(OSError, ValueError):
            pid = int(layout.pid_file(plugin.mps_root, gpu).read_text().split()[0])
            os.killpg(os.getpgid(pid), signal.SIGKILL)
    plugin.kubelet.stop()
    for directory in (plugin.cdi, plugin.mps_root):
        shutil.rmtree(directory)
        directory.mkdir()
    for entry in plugin.kubelet_dir.iterdir():  # the kubelet's start removes every socket
        if entry.is_socket():
            entry.unlink()
