"""A real container runtime on a simulated GPU node, kept away from the host.

`Namespace` holds a private mount namespace (`unshare --mount --propagation private`) open
with one waiting process; commands enter it with `nsenter`. Inside it, and only there: a
tmpfs on `/run` (podman's and runc's state; `/run/cdi` is where podman reads CDI specs, and
the plugin's CDI directory is bound onto it), an overlay on `/dev` holding stand-in
`/dev/nvidia*` nodes (major 195), an overlay on the driver library directory holding
stand-in libraries named as the simulated toolkit spec mounts them, an overlay on the binary
directory holding the simulator's stand-in `nvidia-smi` (and both the same under the GPU
Operator's driver root, on the `/run` tmpfs), and an overlay on `/var/lib` (podman's
blob-info cache). The host never sees any of it.

`Podman` runs rootful podman with runc (crun fails on hybrid cgroups) with its own storage,
run and tmp directories under the suite's temp dir, `--network=none`, no events, explicit
ulimits and a cgroup parent of its own (removed at the end). `run_args` turns a kubelet
answer into podman arguments as a CRI runtime applies it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deviceplugin.simulate.cdi import BIN_DIR, LIB_DIR, write_binaries
from tests.e2e.requirements import BUSYBOX

IMAGE = "localhost/gf-e2e-busybox:1"
NVIDIA_MAJOR = 195
UVM_MAJOR = 510  # dynamic on a real node; any major does for a stand-in
APPLETS = ("sh", "env", "cat", "ls", "stat", "echo", "test", "true", "touch", "mkdir")
OLDEST_ENGINE_CDI = "0.5.0"  # the newest cdiVersion podman 4.3's vendored CDI library accepts
ULIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1000:1000")

# $1: the namespace's scratch dir; $2..: "name major minor" device node triples, then "--",
# then library paths, "--", binary paths (each a copy of $1/bin/<its name>). Files go only
# into the overlays or the /run tmpfs. Prints "ready" and holds the namespace until stdin
# closes.
_SETUP = r"""
set -eu
ns="$1"; shift
mount -t tmpfs -o mode=755,nosuid,nodev tmpfs /run
mkdir -p /run/cdi
mkdir -p "$ns/olddev" "$ns/dev-up" "$ns/dev-work" "$ns/lib-up" "$ns/lib-work" \
  "$ns/bin-up" "$ns/bin-work" "$ns/varlib-up" "$ns/varlib-work"
mount --rbind /dev "$ns/olddev"
mount -t overlay overlay -o "lowerdir=/dev,upperdir=$ns/dev-up,workdir=$ns/dev-work" /dev
for sub in $(awk '$5 ~ "^/dev/" {print $5}' /proc/self/mountinfo | sort -u); do
  [ -d "$ns/olddev/${sub#/dev/}" ] && mount --rbind "$ns/olddev/${sub#/dev/}" "$sub"
done
umount -R "$ns/olddev"
while [ "$1" != "--" ]; do
  mknod -m 666 "/dev/$1" c "$2" "$3"; shift 3
done
shift
mount -t overlay overlay -o "lowerdir=LIBDIR,upperdir=$ns/lib-up,workdir=$ns/lib-work" LIBDIR
mount -t overlay overlay -o "lowerdir=BINDIR,upperdir=$ns/bin-up,workdir=$ns/bin-work" BINDIR
stand_in() {
  case "$1" in
    /run/*|LIBDIR/*|BINDIR/*) mkdir -p "${1%/*}" ;;
    *) echo "refusing to write $1 outside the overlays" >&2; exit 1 ;;
  esac
}
while [ "$1" != "--" ]; do
  stand_in "$1"; echo "stand-in driver library" > "$1"; shift
done
shift
for bin in "$@"; do stand_in "$bin"; cp "$ns/bin/${bin##*/}" "$bin"; chmod 755 "$bin"; done
mount -t overlay overlay -o "lowerdir=/var/lib,upperdir=$ns/varlib-up,workdir=$ns/varlib-work" \
  /var/lib
