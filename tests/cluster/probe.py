"""What a container sees, printed to its log by busybox and read back by the tests."""

from __future__ import annotations

from dataclasses import dataclass

# Sections: the env, the /dev/nvidia* nodes (name major minor), mount points, the MPS pipe
# directory's listing; then the container stays up.
SCRIPT = r"""
echo '--- env'; env
echo '--- nodes'; for n in /dev/nvidia*; do [ -e "$n" ] && stat -c '%n %t %T' "$n"; done
echo '--- mounts'; awk '{print $5}' /proc/self/mountinfo
echo '--- pipe'; [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] && ls -a "$CUDA_MPS_PIPE_DIRECTORY"
echo '--- end'
exec sleep 3600
"""


@dataclass
class Seen:
    log: str

    def section(self, name: str) -> list[str]:
        lines, on = [], False
        for line in self.log.splitlines():
            if line.startswith("--- "):
                on = line == f"--- {name}"
                continue
            if on:
                lines.append(line)
        return lines

    @property
    def complete(self) -> bool:
        return "--- end" in self.log

    @property
    def env(self) -> dict[str, str]:
        return dict(line.split("=", 1) for line in self.section("env") if "=" in line)

    @property
    def nodes(self) -> dict[str, tuple[int, int]]:
        out = {}
        for line in self.section("nodes"):
            name, major, minor = line.split()
            out[name] = (int(major, 16), int(minor, 16))
        return out

    @property
    def mounts(self) -> set[str]:
        return set(self.section("mounts"))
