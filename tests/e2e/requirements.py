"""What the runtime end-to-end suite needs, checked in one place: root, podman, runc, the
util-linux namespace tools and Debian's static busybox (the image is built from it).

`python -m tests.e2e.requirements` prints why the suite cannot run and exits 1, or exits 0
silently; the Makefile and the suite's own skip use it.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

BUSYBOX = Path("/bin/busybox")  # Debian's busybox-static installs it here
PACKAGES = ("podman", "runc", "busybox-static")


def missing() -> str | None:
    """Why the suite cannot run here, or None."""
    if sys.platform != "linux":
        return "needs Linux"
    if os.geteuid() != 0:
        return "needs root (mount namespaces, device nodes, rootful podman)"
    absent = [tool for tool in ("podman", "runc", "unshare", "nsenter") if not shutil.which(tool)]
    if not BUSYBOX.is_file():
        absent.append(str(BUSYBOX))
    elif b"ld-linux" in BUSYBOX.read_bytes()[:4096]:  # the image has no libc
        absent.append(f"a static {BUSYBOX} (this one is dynamically linked)")
    if absent:
        return f"{', '.join(absent)} not found; `make e2e-deps` installs {' '.join(PACKAGES)}"
    return None


if __name__ == "__main__":
    why = missing()
    if why is not None:
        print(why)
    sys.exit(0 if why is None else 1)