echo ready
read -r _ || true
""".replace("LIBDIR", LIB_DIR).replace("BINDIR", BIN_DIR)


class Namespace:
    """A private mount namespace with stand-in GPU device nodes, driver libraries and the
    driver's binaries (the simulator's stand-ins) at `binaries`."""

    def __init__(
        self,
        scratch: Path,
        minors: Iterable[int],
        libraries: Iterable[str],
        binaries: Iterable[str] = (),
    ) -> None:
        scratch.mkdir(parents=True, exist_ok=True)
        write_binaries(scratch / "bin")
        nodes = [f"nvidia{m} {NVIDIA_MAJOR} {m}" for m in minors]
        nodes += [f"nvidiactl {NVIDIA_MAJOR} 255", f"nvidia-uvm {UVM_MAJOR} 0"]
        nodes += [f"nvidia-uvm-tools {UVM_MAJOR} 1"]
        triples = [part for node in nodes for part in node.split()]
        self.proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", _SETUP,
             "sh", str(scratch), *triples, "--", *libraries, "--", *binaries],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != b"ready":
            self.proc.kill()
            _, err = self.proc.communicate(timeout=10)
            raise RuntimeError(f"mount namespace setup failed: {err.decode()[-2000:]}")
        self.mnt = os.readlink(f"/proc/{self.proc.pid}/ns/mnt")

    def argv(self, *cmd: str) -> list[str]:
        """`cmd` run inside the namespace (nsenter execs it: same pid, same process group)."""
        return ["nsenter", f"--mount=/proc/{self.proc.pid}/ns/mnt", "--", *cmd]

    def run(self, *cmd: str, check: bool = True, timeout: float = 60) -> str:
        out = subprocess.run(self.argv(*cmd), capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"{cmd}: rc={out.returncode} {out.stderr[-2000:]}")
        return out.stdout

    def bind_cdi(self, cdi_dir: Path) -> None:
        """Make `cdi_dir` the namespace's /run/cdi (= /var/run/cdi), where podman reads specs."""
        self.run(
            "sh", "-c", 'umount /run/cdi 2>/dev/null; mount --bind "$0" /run/cdi', str(cdi_dir)
        )

    def members(self) -> list[int]:
        """Pids of every process (but the holder) still inside the namespace."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == self.proc.pid:
                continue
            try:
                if os.readlink(entry / "ns" / "mnt") == self.mnt:
                    pids.append(int(entry.name))
            except OSError:
                continue
        return pids

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(10)


@dataclass
class Ran:
    """One container run: exit status, its output split by `==section` lines, its id."""

    rc: int
    stdout: str
    stderr: str
    cid: str = ""
    tag: str = ""  # the file name the probe wrote into /dev/shm
    sections: dict[str, list[str]] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        return dict(line.split("=", 1) for line in self.sections.get("env", []) if "=" in line)

    def stable_env(self) -> dict[str, str]:
        """The env but what differs between runs of the same answer (the hostname)."""
        return {k: v for k, v in self.env.items() if k != "HOSTNAME"}

    def nodes(self) -> dict[str, tuple[int, int]]:
        """/dev/nvidia* in the container: path → (major, minor)."""
        out = {}
        for line in self.sections.get("dev", []):
            path, major, minor = line.split()
            out[path] = (int(major, 16), int(minor, 16))
        return out

    def mount_points(self) -> set[str]:
        return {line.split()[4] for line in self.sections.get("mounts", [])}


# What every probe container runs: its env as getenv() sees it, its /dev/nvidia* nodes, its
# mounts, the MPS pipe dir listing, the driver libraries, what `nvidia-smi -L` says (found
# on the image's PATH, as a pod's command is) and its exit status; and it writes $1 into
# /dev/shm.
PROBE = r"""
echo ==env; env
echo ==dev
for f in /dev/nvidia*; do [ -e "$f" ] && stat -c '%n %t %T' "$f"; done
echo ==mounts; cat /proc/self/mountinfo
if [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ]; then echo ==pipe; ls -a "$CUDA_MPS_PIPE_DIRECTORY"; fi
echo ==libs; ls LIBDIR 2>/dev/null
echo ==smi; nvidia-smi -L 2>&1; echo "rc=$?"
echo "written by $1" > "/dev/shm/$1"
""".replace("LIBDIR", LIB_DIR)


def sections(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("=="):
            current = out.setdefault(line[2:], [])
        elif current is not None:
            current.append(line)
    return out


def run_args(answer: Any, pod_env: Mapping[str, str] | None = None) -> list[str]:
    """A ContainerAllocateResponse as a CRI runtime applies it: the plugin's envs, then the
    pod's own (the kubelet appends them, so they win over plain envs), mounts, device specs,
    annotations, and the CDI devices in the answer's order (their edits apply last)."""
    args: list[str] = []
    env = {**dict(answer.envs), **(pod_env or {})}
    for name, value in env.items():
        args += ["-e", f"{name}={value}"]
    for m in answer.mounts:
        args += ["-v", f"{m.host_path}:{m.container_path}:{'ro' if m.read_only else 'rw'}"]
    for d in answer.devices:
        args += ["--device", f"{d.host_path}:{d.container_path}:{d.permissions or 'rw'}"]
    for key, value in answer.annotations.items():
        args += ["--annotation", f"{key}={value}"]
    return args + cdi_args([d.name for d in answer.cdi_devices])


