"""A simulated node for `run --simulate`: fake NVML, its sysfs and driver CDI spec (the
GPU Operator layout: the management spec only), fake MPS binary and `nvidia-ctk`.

Everything the daemon would find on a real GPU node, built from the spec alone (never from
the host running the simulation), plus the listener that relays injected faults. The
node's CDI spec directory is `--cdi-dir` unless the config names `cdi.specDirs`; the
driver's spec goes into the first of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

from deviceplugin.config.settings import Config
from deviceplugin.daemon.startup import Platform
from deviceplugin.inventory.gpus import NodeFacts, probe_memory_limits_hook
from deviceplugin.model import GpuUuid
from deviceplugin.mps import layout
from deviceplugin.plumbing import fsutil
from deviceplugin.simulate import mps_control
from deviceplugin.simulate.cdi import write_driver_cdi_spec
from deviceplugin.simulate.ctk import write_nvidia_ctk
from deviceplugin.simulate.inject import InjectionListener
from deviceplugin.simulate.nvml import FakeNvml
from deviceplugin.simulate.specs import SimSpec


def simulated_node_facts(spec: SimSpec, scratch: Path) -> NodeFacts:
    """The spec's node facts, the memory-limit hook probed as on a node: by running the
    simulated `nvidia-ctk` (written into `scratch`)."""
    facts = spec.node_facts()
    if not spec.nvidia_ctk:
        return dataclasses.replace(facts, memory_limits_hook=False)
    ctk = write_nvidia_ctk(spec, scratch / "nvidia-ctk")
    return dataclasses.replace(facts, memory_limits_hook=probe_memory_limits_hook(str(ctk)))


def simulated_platform(spec: SimSpec, state_dir: Path, cdi_dir: Path, mps_root: Path) -> Platform:
    sim_dir = state_dir / "simulate"
    fsutil.ensure_dir(state_dir, 0o700)  # refuse an unsafe state root before writing under it
    fsutil.ensure_dir(sim_dir, 0o700)
    fake = FakeNvml(spec, state_dir)
    launcher = mps_control.write_launcher(sim_dir / "nvidia-cuda-mps-control")

    def set_up(config: Config) -> None:
        fake.install()
        spec_dir = Path(config.cdi.spec_dirs[0])
        write_driver_cdi_spec(spec, spec_dir, config.cdi.driver_kind, config.cdi.nvidia_ctk_path)

    def daemon_pipe(gpu: GpuUuid) -> Path | None:
        pipe = layout.pipe_dir(mps_root, gpu)
        return pipe if layout.pid_file(mps_root, gpu).exists() else None

    def on_mps_fault(gpu: GpuUuid) -> None:
        pipe = daemon_pipe(gpu)
        if pipe is not None:  # only a GPU that runs an MPS daemon has a server to fault
            with contextlib.suppress(OSError):
                mps_control.inject_fault(pipe)

    def on_recover(gpu: GpuUuid) -> None:
        pipe = daemon_pipe(gpu)
        if pipe is not None:
            with contextlib.suppress(OSError):
                mps_control.recover(pipe)

    listener = InjectionListener(state_dir, fake, on_mps_fault=on_mps_fault, on_recover=on_recover)
    # `cdi generate` runs the simulated node's nvidia-ctk (written by simulated_node_facts);
    # a node without one has none to run.
    ctk = sim_dir / "nvidia-ctk" if spec.nvidia_ctk else sim_dir / "absent" / "nvidia-ctk"
    return Platform(
        sysfs_root=spec.write_sysfs(sim_dir / "sysfs"),
        node_facts=simulated_node_facts(spec, sim_dir),
        control_binary=str(launcher),
        set_up=set_up,
        extras=(listener,),
        spec_dirs=(str(cdi_dir),),
        nvidia_ctk=str(ctk),
    )
