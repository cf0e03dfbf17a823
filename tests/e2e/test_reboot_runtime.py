"""A reboot through the runtime: answers taken in every mode, then the plugin's process
group and MPS daemons killed and the CDI directory and MPS root emptied (what a reboot leaves:
`/var/run/cdi` is a tmpfs); the kubelet replays its checkpointed answers without calling
Allocate, so the same `podman run` commands must start again once the plugin is back. Before
it is back they fail as they did on the first real run (`unresolvable CDI devices`)."""

from __future__ import annotations

import pytest

from deviceplugin.simulate.kubelet import KubeletSimulator
from tests.e2e.conftest import E2E
from tests.e2e.nodes import MODES, DpNode, assert_container, config, expected_caps
from tests.e2e.runtime import run_args
from tests.plugin_proc import reboot

pytestmark = pytest.mark.e2e


def test_old_answers_start_again_after_a_reboot(e2e: E2E) -> None:
    plugin = e2e.plugin("reboot", config("cdi", str(e2e.ctk)))
    node = DpNode(e2e, "cdi", plugin)
    try:
        node.start()
        answers = {mode: node.answer(mode) for mode in MODES}
        args = {mode: run_args(answer) for mode, answer in answers.items()}
        before = {}
        for mode, argv in args.items():
            ran = e2e.podman.run(argv)
            assert ran.rc == 0, ran.stderr
            before[mode] = ran.stable_env()

        reboot(plugin, sorted({node.gpu(a).uuid for a in answers.values()}))
        e2e.ns.bind_cdi(plugin.cdi)  # the fresh, empty tmpfs
        for argv in args.values():
            failed = e2e.podman.run(argv, ["true"])
            assert failed.rc != 0 and "unresolvable CDI devices" in failed.stderr, failed

        plugin.kubelet = KubeletSimulator(plugin.kubelet_dir)
        node.start()
        for mode, argv in args.items():
            ran = e2e.podman.run(argv)
            assert_container(
                e2e,
                ran,
                strategy="cdi",
                mode=mode,
                gpu=node.gpu(answers[mode]),
                mps_root=plugin.mps_root,
                caps=expected_caps(mode),
            )
            assert ran.stable_env() == before[mode]
    finally:
        plugin.cleanup()
