"""Run `dlmaster` under cProfile, for bench/fleet.py's `--profile`: every
SIGUSR1 writes what the master's event loop (its main thread) did since the
previous one to `<prefix>.<k>.prof`, so that each phase of a level (formation,
steady state, loss) gets a profile of its own.

    python bench/_profiled.py PREFIX dlmaster-arguments...
"""

from __future__ import annotations

import cProfile
import signal
import sys
from types import FrameType

from dlfleet.master.__main__ import main as dlmaster


class Phases:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.count = 0
        self.profile = cProfile.Profile()

    def cut(self, signum: int = 0, frame: FrameType | None = None) -> None:
        self.profile.disable()
        self.profile.dump_stats(f"{self.prefix}.{self.count}.prof")
        self.count += 1
        self.profile = cProfile.Profile()
        self.profile.enable()


def run(argv: list[str]) -> int:
    phases = Phases(argv[0])
    signal.signal(signal.SIGUSR1, phases.cut)
    phases.profile.enable()
    try:
        return dlmaster(argv[1:])
    finally:
        phases.profile.disable()


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
