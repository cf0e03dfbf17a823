"""Command line: the sole exit point (0 clean stop, 1 runtime failure, 2 bad config or usage).

Over 400 lines on purpose: every subcommand's parser and handler stand side by side, so the
exit codes are decided in one module; the work each one does lives in the packages below.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from deviceplugin import __version__
from deviceplugin.flags import RUN_FLAGS, Flag, pod_resources_default, resolve
from deviceplugin.plumbing import logs

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    pass


def _add_flag(parser: argparse.ArgumentParser, flag: Flag) -> None:
    shown = flag.default if flag.default is not None else "none"
    extra = f", {flag.extra_env}" if flag.extra_env else ""
    parser.add_argument(
        flag.name,
        dest=flag.dest,
        default=None,
        help=f"{flag.help} (default: {shown}; env {flag.env}{extra})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpu-fraction-plugin",
        description="Kubernetes device plugin sharing NVIDIA GPUs as memory slices.",
    )
    # What an image or a node runs: `gpu-fraction-plugin --version` needs no config or GPU.
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="the node agent")
    for flag in RUN_FLAGS:
        _add_flag(run, flag)

    check = sub.add_parser("check-config", help="validate a config file (exit 0, or 2)")
    check.add_argument("file")
    check.add_argument("--simulate", metavar="SPEC", help="also check against a simulated node")

    inv = sub.add_parser("inventory", help="GPUs, modes, slices and enforcement")
    inv.add_argument("--simulate", metavar="SPEC")
    inv.add_argument("--config", metavar="FILE")
    inv.add_argument("--sysfs-root", default="/sys")
    inv.add_argument("--host-root", default=None, help="as for run (default /)")
    inv.add_argument("--json", action="store_true")
    inv.add_argument(
        "--state-dir", default=None, help="a running plugin's --state-dir: show its DRA state"
    )
    inv.add_argument("--node-name", default=None, help="as for run (env NODE_NAME)")

    health = sub.add_parser("health", help="current health per GPU and fault domain")
    health.add_argument(
        "--state-dir", default=None, help="as for run (default /var/lib/gpu-fraction)"
    )
    health.add_argument("--json", action="store_true")
    health_sub = health.add_subparsers(dest="health_command", metavar="clear")
    clear = health_sub.add_parser("clear", help="operator clear for a fault NVML cannot clear")
    clear.add_argument("--gpu", required=True, metavar="UUID")
    clear.add_argument("--state-dir", default=None, dest="clear_state_dir")

    mps = sub.add_parser("mps", help="MPS control daemons")
    mps_sub = mps.add_subparsers(dest="mps_command", required=True, metavar="stop")
    stop = mps_sub.add_parser("stop", help="quit daemons and restore compute mode DEFAULT")
    target = stop.add_mutually_exclusive_group(required=True)
    target.add_argument("--gpu", metavar="UUID", action="append", help="this GPU (repeatable)")
    target.add_argument("--all", action="store_true", help="every GPU under --mps-root")
    stop.add_argument("--force", action="store_true", help="quit even with clients attached")
    stop.add_argument("--mps-root", default=None, help="as for run (env GPU_FRACTION_MPS_ROOT)")
    stop.add_argument("--state-dir", default=None, help="as for run (env GPU_FRACTION_STATE_DIR)")
    stop.add_argument("--simulate", metavar="SPEC", help="the simulated node `run` used")
    stop.add_argument("--config", metavar="FILE", help="the config `run` used")

    sim = sub.add_parser("simulate", help="fault injection into a running `run --simulate`")
    sim_sub = sim.add_subparsers(dest="sim_command", required=True, metavar="inject")
    inject = sim_sub.add_parser("inject", help="inject a fault or a recovery")
    inject.add_argument("--state-dir", required=True)
    inject.add_argument("--gpu", required=True, metavar="UUID|INDEX")
    what = inject.add_mutually_exclusive_group(required=True)
    what.add_argument("--xid", type=int)
    what.add_argument("--lost", action="store_true")
    what.add_argument("--recover", action="store_true")
    what.add_argument("--mps-fault", action="store_true")

    demo = sub.add_parser("demo", help="the whole story on simulated GPUs, no cluster needed")
    demo.add_argument("--json", action="store_true")
    demo.add_argument(
        "--examples", default=None, help="example manifests (default: the source tree's)"
    )
    return parser


def _flag_value(args: argparse.Namespace, dest: str, env: Mapping[str, str]) -> str | None:
    flag = next(f for f in RUN_FLAGS if f.dest == dest)
    return resolve(flag, getattr(args, dest, None), env)


def _default(dest: str, env: Mapping[str, str], given: str | None = None) -> str:
    value = _flag_value(argparse.Namespace(**{dest: given}), dest, env)
    assert value is not None
    return value


def cmd_run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from deviceplugin.daemon.lifecycle import Daemon
    from deviceplugin.daemon.startup import Platform, RunOptions

    values = {f.dest: _flag_value(args, f.dest, env) for f in RUN_FLAGS}
    if values["dra_instance"]:
        from deviceplugin.dra.plugin import dra_socket

        try:  # it goes into socket names: refuse at once, not when DRA starts
            dra_socket(Path("."), instance=values["dra_instance"])
        except ValueError as exc:
            print(f"--dra-instance: {exc}", file=sys.stderr)
            return EXIT_USAGE
    kubelet_dir = values["kubelet_dir"] or ""
    opts = RunOptions(
        config_path=Path(values["config"]) if values["config"] else None,
        kubelet_dir=Path(kubelet_dir),
        pod_resources_socket=Path(
            values["pod_resources_socket"] or pod_resources_default(kubelet_dir)
        ),
        state_dir=Path(values["state_dir"] or ""),
        mps_root=Path(values["mps_root"] or ""),
        cdi_dir=Path(values["cdi_dir"] or ""),
        sysfs_root=Path(values["sysfs_root"] or "/sys"),
        node_name=values["node_name"],
        metrics_address=values["metrics_address"] or ":9447",
        environ=dict(env),
        host_root=Path(values["host_root"] or "/"),
        kubelet_plugins_dir=Path(values["kubelet_plugins_dir"] or ""),
        kubelet_registry_dir=Path(values["kubelet_registry_dir"] or ""),
        dra_instance=values["dra_instance"] or None,
    )
    platform: Platform | None = None
    if values["simulate"]:
        from deviceplugin.simulate.node import simulated_platform
        from deviceplugin.simulate.specs import load_spec

        spec = load_spec(values["simulate"])
        platform = simulated_platform(spec, opts.state_dir, opts.cdi_dir, opts.mps_root)
    return asyncio.run(Daemon(opts, platform).run())


def _inventory_and_plan(
    simulate: str | None,
    config_path: str | None,
    sysfs_root: str,
    state_dir: Path | None,
    host_root: str = "/",
) -> tuple[Any, Any, Any]:
    import tempfile

    from deviceplugin.cdi import generated
    from deviceplugin.cdi.registry import driver_devices
    from deviceplugin.config.settings import Config, load
    from deviceplugin.daemon.startup import with_driver_devices
    from deviceplugin.inventory.gpus import read_inventory
    from deviceplugin.inventory.nvml import NvmlSession
    from deviceplugin.plan import build_plan, skip_gpus

    config = load(Path(config_path)) if config_path else Config()
    facts = None
    spec_dirs = [Path(d) for d in config.cdi.spec_dirs]
    ctk: str | None = None
    with tempfile.TemporaryDirectory(prefix="gf-sysfs-") as scratch:
        sysfs = Path(sysfs_root)
        if simulate:
            from deviceplugin.simulate.cdi import write_driver_cdi_spec
            from deviceplugin.simulate.node import simulated_node_facts
            from deviceplugin.simulate.nvml import FakeNvml
            from deviceplugin.simulate.specs import load_spec

            spec = load_spec(simulate)
            FakeNvml(spec, state_dir).install()
            facts = simulated_node_facts(spec, Path(scratch))
            ctk = str(Path(scratch) / ("nvidia-ctk" if spec.nvidia_ctk else "absent"))
            sysfs = spec.write_sysfs(Path(scratch))  # the simulated node's sysfs, not ours
            # the simulated node's driver CDI spec, in its own scratch directory
            spec_dirs = [Path(scratch) / "cdi"]
            write_driver_cdi_spec(spec, spec_dirs[0], config.cdi.driver_kind)
        session = NvmlSession.open()
        try:
            inventory = read_inventory(
                session, sysfs, config.cdi.nvidia_ctk_path, facts, Path(host_root)
            )
        finally:
            session.shutdown()
        known = driver_devices(spec_dirs, config.cdi.driver_kind)
        plan = build_plan(inventory, config)
        # What the agent would generate where the toolkit's spec lacks a GPU (GPU Operator
        # nodes), into scratch: the running agent's own spec is left alone.
        in_container = not simulate and Path(host_root) != Path("/")
        generator = generated.DriverSpecGenerator(
            Path(scratch), generated.HOST_PREFIX if in_container else (), ctk
        )
        plan, missing = with_driver_devices(plan, config, known, inventory, generator)
    return config, inventory, skip_gpus(plan, missing)


def cmd_inventory(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from deviceplugin.plan import cuda_limit_failures
    from deviceplugin.report import format_inventory_table, inventory_report

    config, inventory, plan = _inventory_and_plan(
        args.simulate,
        args.config,
        args.sysfs_root,
        None,
        _default("host_root", env, args.host_root),
    )
    unmet = cuda_limit_failures(inventory.node, config, inventory.node.nvidia_ctk_present)
    report = inventory_report(
        inventory, plan, dra=_dra_report(plan, args, env), cuda_limits_unmet=unmet
    )
    note = _mps_shm_note(plan, bool(args.simulate))
    if note:
        report["mps_shm"] = note
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print(format_inventory_table(report))
        if note:
            print(f"MPS /dev/shm: {note}")
    return EXIT_OK


def _dra_report(plan: Any, args: argparse.Namespace, env: Mapping[str, str]) -> Any:
    """Whether the plan's DRA GPUs are (or can be) served; None without DRA GPUs."""
    if not plan.dra_gpus:
        return None
    from deviceplugin.dra.frontend import read_status, unavailable_reason

    gpus = [gp.gpu.index for gp in plan.dra_gpus]
    reason = unavailable_reason(_default_or_none("node_name", env, args.node_name), env)
    if reason is not None:
        return {"served": False, "reason": reason, "gpus": gpus}
    state = read_status(Path(args.state_dir)) if args.state_dir else None
    return {"gpus": gpus, **state} if state else {"served": None, "reason": None, "gpus": gpus}