def cdi_args(names: Iterable[str]) -> list[str]:
    return [part for name in names for part in ("--device", name)]


class Podman:
    """Rootful podman with runc inside `ns`, every piece of its state under `root`."""

    def __init__(self, ns: Namespace, root: Path) -> None:
        self.ns = ns
        self.root = root
        self.cgroup_parent = f"/{root.parent.name}"  # the suite's scratch dir name
        self.runs = 0
        for sub in ("storage", "runroot", "libpod-tmp", "tmp", "networks", "cids"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        conf = root / "containers.conf"
        conf.write_text(
            "[engine]\n"
            f'tmp_dir = "{root / "libpod-tmp"}"\n'
            'events_logger = "none"\n'
            'runtime = "runc"\n'
            'cgroup_manager = "cgroupfs"\n'
            "[network]\n"
            'network_backend = "netavark"\n'
            f'network_config_dir = "{root / "networks"}"\n'
        )
        self.env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")}
        self.env.update(CONTAINERS_CONF=str(conf), TMPDIR=str(root / "tmp"))

    def argv(self, *args: str) -> list[str]:
        return self.ns.argv(
            "podman",
            "--root", str(self.root / "storage"),
            "--runroot", str(self.root / "runroot"),
            "--tmpdir", str(self.root / "libpod-tmp"),
            "--storage-driver", "vfs",
            "--runtime", "runc",
            "--cgroup-manager", "cgroupfs",
            "--events-backend", "none",
            "--network-config-dir", str(self.root / "networks"),
            *args,
        )  # fmt: skip

    def __call__(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*args), capture_output=True, text=True, timeout=timeout, env=self.env
        )

    def build_image(self) -> None:
        """The suite's image: Debian's static busybox and a few applet links, imported from a
        local tar (no registry)."""
        rootfs = self.root / "rootfs"
        (rootfs / "bin").mkdir(parents=True, exist_ok=True)
        shutil.copy2(BUSYBOX, rootfs / "bin" / "busybox")
        for applet in APPLETS:
            link = rootfs / "bin" / applet
            if not link.is_symlink():
                link.symlink_to("busybox")
        for sub in ("dev", "proc", "sys", "tmp", "etc"):
            (rootfs / sub).mkdir(exist_ok=True)
        tar = self.root / "rootfs.tar"
        subprocess.run(["tar", "-C", str(rootfs), "-cf", str(tar), "."], check=True)
        out = self("import", str(tar), IMAGE)
        assert out.returncode == 0, out.stderr
        tar.unlink()
        shutil.rmtree(rootfs)

    def run(
        self,
        args: Sequence[str],
        command: Sequence[str] | None = None,
        tag: str | None = None,
    ) -> Ran:
        """`podman run --rm` of the image with `args`; by default the probe, writing `tag`
        (default: a per-run name) into /dev/shm."""
        self.runs += 1
        tag = tag or f"e2e-{self.runs}"
        cidfile = self.root / "cids" / f"{self.runs}.cid"
        cmd = list(command) if command is not None else ["sh", "-c", PROBE, "probe", tag]
        out = self(
            "run", "--rm", "--network=none", *ULIMITS,
            "--cgroup-parent", self.cgroup_parent,
            "--cidfile", str(cidfile),
            *args, IMAGE, *cmd,
        )  # fmt: skip
        cid = cidfile.read_text().strip() if cidfile.exists() else ""
        cidfile.unlink(missing_ok=True)
        return Ran(out.returncode, out.stdout, out.stderr, cid, tag, sections(out.stdout))

    def leftovers(self) -> list[str]:
        """Containers and images podman still has (after `remove_all`: none)."""
        found = []
        for what in (("ps", "-aq"), ("images", "-q")):
            out = self(*what)
            found += [f"{what[0]}: {line}" for line in out.stdout.split()]
            if out.returncode != 0:
                found.append(f"{what[0]} failed: {out.stderr.strip()}")
        return found

    def remove_all(self) -> None:
        self("rm", "-af")
        self("rmi", "-af")

    def remove_cgroups(self) -> list[str]:
        """Remove the cgroup parent in every hierarchy; returns those that would not go."""
        left = []
        for hierarchy in Path("/sys/fs/cgroup").iterdir():
            top = hierarchy / self.cgroup_parent.lstrip("/")
            if not top.is_dir():
                continue
            for d in sorted((p for p in top.rglob("*") if p.is_dir()), reverse=True):
                d.rmdir()
            try:
                top.rmdir()
            except OSError as exc:
                left.append(f"{top}: {exc}")
        return left


