"""Entry point of the simulated pilot: `python hack/pilot/run.py [--out DIR] [--seed N]`.

Runs every scenario (about ten seconds on two cores) and writes `report.md` and the plots,
by default into `docs/pilot/`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HACK = Path(__file__).resolve().parent.parent
if str(HACK) not in sys.path:
    sys.path.insert(0, str(HACK))  # so `pilot.*` imports work when run as a script

from pilot.report import write_report  # noqa: E402
from pilot.scenarios import run_pilot  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HACK.parent / "docs" / "pilot")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    run = run_pilot(seed=args.seed)
    command = "python hack/pilot/run.py" + (f" --seed {args.seed}" if args.seed != 7 else "")
    for path in write_report(run, args.out, command):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