def _default_or_none(dest: str, env: Mapping[str, str], given: str | None) -> str | None:
    return _flag_value(argparse.Namespace(**{dest: given}), dest, env)


def _mps_shm_note(plan: Any, simulated: bool) -> str | None:
    """What the sm-sharing daemons' and clients' /dev/shm will be (DESIGN 3b)."""
    from deviceplugin.model import Mode
    from deviceplugin.mps.shm import ShmState, may_mount

    if not any(gp.mode is Mode.SM_SHARING and gp.advertised for gp in plan.gpus):
        return None
    if not simulated:
        return "a tmpfs of mps.shmSize per GPU at <mps-root>/<uuid>/shm, mounted by `run`"
    if may_mount():
        return f"{ShmState.DIRECTORY.value}: <mps-root>/<uuid>/shm bound at the daemon's /dev/shm"
    return (
        f"{ShmState.HOST.value}: simulation without mount rights, the daemons keep the host "
        "/dev/shm (clients in containers would not reach them)"
    )


def cmd_check_config(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from deviceplugin.config.settings import ConfigError, load
    from deviceplugin.plan import validate_against

    try:
        config = load(Path(args.file))
        if args.simulate:
            _c, inventory, _p = _inventory_and_plan(args.simulate, args.file, "/sys", None)
            errors, warnings = validate_against(config, inventory)
            for warning in warnings:
                print(f"warning: {warning}", file=sys.stderr)
            if errors:
                raise ConfigError(errors)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"{args.file}: {problem}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{args.file}: ok")
    return EXIT_OK


