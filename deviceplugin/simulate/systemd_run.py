"""A stand-in `systemd-run` for a node without systemd: the cluster suite's node (hack/cluster/
up.sh puts it first on the node's PATH), where `mps.launcher: host-systemd` runs
`nsenter -t 1 -m -- systemd-run --unit=… --collect --quiet --property=Type=forking … -- <binary> -d`
(deviceplugin/mps/launch.py, HostSystemdLauncher).

It takes only what that launcher sends and refuses anything else, and it does what systemd does
with it (systemd v252; the man pages systemd-run(1), systemd.service(5), systemd.exec(5)):

- the command runs with the `-E` variables and systemd's own only, never the caller's
  (systemd.exec(5), "Environment Variables in Spawned Processes"), stdin on /dev/null and its
  output in the unit's journal (here `<state>/<unit>.journal`), as a session leader (systemd
  calls setsid() for every process it spawns: src/core/execute.c, exec_child);
- in a cgroup of its own, `<cgroup root>/system.slice/<unit>` in every hierarchy, outside the
  caller's (src/core/execute.c exec_child attaches the child before exec), so it outlives
  the caller's container;
- `BindPaths=src[:dst]`, `RootDirectory=`, `MountAPIVFS=` in a private mount namespace whose
  mounts the host never sees (systemd.exec(5); the namespace's root is MS_SLAVE, as
  src/core/namespace.c setup_namespace makes it);
- `Type=forking`: the start is done when the started process exits (systemd.service(5)); a
  non-zero exit fails the start job, and systemd-run exits 1, printing nothing under `--quiet`
  (src/shared/bus-wait-for-jobs.c check_wait_response logs only when not quiet);
- a unit name still active is refused: "Failed to start transient service unit: Unit X was
  already loaded or has a fragment file." and exit 1 (src/core/dbus-manager.c
  transient_unit_from_message, src/run/run.c start_transient_service); a unit is active while
  its cgroup holds a process; an inactive one is collected (`--collect`; a failed one stays
  loaded, and refused, without it).

Stdlib only: the node runs it with the host's python3 (`python3 -I …/systemd_run.py`).
Environment of the stand-in itself: SYSTEMD_RUN_SIM_CGROUP_ROOT (the node's cgroup root, the
kubelet's cgroupRoot; default /), SYSTEMD_RUN_SIM_STATE (journal and failed-unit marks; default
/run/systemd-run-sim), SYSTEMD_RUN_SIM_CGROUP_MOUNTS (colon-separated hierarchies instead of
the mounted ones: for tests).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# systemd.exec(5): the system manager's fixed $PATH (merged /usr).
SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"
EXISTS = (
    "Failed to start transient service unit: Unit {} was already loaded or has a fragment file."
)
SLICE = "system.slice"
CLONE_NEWNS = 0x00020000
MS_BIND, MS_REC, MS_SLAVE = 0x1000, 0x4000, 0x80000
EXIT_FAILURE = 1


class Refused(Exception):
    """What systemd-run would refuse; the message is its one line."""


@dataclass
class Request:
    unit: str
    command: list[str]
    collect: bool = False
    quiet: bool = False
    binds: list[tuple[str, str]] = field(default_factory=list)
    root: str | None = None
    api_vfs: bool = False
    env: dict[str, str] = field(default_factory=dict)


def _property(req: Request, prop: str) -> None:
    key, sep, value = prop.partition("=")
    if not sep:
        raise Refused(f"Not an assignment: {prop}")
    if key == "Type":
        if value != "forking":  # the only start protocol the launcher uses
            raise Refused(f"Type={value}: this stand-in knows Type=forking only")
    elif key == "BindPaths":
        # systemd.exec(5): "src[:dst[:options]]", "-src" ignored when src is missing.
        for item in value.split():
            src, _, rest = item.partition(":")
            dst, _, opts = rest.partition(":")
            if opts not in ("", "rbind"):
                raise Refused(f"BindPaths= option {opts}: this stand-in binds recursively only")
            optional = src.startswith("-")
            src = src.removeprefix("-")
            if not src.startswith("/") or (dst and not dst.startswith("/")):
                raise Refused(f"Failed to parse BindPaths= value: {value}")
            if optional and not os.path.exists(src):
                continue
            req.binds.append((src, dst or src))
    elif key == "RootDirectory":
        if not value.startswith("/"):
            raise Refused(f"Failed to parse RootDirectory= value: {value}")
        req.root = value
    elif key == "MountAPIVFS":
        if value not in ("yes", "no", "true", "false", "1", "0"):
            raise Refused(f"Failed to parse boolean argument to MountAPIVFS=: {value}")
        req.api_vfs = value in ("yes", "true", "1")
    else:
        raise Refused(f"Unknown assignment: {prop}")


def parse(argv: Sequence[str], caller_env: Mapping[str, str]) -> Request:
    """systemd-run's command line, the options HostSystemdLauncher uses; option parsing stops
    at `--` or the first non-option (systemd-run's getopt string starts with "+")."""
    req = Request(unit="", command=[])
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg == "--":
            break
        if not arg.startswith("-"):
            args.insert(0, arg)
            break
        name, sep, value = arg.partition("=")
        if name in ("--unit", "-u", "--property", "-p", "--setenv", "-E") and not sep:
            if not args:
                raise Refused(f"option requires an argument -- '{name.lstrip('-')}'")
            value = args.pop(0)
        if name in ("--unit", "-u"):
            req.unit = value
        elif name in ("--property", "-p"):
            _property(req, value)
        elif name in ("--setenv", "-E"):
            key, has, val = value.partition("=")
            # systemd-run(1): NAME alone takes the value from systemd-run's own environment.
            req.env[key] = val if has else caller_env.get(key, "")
        elif arg == "--collect":
            req.collect = True
        elif arg in ("--quiet", "-q"):
            req.quiet = True
        else:
            raise Refused(f"unrecognized option '{arg}' (this stand-in knows the launcher's only)")
    req.command = args
    if not req.command:
        raise Refused("Command line to execute required.")
    # systemd-run(1): a name without a type suffix gets ".service"; none given: run-u<id>.
    req.unit = req.unit or f"run-u{secrets.randbelow(10**6)}"
    if "." not in req.unit:
        req.unit += ".service"
    if not req.unit.endswith(".service"):
        raise Refused(f"Unit name {req.unit} is not a service (this stand-in runs services)")
    return req


def hierarchies() -> list[Path]:
    """Every cgroup hierarchy mounted here (v1 controllers, named ones, the v2 tree)."""
    given = os.environ.get("SYSTEMD_RUN_SIM_CGROUP_MOUNTS")
    if given is not None:
        return [Path(p) for p in given.split(":") if p]
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            fstype = fields[fields.index("-") + 1]
            if fstype in ("cgroup", "cgroup2"):
                out.append(Path(fields[4]))
    return out


def unit_cgroups(unit: str) -> list[Path]:
    root = os.environ.get("SYSTEMD_RUN_SIM_CGROUP_ROOT", "/").strip("/")
    rel = Path(root, SLICE, unit) if root else Path(SLICE, unit)
    return [h / rel for h in hierarchies()]


def _running(pid: int) -> bool:
    """Alive and not a zombie: an exited task leaves its cgroup at exit (kernel cgroup_exit)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _procs(cgroup: Path) -> list[int]:
    """The live processes in `cgroup` (filtered: a fake hierarchy in tests keeps stale pids)."""
    try:
        text = (cgroup / "cgroup.procs").read_text()
    except OSError:
        return []
    return [p for p in (int(x) for x in text.split()) if _running(p)]


def active(unit: str) -> bool:
    return any(_procs(c) for c in unit_cgroups(unit))


def collect(unit: str) -> None:
    """An inactive unit's cgroups go (systemd removes them when the unit stops)."""
    for cgroup in unit_cgroups(unit):
        if cgroup.is_dir() and not _procs(cgroup):
            # a fake hierarchy (tests) holds files; a real one is empty by now
            with contextlib.suppress(OSError):
                cgroup.rmdir()


def _make_cgroup(cgroup: Path) -> None:
    """mkdir -p, with a v1 cpuset's cpus and mems copied down: a new v1 cpuset cgroup starts
    with none and refuses every task (kernel Documentation/admin-guide/cgroup-v1/cpusets.rst)."""
    missing = []
    path = cgroup
    while not path.exists():
        missing.append(path)
        path = path.parent
    for path in reversed(missing):
        path.mkdir()
        for name in ("cpuset.cpus", "cpuset.mems"):
            mine, parent = path / name, path.parent / name
            if mine.exists() and parent.exists() and not mine.read_text().strip():
                mine.write_text(parent.read_text())


def _mount(libc: ctypes.CDLL, src: str | None, dst: str, fstype: str | None, flags: int) -> None:
    def enc(s: str | None) -> bytes | None:
        return None if s is None else s.encode()

    if libc.mount(enc(src), enc(dst), enc(fstype), flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {src} on {dst}: {os.strerror(err)}")


def _namespace(req: Request) -> None:
    """The unit's private mounts: systemd.exec(5) BindPaths=, RootDirectory=, MountAPIVFS=."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNS): {os.strerror(err)}")
    _mount(libc, None, "/", None, MS_REC | MS_SLAVE)
    root = req.root or "/"
    if req.api_vfs and req.root:
        for api in ("/proc", "/sys", "/dev"):
            target = os.path.join(root, api.lstrip("/"))
            if not os.path.ismount(target):
                os.makedirs(target, exist_ok=True)
                _mount(libc, api, target, None, MS_BIND | MS_REC)
    for src, dst in req.binds:
        target = os.path.join(root, dst.lstrip("/"))
        os.makedirs(target, exist_ok=True)  # "systemd must be able to create it"
        _mount(libc, src, target, None, MS_BIND | MS_REC)
    if req.root:
        os.chroot(req.root)
        os.chdir("/")


def _child(req: Request, binary: str, cgroups: Sequence[Path], journal: Path) -> None:
    """In the forked child: what systemd's exec_child does before exec. Never returns."""
    code = 0
    try:
        os.setsid()
        code = 219  # systemd's EXIT_CGROUP
        for cgroup in cgroups:
            (cgroup / "cgroup.procs").write_text(f"{os.getpid()}\n")
        code = 209  # EXIT_STDOUT
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(null)
        os.close(out)
        if req.binds or req.root or req.api_vfs:
            code = 226  # EXIT_NAMESPACE
            _namespace(req)
        code = 200  # EXIT_CHDIR: systemd.exec(5) WorkingDirectory=, "/" for the system manager
        os.chdir("/")
        env = {"PATH": SYSTEMD_PATH, "INVOCATION_ID": secrets.token_hex(16)}
        env["SYSTEMD_EXEC_PID"] = str(os.getpid())
        env.update(req.env)
        code = 203  # EXIT_EXEC
        os.execve(binary, req.command, env)
    except BaseException as exc:  # the child must never return into the caller
        try:
            os.write(2, f"{req.unit}: {exc}\n".encode())
        finally:
            os._exit(code or EXIT_FAILURE)


def run(req: Request, caller_env: Mapping[str, str]) -> int:
    state = Path(os.environ.get("SYSTEMD_RUN_SIM_STATE", "/run/systemd-run-sim"))
    state.mkdir(parents=True, exist_ok=True)
    failed = state / f"{req.unit}.failed"
    if active(req.unit) or failed.exists():
        raise Refused(EXISTS.format(req.unit))
    collect(req.unit)
    binary = req.command[0]
    if req.root is None:
        # src/run/run.c: the command is looked up in systemd-run's own $PATH, to fail early.
        found = shutil.which(binary, path=caller_env.get("PATH", SYSTEMD_PATH))
        if found is None:
            raise Refused(f"Failed to find executable {binary}: No such file or directory")
        binary = found
    cgroups = unit_cgroups(req.unit)
    for cgroup in cgroups:
        _make_cgroup(cgroup)
    journal = state / f"{req.unit}.journal"
    pid = os.fork()
    if pid == 0:
        _child(req, binary, cgroups, journal)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 0:
        if not req.quiet:
            print(f"Running as unit: {req.unit}", file=sys.stderr)
        return 0
    collect(req.unit)
    if not req.collect:  # systemd keeps a failed unit loaded until reset-failed
        failed.touch()
    if not req.quiet:
        print(
            f"Job for {req.unit} failed because the control process exited with error code.\n"
            f'See "systemctl status {req.unit}" and "journalctl -xeu {req.unit}" for details.',
            file=sys.stderr,
        )
    return EXIT_FAILURE


def main(argv: Sequence[str]) -> int:
    caller_env = dict(os.environ)
    try:
        return run(parse(argv, caller_env), caller_env)
    except Refused as exc:
        print(exc, file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
