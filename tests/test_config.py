"""Config parsing: defaults, every key, bad configs naming their field, files, docs, examples."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from deviceplugin.config.settings import (
    SCHEMA,
    CdiConfig,
    Config,
    ConfigError,
    GpuMatch,
    GpuRule,
    Key,
    MpsConfig,
    ResourceNames,
    load,
    parse,
)
from deviceplugin.model import GIB, MIB, Mode

ROOT = Path(__file__).resolve().parent.parent


def problems_of(data: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse(data)
    return info.value.problems


def test_minimal_config_is_all_defaults() -> None:
    assert parse({"version": "v1"}) == Config()


def test_every_key_parses() -> None:
    config = parse(
        {
            "version": "v1",
            "sliceSize": "512Mi",
            "reservedMemory": "2Gi",
            "defaultMode": "sm-sharing",
            "resourceNames": {"timeSlicing": "example.com/ts", "smSharing": "example.com/sm"},
            "gpus": [
                {"match": {"index": 1}, "mode": "exclusive"},
                {"match": {"uuid": "GPU-abc"}, "mode": "time-slicing", "sliceSize": "2Gi"},
                {"match": {"product": "NVIDIA L4"}, "mode": "sm-sharing", "reservedMemory": 0},
            ],
            "enforcement": "best-effort",
            "ceilings": "allow-overcommit",
            "deviceListStrategy": ["envvar", "device-nodes"],
            "cdi": {"driverKind": "k8s.example.com/gpu", "nvidiaCtkPath": "/opt/ctk"},
            "health": {"ignoredXids": [13], "quietPeriod": "1m30s", "rebootXids": [79]},
            "mps": {
                "controlBinary": "/usr/bin/nvidia-cuda-mps-control",
                "protocolVersion": 3,
                "setComputeMode": False,
                "activeThreadPercentage": "proportional",
                "maxClients": 16,
            },
        }
    )
    assert config.slice_size == 512 * MIB
    assert config.reserved_memory == 2 * GIB
    assert config.default_mode is Mode.SM_SHARING
    assert config.resource_names == ResourceNames(
        time_slicing="example.com/ts",  # type: ignore[arg-type]
        sm_sharing="example.com/sm",  # type: ignore[arg-type]
    )
    assert config.gpus == (
        GpuRule(GpuMatch(index=1), Mode.EXCLUSIVE),
        GpuRule(GpuMatch(uuid="GPU-abc"), Mode.TIME_SLICING, slice_size=2 * GIB),
        GpuRule(GpuMatch(product="NVIDIA L4"), Mode.SM_SHARING, reserved_memory=0),
    )
    assert config.enforcement == "best-effort"
    assert config.ceilings == "allow-overcommit"
    assert config.device_list_strategy == ("envvar", "device-nodes")
    assert config.cdi == CdiConfig("k8s.example.com/gpu", "/opt/ctk", "/")
    assert config.health.ignored_xids == (13,)
    assert config.health.quiet_period == 90.0
    assert config.health.reboot_xids == (79,)
    assert config.mps == MpsConfig("/usr/bin/nvidia-cuda-mps-control", 3, False, None, 16)


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("no version", {}, "version: required"),
    ("wrong version", {"version": "v2"}, "version: must be v1"),
    ("unknown top key", {"version": "v1", "slicesize": "1Gi"}, "slicesize: unknown key"),
    ("negative slice", {"version": "v1", "sliceSize": "-1Gi"}, "sliceSize: must not be negative"),
    ("zero slice", {"version": "v1", "sliceSize": 0}, "sliceSize: must be greater than zero"),
    ("fraction of byte", {"version": "v1", "sliceSize": "0.5"}, "sliceSize: "),
    (
        "slice not MiB",
        {"version": "v1", "sliceSize": "1000k"},
        "sliceSize: must be a whole number of MiB",
    ),
    ("slice garbage", {"version": "v1", "sliceSize": "big"}, "sliceSize: "),
    ("reserved list", {"version": "v1", "reservedMemory": [1]}, "reservedMemory: "),
    (
        "bad default mode",
        {"version": "v1", "defaultMode": "mps"},
        "defaultMode: must be one of time-slicing, sm-sharing, exclusive",
    ),
    ("gpus not list", {"version": "v1", "gpus": {"index": 0}}, "gpus: must be a list"),
    (
        "gpu bad mode",
        {
            "version": "v1",
            "gpus": [
                {"match": {"index": 0}, "mode": "x"},
                {"match": {"index": 1}, "mode": "shared"},
            ],
        },
        "gpus[1].mode: must be one of time-slicing, sm-sharing, exclusive",
    ),
    ("gpu no mode", {"version": "v1", "gpus": [{"match": {"index": 0}}]}, "gpus[0].mode: required"),
    ("gpu no match", {"version": "v1", "gpus": [{"mode": "exclusive"}]}, "gpus[0].match: required"),
    (
        "gpu two matchers",
        {"version": "v1", "gpus": [{"match": {"index": 0, "uuid": "GPU-a"}, "mode": "exclusive"}]},
        "gpus[0].match: must name exactly one",
    ),
    (
        "gpu match unknown key",
        {"version": "v1", "gpus": [{"match": {"serial": "1"}, "mode": "exclusive"}]},
        "gpus[0].match.serial: unknown key",
    ),
    (
        "gpu negative index",
        {"version": "v1", "gpus": [{"match": {"index": -1}, "mode": "exclusive"}]},
        "gpus[0].match.index: ",
    ),
    (
        "gpu index string",
        {"version": "v1", "gpus": [{"match": {"index": "0"}, "mode": "exclusive"}]},
        "gpus[0].match.index: must be an integer",
    ),
    (
        "gpu empty uuid",
        {"version": "v1", "gpus": [{"match": {"uuid": ""}, "mode": "exclusive"}]},
        "gpus[0].match.uuid: ",
    ),
    (
        "gpu duplicate match",
        {
            "version": "v1",
            "gpus": [
                {"match": {"index": 0}, "mode": "exclusive"},
                {"match": {"index": 0}, "mode": "sm-sharing"},
            ],
        },
        "gpus[1].match: same match as gpus[0].match",
    ),
    (
        "gpu bad slice",
        {
            "version": "v1",
            "gpus": [{"match": {"index": 0}, "mode": "sm-sharing", "sliceSize": "0"}],
        },
        "gpus[0].sliceSize: must be greater than zero",
    ),
    (
        "gpu unknown key",
        {"version": "v1", "gpus": [{"match": {"index": 0}, "mode": "sm-sharing", "slices": 3}]},
        "gpus[0].slices: unknown key",
    ),
    ("gpu entry not mapping", {"version": "v1", "gpus": ["GPU-0"]}, "gpus[0]: must be a mapping"),
    (
        "enforcement",
        {"version": "v1", "enforcement": "strict"},
        "enforcement: must be one of required, best-effort",
    ),
    (
        "ceilings",
        {"version": "v1", "ceilings": "always"},
        "ceilings: must be one of reclaimable-only, allow-overcommit",
    ),
    (
        "strategy value",
        {"version": "v1", "deviceListStrategy": ["cdi", "volume-mounts"]},
        "deviceListStrategy: 'volume-mounts' not one of",
    ),
    (
        "strategy empty",
        {"version": "v1", "deviceListStrategy": []},
        "deviceListStrategy: must be a non-empty list",
    ),
    (
        "strategy repeated",
        {"version": "v1", "deviceListStrategy": ["cdi", "cdi"]},
        "deviceListStrategy: lists a strategy twice",
    ),
    (
        "resource name",
        {"version": "v1", "resourceNames": {"smSharing": "gpu fraction"}},
        "resourceNames.smSharing: ",
    ),
    (
        "resource reserved domain",
        {"version": "v1", "resourceNames": {"exclusive": "kubernetes.io/gpu"}},
        "resourceNames.exclusive: the kubernetes.io domain is reserved",
    ),
    (
        "resource names equal",
        {"version": "v1", "resourceNames": {"smSharing": "nvidia.com/gpu-fraction"}},
        "resourceNames.smSharing: same name as resourceNames.timeSlicing",
    ),
    (
        "resource unknown key",
        {"version": "v1", "resourceNames": {"mig": "nvidia.com/mig"}},
        "resourceNames.mig: unknown key",
    ),
    (
        "cdi kind",
        {"version": "v1", "cdi": {"driverKind": "nvidia"}},
        "cdi.driverKind: must be a CDI kind",
    ),
    (
        "cdi relative ctk",
        {"version": "v1", "cdi": {"nvidiaCtkPath": "nvidia-ctk"}},
        "cdi.nvidiaCtkPath: must be an absolute path",
    ),
    (
        "cdi root type",
        {"version": "v1", "cdi": {"driverRoot": 5}},
        "cdi.driverRoot: must be a non-empty string",
    ),
    ("cdi not mapping", {"version": "v1", "cdi": "nvidia.com/gpu"}, "cdi: must be a mapping"),
    (
        "health xid string",
        {"version": "v1", "health": {"resetXids": [48, "79"]}},
        "health.resetXids: '79' not a non-negative integer",
    ),
    (
        "health xids not list",
        {"version": "v1", "health": {"ignoredXids": 13}},
        "health.ignoredXids: must be a list",
    ),
    (
        "health quiet period",
        {"version": "v1", "health": {"quietPeriod": "soon"}},
        "health.quietPeriod: ",
    ),
    (
        "health negative period",
        {"version": "v1", "health": {"quietPeriod": -1}},
        "health.quietPeriod: must not be negative",
    ),
    (
        "mps protocol",
        {"version": "v1", "mps": {"protocolVersion": 4}},
        "mps.protocolVersion: must be 2 or 3",
    ),
    (
        "mps compute mode",
        {"version": "v1", "mps": {"setComputeMode": "yes"}},
        "mps.setComputeMode: must be true or false",
    ),
    (
        "mps threads 0",
        {"version": "v1", "mps": {"activeThreadPercentage": 0}},
        "mps.activeThreadPercentage: must be an integer from 1 to 100",
    ),
    (
        "mps threads word",
        {"version": "v1", "mps": {"activeThreadPercentage": "half"}},
        "mps.activeThreadPercentage: ",
    ),
    (
        "mps clients",
        {"version": "v1", "mps": {"maxClients": 64}},
        "mps.maxClients: must be from 1 to 48",
    ),
    (
        "mps clients bool",
        {"version": "v1", "mps": {"maxClients": True}},
        "mps.maxClients: must be an integer",
    ),
    (
        "mps binary",
        {"version": "v1", "mps": {"controlBinary": ""}},
        "mps.controlBinary: must be a non-empty string",
    ),
    (
        "taint effect",
        {"version": "v1", "dra": {"unhealthyTaintEffect": "PreferNoSchedule"}},
        "dra.unhealthyTaintEffect: must be one of NoSchedule, NoExecute",
    ),
    (
        "taint effect case",
        {"version": "v1", "dra": {"unhealthyTaintEffect": "noschedule"}},
        "dra.unhealthyTaintEffect: must be one of",
    ),
    ("dra not a mapping", {"version": "v1", "dra": ["NoExecute"]}, "dra: must be a mapping"),
    ("dra unknown key", {"version": "v1", "dra": {"taintEffect": "NoExecute"}}, "dra.taintEffect"),
]


def test_dra_taint_effect_defaults_to_no_schedule_and_takes_no_execute() -> None:
    assert parse({"version": "v1"}).dra.unhealthy_taint_effect == "NoSchedule"
    config = parse({"version": "v1", "dra": {"unhealthyTaintEffect": "NoExecute"}})
    assert config.dra.unhealthy_taint_effect == "NoExecute"


@pytest.mark.parametrize(
    ("data", "expected"), [(d, e) for _, d, e in BAD], ids=[n for n, _, _ in BAD]
)
def test_bad_config_names_its_field(data: dict[str, Any], expected: str) -> None:
    problems = problems_of(data)
    assert any(p.startswith(expected) for p in problems), problems


def test_bad_config_table_is_large_enough() -> None:
    assert len(BAD) >= 25


def test_every_problem_is_reported_at_once() -> None:
    problems = problems_of(
        {
            "version": "v1",
            "sliceSize": "-1",
            "defaultMode": "nope",
            "gpus": [{"match": {"index": 0}, "mode": "bad"}],
            "mps": {"maxClients": 0, "extra": 1},
        }
    )
    fields = sorted(p.split(":")[0] for p in problems)
    assert fields == ["defaultMode", "gpus[0].mode", "mps.extra", "mps.maxClients", "sliceSize"]


def test_not_a_mapping() -> None:
    assert problems_of(["version", "v1"]) == ["the config must be a YAML mapping"]


def test_strategy_may_be_one_string() -> None:
    assert parse({"version": "v1", "deviceListStrategy": "envvar"}).device_list_strategy == (
        "envvar",
    )


def test_load_reads_yaml(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "version: v1\nsliceSize: 2Gi\ngpus:\n  - match: {index: 0}\n    mode: exclusive\n"
    )
    config = load(path)
    assert config.slice_size == 2 * GIB
    assert config.gpus[0].mode is Mode.EXCLUSIVE


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("version: v1\nsliceSize: [\n", "invalid YAML"),
        ("version: v1\nsliceSize: 1Gi\nsliceSize: 2Gi\n", "duplicate key 'sliceSize'"),
        ("", "version: required"),
        ("version: v1\nfoo: 1\n", "foo: unknown key"),
    ],
)
def test_load_refuses(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load(path)
    assert any(fragment in p for p in info.value.problems), info.value.problems


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "absent.yaml")


def _leaves(keys: tuple[Key, ...], prefix: tuple[str, ...]) -> list[tuple[tuple[str, ...], Key]]:
    out: list[tuple[tuple[str, ...], Key]] = []
    for key in keys:
        if key.children and key.type == "mapping":
            out += _leaves(key.children, (*prefix, key.name))
        elif key.type != "list" or not key.children:
            out.append(((*prefix, key.name), key))
    return out


@pytest.mark.parametrize(
    ("path", "key"),
    [(p, k) for p, k in _leaves(SCHEMA, ()) if k.default is not None],
    ids=lambda v: ".".join(v) if isinstance(v, tuple) else "",
)
def test_documented_default_is_the_real_default(path: tuple[str, ...], key: Key) -> None:
    data: dict[str, Any] = {"version": "v1"}
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = yaml.safe_load(key.default or "")
    assert parse(data) == Config()


def _gen_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gen_config_docs", ROOT / "hack" / "gen-config-docs.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_are_current() -> None:
    rendered = _gen_docs().render()
    assert (ROOT / "docs" / "config.md").read_text(encoding="utf-8") == rendered, (
        "docs/config.md is stale: run hack/gen-config-docs.py"
    )


def test_docs_name_every_key() -> None:
    rendered = _gen_docs().render()
    for path, _ in _leaves(SCHEMA, ()):
        assert f"`{'.'.join(path)}`" in rendered


@pytest.mark.parametrize(
    "example", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name
)
def test_examples_load(example: Path) -> None:
    assert load(example).version == "v1"


def test_readme_config_table_is_current() -> None:
    gen = _gen_docs()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert gen.BEGIN in readme and gen.END in readme
    assert gen.render_readme(readme) == readme, "README.md is stale: run hack/gen-config-docs.py"


@pytest.mark.parametrize(
    ("value", "expected"),
    [("largest-share", None), ("8Gi", 8 * 2**30), ("1Mi", 2**20)],
)
def test_default_pinned_memory_limit(value: str, expected: int | None) -> None:
    config = parse({"version": "v1", "mps": {"defaultPinnedMemoryLimit": value}})
    assert config.mps.default_pinned_memory_limit == expected
    assert parse({"version": "v1"}).mps.default_pinned_memory_limit is None  # largest-share


@pytest.mark.parametrize("value", ["largest", "0", "1Ki", -1, True, "9" * 100])
def test_default_pinned_memory_limit_refused(value: object) -> None:
    with pytest.raises(ConfigError, match=r"mps\.defaultPinnedMemoryLimit: "):
        parse({"version": "v1", "mps": {"defaultPinnedMemoryLimit": value}})


def test_metrics_pod_labels_off_unless_set() -> None:
    assert parse({"version": "v1"}).metrics.pod_labels is False
    assert parse({"version": "v1", "metrics": {"podLabels": True}}).metrics.pod_labels is True
    with pytest.raises(ConfigError, match=r"metrics\.podLabels: "):
        parse({"version": "v1", "metrics": {"podLabels": "yes"}})


def test_simulated_node_keeps_host_systemd_only_with_the_hosts_own_binary() -> None:
    """A simulated node's fake control binary lives in the plugin's container, so its daemons
    start directly; with `hostBinary` the host has its own, and `host-systemd` stays (the
    cluster suite's node runs a systemd-run stand-in)."""
    from deviceplugin.config.settings import MpsConfig, with_control_binary

    host = Config(mps=MpsConfig(launcher="host-systemd", host_binary="/node/bin/mps-control"))
    kept = with_control_binary(host, "/state/simulate/nvidia-cuda-mps-control")
    assert kept.mps.launcher == "host-systemd"
    assert kept.mps.control_binary == "/state/simulate/nvidia-cuda-mps-control"
    assert kept.mps.host_binary == "/node/bin/mps-control"
    bare = with_control_binary(Config(mps=MpsConfig(launcher="host-systemd")), "/fake")
    assert bare.mps.launcher == "direct"
    assert with_control_binary(Config(), "/fake").mps.launcher == "direct"