def cmd_health(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from deviceplugin.health.state import format_health_table, read_health, request_clear

    given = getattr(args, "clear_state_dir", None) or args.state_dir
    state_dir = Path(_default("state_dir", env, given))
    if args.health_command == "clear":
        request_clear(state_dir, args.gpu)
        print(f"clear requested for {args.gpu}; the running plugin applies it")
        return EXIT_OK
    data = read_health(state_dir)
    print(json.dumps(data, indent=2, sort_keys=True) if args.json else format_health_table(data))
    return EXIT_OK


def cmd_mps_stop(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from deviceplugin.config.settings import Config, load, with_control_binary
    from deviceplugin.health.board import HealthBoard
    from deviceplugin.inventory.nvml import NvmlSession
    from deviceplugin.model import GpuUuid
    from deviceplugin.mps.supervisor import MpsSupervisor

    config = load(Path(args.config)) if args.config else Config()
    mps_root = Path(_default("mps_root", env, args.mps_root))
    state_dir = Path(_default("state_dir", env, args.state_dir))
    if args.simulate:
        from deviceplugin.simulate.mps_control import write_launcher
        from deviceplugin.simulate.nvml import FakeNvml
        from deviceplugin.simulate.specs import load_spec

        FakeNvml(load_spec(args.simulate), state_dir).install()
        sim_dir = state_dir / "simulate"
        sim_dir.mkdir(parents=True, exist_ok=True)
        launcher = write_launcher(sim_dir / "nvidia-cuda-mps-control")
        config = with_control_binary(config, str(launcher))
    session = NvmlSession.open()
    try:
        supervisor = MpsSupervisor(
            mps_root,
            lambda: config,
            HealthBoard(),
            session if config.mps.set_compute_mode else None,
        )
        gpus = None if args.all else [GpuUuid(g) for g in args.gpu]
        results = supervisor.stop_daemons(gpus, force=args.force)
    finally:
        session.shutdown()
    for gpu, outcome in sorted(results.items()):
        print(f"{gpu}: {outcome}")
    failed = any(outcome.startswith("error") for outcome in results.values())
    return EXIT_RUNTIME if failed else EXIT_OK


def cmd_simulate_inject(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from deviceplugin.simulate.inject import inject

    if args.xid is not None:
        action, xid = "xid", args.xid
    else:
        action = "lost" if args.lost else "recover" if args.recover else "mps-fault"
        xid = None
    result = inject(Path(args.state_dir), args.gpu, action, xid)
    print(json.dumps(result, sort_keys=True))
    return EXIT_OK


def cmd_demo(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from deviceplugin.demo import run_demo

    return run_demo(as_json=args.json, examples=Path(args.examples) if args.examples else None)


COMMANDS = {
    "run": cmd_run,
    "inventory": cmd_inventory,
    "check-config": cmd_check_config,
    "health": cmd_health,
    "simulate": cmd_simulate_inject,
    "demo": cmd_demo,
}


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    env = os.environ if environ is None else environ
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # grpc core's own chatter off stderr
    logs.setup()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors and 0 on --help
        return int(exc.code or 0)
    handler = cmd_mps_stop if args.command == "mps" else COMMANDS[args.command]
    return _guarded(handler, args, env)


def _expected_errors() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(usage errors: exit 2, runtime failures: exit 1) that print one line, no traceback."""
    from deviceplugin.daemon.startup import StartupError
    from deviceplugin.dpapi.server import SocketPathTooLong
    from deviceplugin.health.state import HealthStateError
    from deviceplugin.inventory.gpus import InventoryError
    from deviceplugin.inventory.nvml import NvmlError
    from deviceplugin.metrics.server import MetricsAddressError
    from deviceplugin.mps.control import ControlError
    from deviceplugin.mps.launch import LaunchError
    from deviceplugin.mps.layout import LayoutError
    from deviceplugin.simulate.inject import InjectError
    from deviceplugin.simulate.specs import SpecError

    usage = (SpecError, MetricsAddressError, UsageError)
    runtime = (
        StartupError, HealthStateError, InventoryError, ControlError, LaunchError, LayoutError,
        NvmlError, SocketPathTooLong, InjectError, OSError,
    )  # fmt: skip
    return usage, runtime


def _guarded(handler: Any, args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from deviceplugin.config.settings import ConfigError

    usage, runtime = _expected_errors()
    try:
        code: int = handler(args, env)
        return code
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"config: {problem}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_OK
    except usage as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    except runtime as exc:  # expected failures: one line that says what and where
        print(f"{exc}", file=sys.stderr)
        return EXIT_RUNTIME
