"""Fuzzing the files and annotations the plugin reads: config, simulate specs, ceilings.

Random YAML structures (shaped by the real keys so they reach deep validation) and raw bytes
must load as a Config/SimSpec or raise ConfigError/SpecError, never anything else. A pod's
ceiling annotation is a quantity or nothing: hostile values can never reach an env variable,
a mount or a path in an Allocate answer or its CDI spec.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deviceplugin.cdi import specs as cdi_specs
from deviceplugin.config.settings import SCHEMA, Config, ConfigError, Key, load, parse
from deviceplugin.dpapi.allocator import Allocator, CeilingDecision
from deviceplugin.dpapi.ceilings import Candidate, Invalid, declared, resolve
from deviceplugin.health.board import HealthBoard
from deviceplugin.kube.pods import ContainerInfo, PodInfo
from deviceplugin.ledger.store import Ledger
from deviceplugin.model import GpuUuid, ResourceName
from deviceplugin.plan import build_plan
from deviceplugin.quantity import QuantityError, parse_quantity
from deviceplugin.simulate import specs
from deviceplugin.simulate.specs import SimSpec, SpecError, load_spec
from tests.test_plan import inventory

FUZZ = settings(
    derandomize=True,
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _names(keys: tuple[Key, ...]) -> list[str]:
    return [n for k in keys for n in (k.name, *_names(k.children))]


# The vocabulary the fuzzers draw keys from: every name the schemas know (so no key is
# missed as the schemas grow), and random text beside them.
CONFIG_KEYS = list(dict.fromkeys(_names(SCHEMA)))
SPEC_KEYS = sorted(specs._TOP_KEYS | specs._GPU_KEYS)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(
        ["v1", "1Gi", "-1Gi", "0", "1e400", "sm-sharing", "exclusive", "cdi", "5m", "/x/../y"]
    ),
)


def documents(keys: list[str]) -> st.SearchStrategy[Any]:
    key = st.one_of(st.sampled_from(keys), st.text(max_size=6), st.integers(-2, 2))
    return st.recursive(
        SCALARS,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(key, inner, max_size=6)
        ),
        max_leaves=25,
    )


def _dump(data: Any) -> str:
    try:
        return yaml.safe_dump(data, allow_unicode=True)
    except (yaml.YAMLError, ValueError):
        return json.dumps(data, default=str)


@FUZZ
@given(data=documents(CONFIG_KEYS), versioned=st.booleans())
def test_config_files_load_or_name_the_problem(tmp_path: Path, data: Any, versioned: bool) -> None:
    if versioned and isinstance(data, dict):
        data = {"version": "v1", **data}
    path = tmp_path / "config.yaml"
    path.write_text(_dump(data), encoding="utf-8")
    try:
        assert isinstance(load(path), Config)
    except ConfigError as err:
        assert str(err)
    try:
        assert isinstance(parse(data), Config)  # the decoded form too (keys of any type)
    except ConfigError as err:
        assert str(err)


@FUZZ
@given(raw=st.binary(max_size=200))
def test_config_bytes_load_or_name_the_problem(tmp_path: Path, raw: bytes) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes(raw)
    with pytest.raises(ConfigError):  # no byte string here is a valid config (no version)
        load(path)


@FUZZ
@given(data=documents(SPEC_KEYS), raw=st.one_of(st.none(), st.binary(max_size=80)))
def test_spec_files_load_or_name_the_problem(tmp_path: Path, data: Any, raw: bytes | None) -> None:
    path = tmp_path / "spec.yaml"
    if raw is None:
        path.write_text(_dump(data), encoding="utf-8")
    else:
        path.write_bytes(raw)
    try:
        assert isinstance(load_spec(path), SimSpec)
    except SpecError as err:
        assert str(err)


def test_missing_and_unreadable_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path)  # a directory
    with pytest.raises(SpecError):
        load_spec(tmp_path / "absent.yaml")


# ---------------------------------------------------------------------------------------------
# Ceilings from pod annotations

HOSTILE = [
    "2Gi\nNVIDIA_VISIBLE_DEVICES=all",
    "2Gi; CUDA_MPS_PIPE_DIRECTORY=/",
    "$(id)",
    "../../etc/passwd",
    "/dev/nvidia0",
    "2Gi 3Gi",
    "2 Gi",
    "0x10",
    "1e31",
    "-1Gi",
    "0",
    "２Gi",  # a full-width digit is not a digit here
    "NaN",
    "inf",
    "",
    "2Gi\x00",
]
POD_ANNOTATION = "nvidia.com/container.app.gpu-memory.limit"


def _candidate(value: str) -> Candidate:
    container = ContainerInfo(name="app", init=False, resources={"nvidia.com/gpu-fraction": 2})
    pod = PodInfo(
        uid="u1",
        namespace="ns",
        name="p",
        phase="Pending",
        deleting=False,
        annotations={POD_ANNOTATION: value},
        containers=(container,),
    )
    return Candidate(pod, container)


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_ceiling_is_invalid(value: str) -> None:
    result = declared(_candidate(value))
    assert isinstance(result, Invalid), result
    assert resolve((_candidate(value),)).limit is None  # the request applies


@FUZZ
@given(value=st.text(max_size=30))
def test_ceiling_is_a_quantity_or_invalid(value: str) -> None:
    result = declared(_candidate(value))
    if isinstance(result, Invalid):
        assert result.error and result.value == value
        return
    # Only digits, a point, a sign, an exponent or a unit suffix ever become bytes.
    assert isinstance(result, int) and result > 0 and result == parse_quantity(value)
    assert set(value.strip()) <= set("0123456789.+eEkKMGTPi")


def test_quantity_refuses_non_quantities() -> None:
    for value in HOSTILE[:-2]:
        if value != "0":
            with pytest.raises(QuantityError):
                parse_quantity(value)


class PodCeilings:
    """A CeilingSource resolving one pod's annotation the way the integration does."""

    def __init__(self, value: str) -> None:
        self.value = value

    def ceiling_for(self, resource: ResourceName, count: int, gpu: GpuUuid) -> CeilingDecision:
        resolution = resolve((_candidate(self.value),))
        return CeilingDecision(resolution.limit, resolution.source)


