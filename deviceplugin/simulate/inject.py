"""Fault injection into a running `run --simulate`, through its state directory only.

The client (`inject`) drops a JSON request atomically into `<state-dir>/simulate/inject/`
and waits for its result file; the running plugin's `InjectionListener` watches that
directory with inotify (watchdog), applies requests in name order to the fake NVML and the
MPS hooks, writes `<name>.result` and deletes the request. No other flag is needed.
A result's `at` is CLOCK_MONOTONIC (one clock for every process of the host) just before
the fault entered the fake NVML: when the fault happened, as the plugin could first know it.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from deviceplugin.model import GpuUuid
from deviceplugin.plumbing import fsutil, logs
from deviceplugin.simulate.nvml import FakeNvml, XidClass

_log = logs.get("simulate.inject")

ACTIONS = ("xid", "lost", "recover", "mps-fault")
_POLL = 0.005  # seconds between the client's looks for its result


class InjectError(Exception):
    """The injection was refused, or no running simulated plugin picked it up."""


def inject_dir(state_dir: Path) -> Path:
    return state_dir / "simulate" / "inject"


def inject(
    state_dir: Path, gpu: str, action: str, xid: int | None = None, timeout: float = 2.0
) -> dict[str, Any]:
    """Ask the plugin running with `state_dir` to apply one fault; returns its result.

    `gpu` is an index or a UUID. Raises InjectError with a clear message when the request is
    malformed, refused, or not consumed within `timeout` seconds.
    """
    if action not in ACTIONS:
        raise InjectError(f"unknown action {action!r} (one of {', '.join(ACTIONS)})")
    if (action == "xid") != (xid is not None):
        raise InjectError("--xid N goes with the xid action only")
    directory = inject_dir(state_dir)
    if not directory.is_dir():
        raise InjectError(
            f"no simulated plugin uses state dir {state_dir} (missing {directory}); "
            "start `gpu-fraction-plugin run --simulate SPEC --state-dir DIR` first"
        )
    name = f"{time.time_ns():020d}-{os.getpid()}-{secrets.token_hex(4)}"
    request = directory / f"{name}.json"
    result = directory / f"{name}.result"
    body = {"gpu": str(gpu), "action": action, "xid": xid}
    fsutil.atomic_write(request, json.dumps(body).encode(), 0o600)
    answer = _wait_for(result, timeout)
    if answer is None and not fsutil.remove(request):
        # Taken but not answered yet: the plugin is applying it; allow it a moment more.
        answer = _wait_for(result, 1.0)
    if answer is None:
        fsutil.remove(request)
        raise InjectError(
            f"no running `run --simulate` with state dir {state_dir} took the request "
            f"within {timeout:g}s"
        )
    if not answer.get("ok"):
        raise InjectError(str(answer.get("error", "refused")))
    return answer


def _wait_for(result: Path, timeout: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            text = result.read_text()
        except FileNotFoundError:
            time.sleep(_POLL)
            continue
        fsutil.remove(result)
        answer: dict[str, Any] = json.loads(text)
        return answer
    return None


class _Handler(FileSystemEventHandler):
    def __init__(self, drain: Callable[[], None]) -> None:
        self._drain = drain

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in ("created", "moved", "modified", "closed"):
            self._drain()


class InjectionListener:
    """Applies injection requests found under the state dir to a running simulation.

    Application Xids and `mps-fault` call `on_mps_fault(uuid)`; `recover` also calls
    `on_recover(uuid)`. `start()` applies requests already waiting; `stop()` is idempotent.
    """

    def __init__(
        self,
        state_dir: Path,
        fake_nvml: FakeNvml,
        on_mps_fault: Callable[[GpuUuid], None] | None = None,
        on_recover: Callable[[GpuUuid], None] | None = None,
    ) -> None:
        self._dir = inject_dir(state_dir)
        self._fake = fake_nvml
        self._on_mps_fault = on_mps_fault
        self._on_recover = on_recover
        self._lock = threading.Lock()
        self._observer: Any = None
        self.applied = 0  # requests applied so far, for tests and logs

    def start(self) -> None:
        if self._observer is not None:
            return
        self._dir.mkdir(parents=True, exist_ok=True)
        for stale in self._dir.glob("*.result"):
            fsutil.remove(stale)  # answers nobody waited for
        observer = Observer()
        observer.schedule(_Handler(self._drain), str(self._dir), recursive=False)
        observer.daemon = True
        observer.start()
        self._observer = observer
        self._drain()
        logs.log(_log, "injection listener started", dir=self._dir)

    def stop(self) -> None:
        observer, self._observer = self._observer, None
        if observer is None:
            return
        observer.stop()
        observer.join(timeout=5)
        logs.log(_log, "injection listener stopped", dir=self._dir)

    def _drain(self) -> None:
        with self._lock:
            for request in sorted(self._dir.glob("*.json")):
                if request.name.startswith("."):
                    continue  # a temp file still being written
                try:
                    body = json.loads(request.read_text())
                except FileNotFoundError:
                    continue  # the client gave up and took it back
                except ValueError as err:
                    body = {"invalid": str(err)}
                answer = self._apply(body)
                result = request.with_suffix(".result")
                fsutil.atomic_write(result, json.dumps(answer).encode(), 0o600)
                fsutil.remove(request)

    def _apply(self, body: dict[str, Any]) -> dict[str, Any]:
        action = body.get("action")
        try:
            uuid = self._fake.resolve(str(body.get("gpu")))
        except KeyError as err:
            return {"ok": False, "error": str(err.args[0])}
        answer: dict[str, Any] = {"ok": True, "gpu": uuid, "action": action}
        answer["at"] = time.monotonic()  # the fault happens now: the harness's work is done
        try:
            if action == "xid":
                xid = int(body["xid"])
                cls = self._fake.inject_xid(uuid, xid, notify=False)
                answer.update(xid=xid, xidClass=str(cls))
                if cls is XidClass.APPLICATION:
                    self._mps_fault(uuid)
            elif action == "lost":
                self._fake.set_lost(uuid)
            elif action == "recover":
                self._fake.recover(uuid)
                if self._on_recover is not None:
                    self._on_recover(uuid)
            elif action == "mps-fault":
                if self._on_mps_fault is None:
                    return {"ok": False, "error": "this simulation runs no MPS to fault"}
                self._mps_fault(uuid)
            else:
                return {"ok": False, "error": f"unknown action {action!r}"}
        except Exception as err:  # a failing hook must not stop the listener
            logs.log(_log, "injection failed", gpu=uuid, action=action, error=err)
            return {"ok": False, "error": f"{action} on {uuid} failed: {err}"}
        self.applied += 1
        logs.log(_log, "fault injected", gpu=uuid, action=action, xid=body.get("xid"))
        return answer

    def _mps_fault(self, uuid: GpuUuid) -> None:
        if self._on_mps_fault is not None:
            self._on_mps_fault(uuid)
