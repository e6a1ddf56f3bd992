"""A clock a test moves by hand, for code that takes its time from an
injected `Callable[[], float]` (the node agent's `clock`)."""

from __future__ import annotations


class FakeClock:
    """Stands in for `time.monotonic`: the seconds stand still until the test
    moves them on (`advance`)."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds
