"""A simulated MPS client: a CUDA process as the daemon sees it, run with a container's view.

`python -m deviceplugin.simulate.mps_client [--hold SECONDS]` reads only its environment and
its own filesystem, like a CUDA process in a pod: it finds the control socket under its
`CUDA_MPS_PIPE_DIRECTORY`, checks the daemon serves that same path string, finds the
daemon's marker in its own `/dev/shm`, then connects as a client (refused with 807 while the
server is in FAULT). Any miss exits non-zero naming it: stricter than CUDA, which silently
runs without MPS. Run it as a container would be with `simulate/pod.py`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from deviceplugin.simulate import mps_control

DEFAULT_PIPE = "/tmp/nvidia-mps"  # CUDA's default when the variable is unset
SHM = Path("/dev/shm")
OK = "mps client ok"
# Exit codes: each names the part of the wiring that is missing.
NO_DAEMON, WRONG_PIPE, NO_SHM, SERVER_NOT_READY = 2, 3, 4, 5


def _fail(code: int, message: str) -> int:
    print(f"mps client: {message}", file=sys.stderr)
    return code


def run(hold: float = 0.0) -> int:
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE)
    try:
        hello = mps_control.send(Path(pipe), "simulate_client_hello")
    except OSError as exc:
        return _fail(NO_DAEMON, f"no MPS control daemon at {pipe}/control: {exc}")
    fields = dict(part.partition("=")[::2] for part in hello.split())
    if fields.get("pipe") != pipe:
        return _fail(
            WRONG_PIPE,
            f"daemon serves pipe directory {fields.get('pipe')!r}, this client has {pipe!r}",
        )
    marker = SHM / fields.get("shm", "")
    try:
        seen = marker.read_text() if fields.get("shm") else ""
    except OSError:
        seen = ""
    if not seen or seen != fields.get("token"):
        return _fail(NO_SHM, f"daemon's shared memory {marker} not visible in this /dev/shm")
    pid = os.getpid()
    answer = mps_control.connect_client(Path(pipe), pid, os.getuid())
    if answer:
        return _fail(SERVER_NOT_READY, f"server not ready ({answer})")
    try:
        print(OK, flush=True)
        time.sleep(hold)
    finally:
        mps_control.disconnect_client(Path(pipe), pid)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mps_client")
    parser.add_argument("--hold", type=float, default=0.0, help="seconds to stay connected")
    args = parser.parse_args(argv)
    return run(args.hold)


if __name__ == "__main__":
    sys.exit(main())
