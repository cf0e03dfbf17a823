"""The runtime end-to-end suite's session: one private mount namespace, podman with runc in
it, the busybox image, the stand-in `nvidia-ctk`, and at the end proof that nothing is left
(containers, images, processes, mounts, cgroups, files on the host).

Skipped, with the reason, where `tests.e2e.requirements` says the host cannot run it. Prints
`e2e suite: N passed, F failed, S skipped` in the summary (`.ci/run` checks it under CI).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.simulate.cdi import binary_paths, library_paths
from deviceplugin.simulate.specs import OPERATOR_DRIVER_ROOT, SimSpec, load_spec
from tests.e2e.requirements import missing
from tests.e2e.runtime import Namespace, Podman, write_stub_ctk
from tests.plugin_proc import PluginProcess

PRESET = "mixed"
# Host paths the suite must not create (podman's defaults when it is not told otherwise).
WATCHED = (
    "/var/lib/containers",
    "/run/containers",
    "/run/libpod",
    "/run/runc",
    "/etc/cdi",
    "/run/cdi",
    "/etc/cni/net.d/cni.lock",
    "/usr/bin/nvidia-smi",  # the stand-in lives only in the namespace's overlay
)


@dataclass
class E2E:
    """What every e2e test uses: the namespace, podman, the stand-in toolkit, scratch."""

    ns: Namespace
    podman: Podman
    spec: SimSpec
    ctk: Path
    hook_records: Path
    scratch: Path
    host_before: dict[str, Any]  # host_state() at the session's start

    def plugin(self, name: str, config: str, preset: str = PRESET) -> PluginProcess:
        """The real plugin process for `name`, to be started inside the namespace; its CDI
        directory is what podman reads."""
        root = self.scratch / name
        root.mkdir()
        plugin = PluginProcess(root, preset=preset, config=config, wrapper=self.ns.argv())
        plugin.cdi.mkdir()
        self.ns.bind_cdi(plugin.cdi)
        return plugin


def host_state() -> dict[str, Any]:
    return {
        "mounts": Path("/proc/self/mountinfo").read_text(),
        "paths": {p: Path(p).exists() for p in WATCHED},
        "nvidia": sorted(str(p) for p in Path("/dev").glob("nvidia*")),
    }


@pytest.fixture(scope="session")
def e2e() -> Iterator[E2E]:
    why = missing()
    if why is not None:
        pytest.skip(f"e2e suite: {why}")
    before = host_state()
    scratch = Path(tempfile.mkdtemp(prefix="gf-e2e-", dir="/tmp"))
    spec = load_spec(PRESET)
    # The driver's libraries and binaries on the host layout and under the GPU Operator's
    # driver root.
    libraries = library_paths(spec) + library_paths(spec, OPERATOR_DRIVER_ROOT)
    binaries = binary_paths(spec) + binary_paths(spec, OPERATOR_DRIVER_ROOT)
    ns = Namespace(scratch / "ns", [g.minor for g in spec.gpus], libraries, binaries)
    podman = Podman(ns, scratch / "podman")
    try:
        podman.build_image()
        records = scratch / "hooks.jsonl"
        ctk = write_stub_ctk(scratch / "toolkit" / "nvidia-ctk", records)
        yield E2E(ns, podman, spec, ctk, records, scratch, before)
    finally:
        problems = teardown(ns, podman, scratch, before)
    assert not problems, "e2e left things behind:\n" + "\n".join(problems)


def teardown(ns: Namespace, podman: Podman, scratch: Path, before: dict[str, Any]) -> list[str]:
    podman.remove_all()
    problems = podman.leftovers()
    for pid in ns.members():  # reported, then ended: none may outlive the suite
        problems.append(f"process {pid} still in the namespace")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    ns.close()
    problems += podman.remove_cgroups()
    shutil.rmtree(scratch, ignore_errors=True)
    after = host_state()
    if after["mounts"] != before["mounts"]:
        problems.append("the host's mount table changed")
    problems += [f"{p} created on the host" for p, was in before["paths"].items()
                 if after["paths"][p] and not was]  # fmt: skip
    if after["nvidia"] != before["nvidia"]:
        problems.append(f"host /dev/nvidia* changed: {after['nvidia']}")
    if scratch.exists():
        problems.append(f"{scratch} not removed")
    return problems


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line for the e2e tests of this run (`.ci/run` requires it, with nothing skipped)."""
    counts = {}
    for outcome in ("passed", "failed", "skipped", "error"):
        reports = terminalreporter.stats.get(outcome, [])
        counts[outcome] = sum(1 for r in reports if "e2e" in getattr(r, "keywords", {}))
    if any(counts.values()):
        line = ", ".join(f"{n} {k}" for k, n in counts.items())
        terminalreporter.write_line(f"e2e suite: {line}")
