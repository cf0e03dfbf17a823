"""The MPS gate both front-ends hold: may a GPU's clients start now, and is memory capped.

Allocate and NodePrepareResources ask it before they answer for an sm-sharing GPU;
`MpsSupervisor` is the implementation, tests pass their own.
"""

from __future__ import annotations

from typing import Protocol

from deviceplugin.model import GpuUuid


class MpsGate(Protocol):
    def ensure(self, gpu: GpuUuid) -> bool:
        """Non-blocking: True when the GPU's daemon is up and verified, else start it."""
        ...

    def wait_ready(self, gpu: GpuUuid, timeout: float) -> bool:
        """Block until the daemon is ready or `timeout` seconds pass."""
        ...

    def memory_accounting(self, gpu: GpuUuid) -> bool:
        """The daemon runs with per-client memory accounting, confirmed by readback."""
        ...
