"""Every config key once (`SCHEMA`), with the defaults, limits and choices it documents.

The parser rejects keys `SCHEMA` does not list and `hack/gen-config-docs.py` renders
`docs/config.md` from it: plain data, kept apart from the dataclasses and the checks.
`deviceplugin.config.settings` imports it from here and stays the one import path for its
public names.
"""

from __future__ import annotations

from dataclasses import dataclass

from deviceplugin.model import Mode, ServingApi

# Xid classes: reference/nvml-mps-xid.md section 4; DESIGN section 5.
DEFAULT_APPLICATION_XIDS: tuple[int, ...] = (13, 31, 43, 45, 68, 69, 94)
DEFAULT_RESET_XIDS: tuple[int, ...] = (
    46, 48, 62, 64, 95, 109, 110, 119, 120, 136, 140, 143, 155, 158,
)  # fmt: skip
DEFAULT_REBOOT_XIDS: tuple[int, ...] = (79, 160)

TAINT_EFFECT_CHOICES = ("NoSchedule", "NoExecute")
ENFORCEMENT_CHOICES = ("required", "best-effort")
CEILING_CHOICES = ("reclaimable-only", "allow-overcommit")
STRATEGY_CHOICES = ("cdi", "envvar", "device-nodes")
MODE_CHOICES = tuple(m.value for m in Mode)
API_CHOICES = tuple(a.value for a in ServingApi)
MAX_MPS_CLIENTS = 48  # Volta and newer (reference/nvml-mps-xid.md)
LAUNCHER_DIRECT = "direct"
LAUNCHER_HOST_SYSTEMD = "host-systemd"
LAUNCHER_CHOICES = (LAUNCHER_DIRECT, LAUNCHER_HOST_SYSTEMD)


@dataclass(frozen=True)
class Key:
    name: str
    type: str
    default: str | None  # the default as YAML text; None when there is none
    doc: str
    children: tuple[Key, ...] = ()


