"""What a container gets from an answer's CDI devices, merged the way a runtime merges them.

The driver's spec (simulated as `nvidia-ctk cdi generate` writes it) sets
`NVIDIA_VISIBLE_DEVICES=void` to keep the legacy runtime hook out; our own device must not
override it, in whichever order the runtime applies the two devices.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.cdi import specs as cdi_specs
from deviceplugin.cdi.registry import UnresolvableDevice, known_devices, resolve
from deviceplugin.config.settings import parse
from deviceplugin.dpapi.allocator import Allocator
from deviceplugin.health.board import HealthBoard
from deviceplugin.ledger.store import Ledger
from deviceplugin.model import Mode
from deviceplugin.plan import build_plan
from deviceplugin.simulate.cdi import DRIVER_KIND, write_driver_cdi_spec
from deviceplugin.simulate.specs import load_spec
from tests.test_allocator import MIXED, FakeMps

TS = "nvidia.com/gpu-fraction"
SM = "nvidia.com/gpu-fraction.sm-sharing"
EX = "nvidia.com/gpu"


class Node:
    """A simulated node's CDI world: the driver's spec in /etc/cdi, ours in /var/run/cdi."""

    def __init__(self, tmp: Path, cfg: dict[str, Any] | None = None) -> None:
        self.spec = load_spec("mixed")
        self.etc_cdi = tmp / "etc-cdi"
        self.run_cdi = tmp / "run-cdi"
        self.dirs = [self.etc_cdi, self.run_cdi]
        write_driver_cdi_spec(self.spec, self.etc_cdi)
        config = parse({"version": "v1", **MIXED, **(cfg or {})})
        plan = build_plan(self.spec.inventory(), config)
        self.allocator = Allocator(
            lambda: plan,
            lambda: config,
            self.run_cdi,
            tmp / "mps",
            Ledger(tmp / "state"),
            HealthBoard(),
            FakeMps(),
        )

    def ids(self, index: int, *slices: int) -> list[str]:
        uuid = self.spec.gpus[index].uuid
        return [f"{uuid}::{n}" for n in slices] if slices else [uuid]


def test_simulated_driver_spec_has_the_toolkits_shape(tmp_path: Path) -> None:
    spec = load_spec("mixed")
    path = write_driver_cdi_spec(spec, tmp_path)
    names = known_devices([tmp_path])
    for g in spec.gpus:
        assert f"{DRIVER_KIND}={g.index}" in names
        assert f"{DRIVER_KIND}={g.uuid}" in names
    assert f"{DRIVER_KIND}=all" in names
    got = resolve([tmp_path], [f"{DRIVER_KIND}={spec.gpus[1].uuid}"])
    assert got.env == {"NVIDIA_VISIBLE_DEVICES": "void"}
    paths = [n["path"] for n in got.device_nodes]
    assert paths[-1] == f"/dev/nvidia{spec.gpus[1].minor}"
    assert {"/dev/nvidiactl", "/dev/nvidia-uvm"} <= set(paths)
    assert [h["args"][2] for h in got.hooks] == ["update-ldcache"]
    assert path.suffix == ".yaml"


@pytest.mark.parametrize(
    ("resource", "gpu", "slices"), [(TS, 0, (0, 1)), (SM, 1, (2,)), (EX, 2, ())]
)
@pytest.mark.parametrize("reverse", [False, True], ids=["driver-first", "ours-first"])
def test_our_cdi_device_never_overrides_the_drivers_void(
    tmp_path: Path, resource: str, gpu: int, slices: tuple[int, ...], reverse: bool
) -> None:
    node = Node(tmp_path, {"mps": {"protocolVersion": 3}})
    grant = node.allocator.allocate(resource, node.ids(gpu, *slices))
    names = list(reversed(grant.cdi_devices)) if reverse else grant.cdi_devices
    got = resolve(node.dirs, names)
    # The legacy hook stays out only while the driver's `void` survives the merge.
    assert got.env["NVIDIA_VISIBLE_DEVICES"] == "void"
    uuid = node.spec.gpus[gpu].uuid
    assert f"/dev/nvidia{node.spec.gpus[gpu].minor}" in [n["path"] for n in got.device_nodes]
    if resource != EX:
        assert got.env["NVIDIA_GPU_MEMORY_LIMIT"] == str(len(slices) * 1024)
        hook_gpus = [h["args"][-1] for h in got.hooks if "apply-cuda-memory-limits" in h["args"]]
        assert hook_gpus == [uuid]


def test_envvar_delivery_still_names_the_gpu(tmp_path: Path) -> None:
    node = Node(tmp_path, {"deviceListStrategy": ["envvar"], "enforcement": "best-effort"})
    grant = node.allocator.allocate(TS, node.ids(0, 0))
    assert grant.cdi_devices == []
    assert grant.envs["NVIDIA_VISIBLE_DEVICES"] == node.spec.gpus[0].uuid


def test_cdi_and_envvar_together_keep_the_variable_in_plain_env_only(tmp_path: Path) -> None:
    node = Node(tmp_path, {"deviceListStrategy": ["cdi", "envvar"]})
    grant = node.allocator.allocate(TS, node.ids(0, 0))
    assert grant.envs["NVIDIA_VISIBLE_DEVICES"] == node.spec.gpus[0].uuid
    assert "NVIDIA_VISIBLE_DEVICES" not in resolve([node.run_cdi], grant.cdi_devices[1:]).env


def test_exclusive_answer_names_only_the_drivers_devices(tmp_path: Path) -> None:
    node = Node(tmp_path)
    grant = node.allocator.allocate(EX, node.ids(2) + node.ids(3))
    uuids = {node.spec.gpus[2].uuid, node.spec.gpus[3].uuid}
    assert set(grant.cdi_devices) == {f"{DRIVER_KIND}={u}" for u in uuids}
    assert grant.record.cdi_spec is None and grant.record.mode is Mode.EXCLUSIVE
    assert not list(node.run_cdi.glob("*.json"))


def test_unknown_device_is_unresolvable_like_a_runtime_says(tmp_path: Path) -> None:
    write_driver_cdi_spec(load_spec("mixed"), tmp_path)
    with pytest.raises(UnresolvableDevice, match=r"nvidia\.com/gpu=GPU-nope"):
        resolve([tmp_path], ["nvidia.com/gpu=GPU-nope"])


def test_a_device_with_empty_edits_is_refused_like_the_cdi_library_does(tmp_path: Path) -> None:
    spec = cdi_specs.build_spec("d", {"A": "1"})
    spec["devices"][0]["containerEdits"] = {}
    assert any("empty device edits" in p for p in cdi_specs.validate_spec(spec))
    (tmp_path / "x.json").write_text(json.dumps(spec))
    assert known_devices([tmp_path]) == frozenset()


def test_later_directory_wins_a_name_clash(tmp_path: Path) -> None:
    for n, directory in enumerate(("a", "b")):
        spec = cdi_specs.build_spec("d", {"FROM": directory})
        (tmp_path / directory).mkdir()
        (tmp_path / directory / f"s{n}.json").write_text(json.dumps(spec))
    got = resolve([tmp_path / "a", tmp_path / "b"], [f"{cdi_specs.KIND}=d"])
    assert got.env == {"FROM": "b"}


class RuntimeCacheWatch:
    """The spec-directory watch of a runtime's CDI cache (container-device-interface, as
    containerd and CRI-O ship it on Linux): it refreshes on Rename, Remove, and Write of a
    .json/.yaml file, and ignores Create. A spec that only appears by a Create (renamed in
    from another directory) stays unseen until something else changes."""

    def __init__(self, directory: Path) -> None:
        import threading

        from watchdog.events import FileSystemEvent, FileSystemEventHandler
        from watchdog.observers import Observer

        self.refreshes = 0
        self._seen = threading.Condition()
        watch = self

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                # watchdog folds IN_MOVED_FROM+IN_MOVED_TO into "moved": fsnotify's Rename
                # (of the source name) then Create; a lone IN_MOVED_TO is "created".
                spec_file = Path(str(event.src_path)).suffix in (".json", ".yaml")
                write = event.event_type == "modified" and spec_file and not event.is_directory
                if event.event_type in ("moved", "deleted") or write:
                    with watch._seen:
                        watch.refreshes += 1
                        watch._seen.notify_all()

        self._observer = Observer()
        self._observer.schedule(Handler(), str(directory))
        self._observer.start()

    def wait_refreshes(self, n: int, timeout: float = 5.0) -> bool:
        with self._seen:
            return self._seen.wait_for(lambda: self.refreshes >= n, timeout)

    def stop(self) -> None:
        self._observer.stop()
        self._observer.join(5)


def test_a_runtime_cdi_cache_sees_every_spec_we_write(tmp_path: Path) -> None:
    run_cdi = tmp_path / "run-cdi"
    run_cdi.mkdir()
    runtime = RuntimeCacheWatch(run_cdi)
    try:
        expected = 0
        for n in range(3):  # new allocation specs, and one rewritten with other edits
            cdi_specs.write_spec(run_cdi, cdi_specs.build_spec(f"x{n}", {"A": "1"}))
            expected += 1
            assert runtime.wait_refreshes(expected), f"spec x{n} raised no refresh"
        cdi_specs.write_spec(run_cdi, cdi_specs.build_spec("x0", {"A": "2"}))
        assert runtime.wait_refreshes(expected + 1), "a rewritten spec raised no refresh"
        claim = cdi_specs.build_spec("u1-gpu-0-0", {"A": "1"}, kind=cdi_specs.CLAIM_KIND)
        cdi_specs.write_spec(run_cdi, claim, cdi_specs.claim_spec_path(run_cdi, "u1"))
        assert runtime.wait_refreshes(expected + 2), "a claim spec raised no refresh"
    finally:
        runtime.stop()