SAFE_ENV = {
    "NVIDIA_VISIBLE_DEVICES",
    "NVIDIA_GPU_MEMORY_REQUEST",
    "NVIDIA_GPU_MEMORY_LIMIT",
    "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
}


@pytest.mark.parametrize("value", [*HOSTILE, "6Gi", "1Ti"])
@pytest.mark.parametrize("mode", ["time-slicing", "sm-sharing"])
@pytest.mark.parametrize("strategy", ["cdi", "envvar"])  # envvar: cdi plus plain env
def test_ceilings_never_inject(tmp_path: Path, value: str, mode: str, strategy: str) -> None:
    config = parse(
        {
            "version": "v1",
            "ceilings": "allow-overcommit",
            "deviceListStrategy": ["cdi", strategy] if strategy != "cdi" else ["cdi"],
            "gpus": [{"match": {"index": 0}, "mode": mode}],
        }
    )
    plan = build_plan(inventory("h200x2"), config)
    gp = plan.gpus[0]
    allocator = Allocator(
        lambda: plan,
        lambda: config,
        tmp_path / "cdi",
        tmp_path / "mps",
        Ledger(tmp_path / "state"),
        HealthBoard(),
        None,
        PodCeilings(value),
    )
    grant = allocator.allocate(gp.resource, list(gp.device_ids[:2]))
    (name,) = [n for n in grant.cdi_devices if n.startswith(cdi_specs.KIND + "=")]
    spec = json.loads(cdi_specs.spec_path(tmp_path / "cdi", name.partition("=")[2]).read_text())
    edits = spec["devices"][0]["containerEdits"]
    envs = dict(e.split("=", 1) for e in edits["env"])
    mounts = [m["hostPath"] for m in edits.get("mounts", [])]
    if strategy == "envvar":  # the plain copy the pod could see too, plus the GPU's name
        assert grant.envs == {**envs, "NVIDIA_VISIBLE_DEVICES": gp.uuid}
        assert [host for _, host, _ in grant.mounts] == mounts
    else:
        assert grant.envs == {} and grant.mounts == []
    assert set(envs) <= SAFE_ENV
    assert "NVIDIA_VISIBLE_DEVICES" not in envs  # the driver's CDI spec keeps it `void`
    assert envs["NVIDIA_GPU_MEMORY_LIMIT"].isdigit()
    limit_mib = int(envs["NVIDIA_GPU_MEMORY_LIMIT"])
    assert int(envs["NVIDIA_GPU_MEMORY_REQUEST"]) <= limit_mib <= gp.usable // 2**20
    if mode == "sm-sharing":
        pipe = str(tmp_path / "mps" / gp.uuid / "pipe")
        assert envs["CUDA_MPS_PIPE_DIRECTORY"] == pipe
        assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={limit_mib}M"
        assert mounts == [pipe, str(tmp_path / "mps" / gp.uuid / "shm")]
    else:
        assert mounts == []
    for text in grant.annotations.values():
        assert value not in text or value in ("", "0")
