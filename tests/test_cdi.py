"""CDI spec writer: names, versions, atomic files, and the field-rule validator."""

from __future__ import annotations

import hashlib
import json
import re
import stat
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.cdi import specs as cdi_specs
from deviceplugin.plumbing.fsutil import UnsafePathError

KEY = ("GPU-aaaa-1111::3", "GPU-aaaa-1111::4")


@pytest.mark.parametrize(
    "key",
    [
        ("GPU-aaaa-1111::3", "GPU-aaaa-1111::5"),
        ("GPU-aaaa-1111",),
        ("MIG-9f1e/1/0::0",),
        ("-odd id::1",),
        ("GPU-\u00e9t\u00e9::2", "GPU-\u00e9t\u00e9::10"),
    ],
)
def test_device_names_are_those_earlier_releases_wrote(key: tuple[str, ...]) -> None:
    """Names are recorded in the ledger and in spec file names: a new release must name the
    same devices the same way (this is the formula of the releases before it)."""
    first = key[0].split("::", 1)[0]
    digest = hashlib.sha256("\n".join(key).encode()).hexdigest()[:16]
    old = re.sub(r"[^A-Za-z0-9_.:-]", "-", f"{first}-{digest}")
    old = old if old[0].isalnum() else f"a{old}"
    assert cdi_specs.device_name(key) == old


def test_device_name_is_valid_stable_and_unique() -> None:
    name = cdi_specs.device_name(KEY)
    assert name == cdi_specs.device_name(KEY)
    assert name.startswith("GPU-aaaa-1111-")
    assert name != cdi_specs.device_name(("GPU-aaaa-1111::3",))
    assert name != cdi_specs.device_name(("GPU-aaaa-1111::3", "GPU-aaaa-1111::5"))
    spec = cdi_specs.build_spec(name, {"A": "1"})
    assert cdi_specs.validate_spec(spec) == []


def test_spec_contents(tmp_path: Path) -> None:
    hook = cdi_specs.memory_limit_hook("/usr/bin/nvidia-ctk", "/", "GPU-aaaa-1111")
    spec = cdi_specs.build_spec(
        "dev1",
        {"NVIDIA_VISIBLE_DEVICES": "GPU-aaaa-1111", "NVIDIA_GPU_MEMORY_LIMIT": "2048"},
        [cdi_specs.CdiMount("/run/mps/GPU-aaaa-1111/pipe", "/run/gpu-fraction/mps-pipe")],
        [hook],
    )
    path = cdi_specs.write_spec(tmp_path / "cdi", spec)
    assert path == tmp_path / "cdi" / "gpu-fraction.dev-gpu_dev1.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    loaded = json.loads(path.read_text())
    assert loaded["kind"] == "gpu-fraction.dev/gpu"
    assert loaded["cdiVersion"] == "0.3.0"
    (device,) = loaded["devices"]
    edits = device["containerEdits"]
    # never NVIDIA_VISIBLE_DEVICES: the driver's spec keeps it `void` (DESIGN 3b)
    assert edits["env"] == ["NVIDIA_GPU_MEMORY_LIMIT=2048"]
    assert edits["mounts"] == [
        {
            "hostPath": "/run/mps/GPU-aaaa-1111/pipe",
            "containerPath": "/run/gpu-fraction/mps-pipe",
            "options": ["rbind", "rw"],
        }
    ]
    assert edits["hooks"] == [
        {
            "hookName": "createRuntime",
            "path": "/usr/bin/nvidia-ctk",
            "args": [
                "nvidia-ctk",
                "hook",
                "apply-cuda-memory-limits",
                "--driver-root",
                "/",
                "--gpu-id",
                "GPU-aaaa-1111",
            ],
        }
    ]
    assert cdi_specs.validate_spec(loaded) == []
    assert not list((tmp_path / "cdi").glob(".*tmp"))  # no temp file left behind
    assert cdi_specs.remove_spec(path) and not path.exists()
    assert not cdi_specs.remove_spec(path)


def _valid() -> dict[str, Any]:
    return cdi_specs.build_spec("d", {"A": "1"}, [cdi_specs.CdiMount("/h", "/c", read_only=True)])


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda s: s.update(cdiVersion="1"), "cdiVersion: must be a version"),
        (lambda s: s.update(kind="gpu"), "kind: must be vendor.com/class"),
        (lambda s: s.update(devices=[]), "devices: required"),
        (lambda s: s["devices"][0].update(name="bad name"), "devices[0].name"),
        (lambda s: s["devices"].append(dict(s["devices"][0])), "devices[1].name: duplicate"),
        (lambda s: s["devices"][0].pop("containerEdits"), "devices[0].containerEdits: required"),
        (
            lambda s: s["devices"][0]["containerEdits"].update(env=["1A=x"]),
            "env[0]: must be NAME=value",
        ),
        (
            lambda s: s["devices"][0]["containerEdits"]["mounts"][0].update(options=[]),
            "options: a bind mount",
        ),
        (
            lambda s: s["devices"][0]["containerEdits"]["mounts"][0].update(options=["rbind"]),
            "say rw or ro",
        ),
        (
            lambda s: s["devices"][0]["containerEdits"]["mounts"][0].pop("hostPath"),
            "hostPath: required",
        ),
        (
            lambda s: s["devices"][0]["containerEdits"].update(
                hooks=[{"hookName": "preStart", "path": "/x"}]
            ),
            "hookName",
        ),
        (
            lambda s: s["devices"][0]["containerEdits"].update(
                hooks=[{"hookName": "createRuntime"}]
            ),
            "path: required",
        ),
        (
            lambda s: s["devices"][0]["containerEdits"].update(
                deviceNodes=[{"hostPath": "/dev/x"}]
            ),
            "deviceNodes[0].path",
        ),
        (lambda s: s["devices"][0]["containerEdits"].update(volumes=[]), "volumes: unknown field"),
        (
            lambda s: s["devices"][0].update(annotations={"a": "b"}),
            "lacks fields used (needs 0.6.0)",
        ),
        (
            lambda s: s["devices"][0]["containerEdits"]["mounts"][0].update(type="bind"),
            "needs 0.4.0",
        ),
    ],
)
def test_validator_catches_each_rule(mutate: Any, fragment: str) -> None:
    spec = _valid()
    assert cdi_specs.validate_spec(spec) == []
    mutate(spec)
    problems = cdi_specs.validate_spec(spec)
    assert any(fragment in p for p in problems), problems


def test_writer_refuses_invalid_spec(tmp_path: Path) -> None:
    spec = _valid()
    spec["devices"][0]["name"] = "-x"
    with pytest.raises(cdi_specs.CdiError, match="name"):
        cdi_specs.write_spec(tmp_path, spec)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("extra", "version"),
    [
        ({}, "0.3.0"),
        ({"annotations": {"a": "b"}}, "0.6.0"),
    ],
)
def test_required_version(extra: dict[str, Any], version: str) -> None:
    spec = {**_valid(), **extra}
    assert cdi_specs.required_version(spec) == version


def test_writer_refuses_symlinked_or_world_writable_dir(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(UnsafePathError, match="symlink"):
        cdi_specs.write_spec(link, _valid())
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(UnsafePathError, match="world-writable"):
        cdi_specs.write_spec(open_dir, _valid())