STUB_CTK = r'''#!PYTHON -I
"""Stand-in nvidia-ctk (NVIDIA Container Toolkit 1.20.1): records each hook run."""
import json, sys
args = sys.argv[1:]
if args[:1] == ["--version"]:
    print("NVIDIA Container Toolkit CLI version 1.20.1"); sys.exit(0)
if args[:1] != ["hook"] or len(args) < 2:
    print(f"nvidia-ctk: unsupported: {args}", file=sys.stderr); sys.exit(1)
if "--help" in args:
    print(f"{args[1]}: a hook of the stand-in toolkit"); sys.exit(0)
record = {"argv": sys.argv, "stdin": sys.stdin.read()}
try:
    state = json.loads(record["stdin"])
    record["cgroup"] = open(f"/proc/{state['pid']}/cgroup").read()
    with open(f"{state['bundle']}/config.json") as f:
        record["env"] = json.load(f)["process"]["env"]
except Exception as exc:
    record["error"] = repr(exc)
with open("RECORDS", "a") as f:
    f.write(json.dumps(record) + "\n")
'''


def write_stub_ctk(path: Path, records: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(STUB_CTK.replace("PYTHON", sys.executable).replace("RECORDS", str(records)))
    path.chmod(0o755)
    return path


def hook_records(records: Path, cid: str) -> list[dict[str, Any]]:
    """The stub's records of the hooks run for container `cid` (its OCI state says the id)."""
    if not records.exists():
        return []
    out = []
    for line in records.read_text().splitlines():
        record = json.loads(line)
        try:
            state = json.loads(record["stdin"])
        except ValueError:
            continue
        if state.get("id") == cid:
            out.append({**record, "state": state})
    return out


def version(text: object) -> tuple[int, ...]:
    return tuple(int(p) for p in str(text).split("."))
