"""A container as a runtime would start it from an Allocate answer, without a runtime.

`view_of` resolves the answer the way the kubelet and a CDI runtime do: the plain envs,
mounts and device specs, then the CDI devices (in order, from the spec files, with the
project's own `cdi_registry`), whose edits win as the CDI library applies them (a variable
replaced, a mount or device node at the same path replaced, the last device winning).
`container_argv` runs a command with only that view: new mount and IPC namespaces, a
private tmpfs at /dev/shm, a /dev holding only the OCI default nodes and the answer's device
nodes, then the answer's bind mounts. It is what the hardware check (`hack/gpu-smoke.sh`,
DESIGN 9) and the wiring tests run clients in, so a wiring mistake fails there. Needs root
(mount namespaces). The filesystem is the host's otherwise (no image): libraries and the
interpreter come from there.

`python -m deviceplugin.simulate.pod --answer ANSWER.json [--spec-dir DIR]... -- CMD...`
runs CMD so; ANSWER.json holds `envs`, `mounts`, `device_specs` and `cdi_devices` as the
allocator's Grant has them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deviceplugin.cdi import registry as cdi_registry

DEFAULT_SPEC_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))
# What every OCI container gets in /dev besides its devices (runtime-spec config-linux.md).
OCI_DEFAULT_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")

# $1: the new /dev's staging dir; then (host, container) device node pairs up to `--`; then
# (host, container) mount pairs up to `--`; then the command. /dev is built aside and moved
# in place. A missing mount source fails the container, as runc's does (it stats the source
# of a bind, libcontainer/rootfs_linux.go `mountToRootfs`); the mount point is created on the
# host's filesystem (there is no image), so a missing source with the same path would
# otherwise be created there, empty.
_SCRIPT = r"""
set -e
stage="$1"; shift
mount -t tmpfs -o mode=755,nosuid tmpfs "$stage"
for d in null zero full random urandom tty; do
  [ -e "/dev/$d" ] || continue
  touch "$stage/$d"; mount --bind "/dev/$d" "$stage/$d"
done
while [ "$1" != "--" ]; do
  [ -e "$1" ] || { echo "pod: device node $1 is missing on the host" >&2; exit 92; }
  dev="${2#/dev/}"
  mkdir -p "$stage/$(dirname -- "$dev")"
  touch "$stage/$dev"; mount --bind -- "$1" "$stage/$dev"
  shift 2
done
shift
mkdir -p "$stage/shm" "$stage/pts"
mount -t tmpfs -o size=64m,mode=1777,nosuid,nodev tmpfs "$stage/shm"
mount --move "$stage" /dev
while [ "$1" != "--" ]; do
  [ -e "$1" ] || { echo "pod: mount source $1 is missing on the host" >&2; exit 93; }
  if [ -d "$1" ]; then mkdir -p -- "$2"; else mkdir -p -- "$(dirname -- "$2")"; touch -- "$2"; fi
  mount --bind -- "$1" "$2"
  shift 2
done
shift
exec "$@"
"""


@dataclass(frozen=True)
class PodView:
    """What the container gets: its env, bind mounts and device nodes (host, container)."""

    env: dict[str, str]
    mounts: list[tuple[str, str]] = field(default_factory=list)
    device_nodes: list[tuple[str, str]] = field(default_factory=list)
    hooks: list[dict[str, Any]] = field(default_factory=list)


def view_of(answer: Mapping[str, Any], spec_dirs: Iterable[Path] = DEFAULT_SPEC_DIRS) -> PodView:
    """The container's view of an Allocate answer (raises cdi_registry.UnresolvableDevice
    when a CDI device it names is in no spec, as a runtime fails the container)."""
    # What the runtime built from the kubelet's answer, before any CDI edit.
    built = cdi_registry.Resolved(
        env={str(k): str(v) for k, v in (answer.get("envs") or {}).items()},
        mounts=[
            {"hostPath": str(host), "containerPath": str(ctr)}
            for ctr, host, *_ in answer.get("mounts") or []
        ],
        device_nodes=[
            {"hostPath": str(host), "path": str(ctr)}
            for ctr, host, *_ in answer.get("device_specs") or []
        ],
    )
    names = list(answer.get("cdi_devices") or [])
    if names:  # the runtime applies the CDI edits last, over what it built
        cdi_registry.resolve(list(spec_dirs), names, built)
    return PodView(
        built.env,
        [(m["hostPath"], m["containerPath"]) for m in built.mounts],
        [(n.get("hostPath", n["path"]), n["path"]) for n in built.device_nodes],
        built.hooks,
    )


def container_argv(
    view: PodView, argv: Sequence[str], stage: Path, unshare: str = "unshare"
) -> list[str]:
    """`argv` in new mount and IPC namespaces with only `view`'s /dev and mounts; `stage` is
    an empty directory used to build the new /dev."""
    nodes = [part for host, ctr in view.device_nodes for part in (host, ctr)]
    pairs = [part for host, ctr in view.mounts for part in (host, ctr)]
    return [
        unshare, "--mount", "--ipc", "--propagation", "private", "--fork", "--",
        "sh", "-c", _SCRIPT, "sh", str(stage), *nodes, "--", *pairs, "--", *argv,
    ]  # fmt: skip


def container_env(view: PodView, keep: Iterable[str] = ("PATH",)) -> dict[str, str]:
    """The process environment: only `keep` from ours (the image's PATH), then the view's."""
    return {**{k: os.environ[k] for k in keep if k in os.environ}, **view.env}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deviceplugin.simulate.pod")
    parser.add_argument("--answer", type=Path, required=True, help="the Allocate answer (JSON)")
    parser.add_argument("--spec-dir", type=Path, action="append", help="CDI spec dirs")
    parser.add_argument("--stage", type=Path, required=True, help="an empty dir for /dev")
    parser.add_argument("--keep-env", action="append", default=["PATH"])
    parser.add_argument("--print", action="store_true", help="print the view, run nothing")
    parser.add_argument("command", nargs="*")
    args = parser.parse_args(argv)
    answer = json.loads(args.answer.read_text())
    view = view_of(answer, args.spec_dir or DEFAULT_SPEC_DIRS)
    if args.print or not args.command:
        print(json.dumps(view.__dict__, indent=2))
        return 0
    env = container_env(view, args.keep_env)
    cmd = container_argv(view, args.command, args.stage)
    os.execvpe(cmd[0], cmd, env)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