def _xids(values: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


PINNED_LARGEST_SHARE = "largest-share"

SCHEMA: tuple[Key, ...] = (
    Key("version", "string", None, "Required. The config format version; only `v1` exists."),
    Key(
        "sliceSize",
        "quantity",
        "1Gi",
        "Memory per advertised slice. A whole number of MiB, greater than zero.",
    ),
    Key("reservedMemory", "quantity", "1Gi", "Memory held back per GPU; usable = total - this."),
    Key("defaultMode", "mode", "time-slicing", "Mode of GPUs no `gpus` entry matches."),
    Key(
        "resourceNames",
        "mapping",
        None,
        "Extended resource name per mode; the three must differ.",
        (
            Key("timeSlicing", "string", "nvidia.com/gpu-fraction", "Time-slicing slices."),
            Key(
                "smSharing",
                "string",
                "nvidia.com/gpu-fraction.sm-sharing",
                "Sm-sharing (MPS) slices.",
            ),
            Key("exclusive", "string", "nvidia.com/gpu", "Whole GPUs."),
        ),
    ),
    Key(
        "gpus",
        "list",
        "[]",
        "Per-GPU rules; the first entry whose `match` fits a GPU wins. An entry that matches "
        "no GPU of a node is a warning (one config serves nodes of different sizes).",
        (
            Key(
                "match",
                "mapping",
                None,
                "Required. Exactly one of `index` (integer), `uuid` (string) or `product` "
                "(the NVML product name, compared whole and case-insensitively).",
            ),
            Key("mode", "mode", None, "Required. `time-slicing`, `sm-sharing` or `exclusive`."),
            Key("sliceSize", "quantity", None, "Overrides the top-level `sliceSize`."),
            Key("reservedMemory", "quantity", None, "Overrides the top-level `reservedMemory`."),
            Key("api", "string", None, "Overrides the top-level `api` for this GPU."),
        ),
    ),
    Key(
        "api",
        "string",
        "device-plugin",
        "Which Kubernetes API hands GPUs out: `device-plugin` (extended resources through the "
        "kubelet's device-plugin API) or `dra` (ResourceSlices and claims through Dynamic "
        "Resource Allocation; needs API credentials and a node name). Each GPU is served by "
        "exactly one of them.",
    ),
    Key(
        "dra",
        "mapping",
        None,
        "DRA settings (GPUs with `api: dra`).",
        (
            Key(
                "unhealthyTaintEffect",
                "string",
                "NoSchedule",
                "Effect of the taint `gpu-fraction.dev/unhealthy` that an unhealthy device "
                "carries in its ResourceSlice (removed when it recovers): `NoSchedule` (new "
                "claims avoid it) or `NoExecute` (also evicts the pods of claims using it).",
            ),
        ),
    ),
    Key(
        "enforcement",
        "string",
        "required",
        "`required`: a time-slicing GPU whose caps nothing would enforce is not advertised "
        "(the failed condition is logged and shown by `inventory`). `best-effort`: it is "
        "advertised and every allocation records enforcement `none`.",
    ),
    Key(
        "ceilings",
        "string",
        "reclaimable-only",
        "`reclaimable-only`: a pod ceiling above its request is honoured only where borrowed "
        "memory can be reclaimed; `allow-overcommit`: honoured everywhere.",
    ),
    Key(
        "deviceListStrategy",
        "list of strings",
        "[cdi]",
        "How allocations reach containers: `cdi` (CDI devices; caps as CDI edits), `envvar` "
        "(plain env variables and mounts, overridable by the pod), `device-nodes` (also "
        "device specs for the GPU's device nodes). A single string is one entry.",
    ),
    Key(
        "cdi",
        "mapping",
        None,
        "CDI settings.",
        (
            Key(
                "driverKind",
                "string",
                "nvidia.com/gpu",
                "Kind of the NVIDIA container toolkit's CDI spec on the host.",
            ),
            Key(
                "nvidiaCtkPath",
                "path",
                "/usr/bin/nvidia-ctk",
                "Absolute path of the host's `nvidia-ctk` (mounted read-only there); the "
                "memory-limit hook runs it.",
            ),
            Key(
                "driverRoot",
                "path",
                "/",
                "Absolute driver root (a host path) passed to the hook and to "
                "`nvidia-ctk cdi generate`; GPU Operator nodes: `/run/nvidia/driver`.",
            ),
            Key(
                "devRoot",
                "path",
                "/",
                "Absolute host path holding the driver's `dev/nvidia*` nodes, passed to "
                "`nvidia-ctk cdi generate --dev-root`.",
            ),
            Key(
                "specDirs",
                "list of paths",
                "[/etc/cdi, /var/run/cdi]",
                "The CDI spec directories the container runtime reads (mounted read-only). "
                "Under `cdi` a GPU is advertised only when `<driverKind>=<uuid>` resolves "
                "there, or else (GPU Operator nodes) a device the plugin generates with "
                "`nvidia-ctk cdi generate` as `driver.gpu-fraction.dev/gpu=<uuid>` into "
                "`--cdi-dir`; with neither it is skipped, `no-driver-cdi-device`. Rechecked "
                "when they change.",
            ),
        ),
    ),
    Key(
        "health",
        "mapping",
        None,
        "Xid classes and recovery.",
        (
            Key("ignoredXids", "list of integers", "[]", "Xids that change no health."),
            Key(
                "applicationXids",
                "list of integers",
                _xids(DEFAULT_APPLICATION_XIDS),
                "Application Xids: fault an sm-sharing GPU's MPS server only.",
            ),
            Key(
                "resetXids",
                "list of integers",
                _xids(DEFAULT_RESET_XIDS),
                "Xids that need a GPU reset: the whole GPU is Unhealthy.",
            ),
            Key(
                "rebootXids",
                "list of integers",
                _xids(DEFAULT_REBOOT_XIDS),
                "Xids that need a node reboot: the whole GPU is Unhealthy.",
            ),
            Key(
                "quietPeriod",
                "duration",
                "30s",
                "How long a recovered GPU must stay quiet before its slices are Healthy again "
                "(`500ms`, `30s`, `2m`, `1h`, or seconds as a number).",
            ),
        ),
    ),
    Key(
        "mps",
        "mapping",
        None,
        "MPS control daemons of sm-sharing GPUs.",
        (
            Key("controlBinary", "string", "nvidia-cuda-mps-control", "The control binary."),
            Key(
                "protocolVersion",
                "integer",
                "2",
                "`2` (legacy server) or `3` (driver r615+; per-client memory accounting, "
                "which makes `cuda-memory-limits` apply and borrowed memory reclaimable).",
            ),
            Key(
                "setComputeMode",
                "boolean",
                "true",
                "Set EXCLUSIVE_PROCESS on sm-sharing GPUs and DEFAULT on time-slicing GPUs; "
                "`false` leaves compute modes alone.",
            ),
            Key(
                "activeThreadPercentage",
                "integer or string",
                "100",
                "An integer 1–100, or `proportional` (the container's share of the GPU's "
                "slices, rounded up, at least 1).",
            ),
            Key(
                "maxClients",
                "integer",
                "48",
                f"Most live sm-sharing allocations per GPU (1–{MAX_MPS_CLIENTS}).",
            ),
            Key(
                "launcher",
                "string",
                LAUNCHER_DIRECT,
                "How daemons start: `direct` (a session of their own; bare metal, simulation) "
                "or `host-systemd` (a transient unit of the host's systemd, so they outlive "
                "the plugin's container; needs `hostPID: true` and a privileged pod).",
            ),
            Key(
                "hostBinary",
                "string",
                None,
                "With `launcher: host-systemd`: the control binary's path on the host "
                "(default: `controlBinary`, looked up on the host's PATH). With a "
                "`cdi.driverRoot` other than `/` the unit runs inside that root: give the path "
                "inside it or the host path under it (both work).",
            ),
            Key(
                "shmSize",
                "quantity",
                "8Gi",
                "Size of the per-GPU tmpfs `<mps-root>/<uuid>/shm`, the daemon's and every "
                "client's `/dev/shm` (tmpfs uses only what is written).",
            ),
            Key(
                "probeInterval",
                "duration",
                "5s",
                "Time between liveness probes of a daemon (one control-client run each, "
                "5 s timeout).",
            ),
            Key(
                "probeFailures",
                "integer",
                "3",
                "Failed probes in a row that mark a daemon wedged (a dead daemon counts at once).",
            ),
            Key(
                "maxLogBytes",
                "quantity",
                "8Mi",
                "Bound on a GPU's daemon logs under `<mps-root>/<uuid>/log`; the plugin "
                "truncates them in place when they grow past it.",
            ),
            Key(
                "defaultPinnedMemoryLimit",
                "quantity or string",
                PINNED_LARGEST_SHARE,
                "The daemon's default pinned device memory limit, the most any client can "
                "raise its own `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` to (docs/threat-model.md). "
                "`largest-share`: the largest share one container can be granted on the GPU "
                "(its usable memory). A quantity (at least 1Mi, capped at the usable memory) "
                "lowers it: a container granted more is then held to it too.",
            ),
        ),
    ),
    Key(
        "metrics",
        "mapping",
        None,
        "What `/metrics` exports.",
        (
            Key(
                "podLabels",
                "boolean",
                "false",
                "Label the allocation memory gauges with `namespace`, `pod` and `container`. "
                "Off: one series per resource and GPU (the sum of its allocations), so the "
                "endpoint names no tenant's pods.",
            ),
        ),
    ),
)
