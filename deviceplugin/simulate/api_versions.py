"""The resource versions every part of the stand-in API server shares, and their lock.

One counter over pods, nodes and `resource.k8s.io` objects, as etcd's revision is one
counter over every key, and one condition that guards the stores and wakes their watches.
The core server (apiserver.py) and its DRA part (dra_apiserver.py) both hold it.
"""

from __future__ import annotations

import threading


class Versions:
    def __init__(self, start: int = 100) -> None:
        self.cond = threading.Condition()
        self.rv = start  # the last resourceVersion handed out

    def bump(self) -> int:
        """The next resourceVersion; call with `cond` held."""
        self.rv += 1
        return self.rv
