"""Which checkpoint a restore takes: the fallback ladder.

A restored image that is wrong is worse than none: the job trains from a
corrupt state, or fails again at the same step after every restore. So a
restore climbs down a ladder of places that may hold a step, and takes the
first one that verifies:

1. this node's own shared memory (`SHARED_MEMORY`),
2. the replica a peer node holds of it (`PEER_REPLICA`),
3. the newest persisted folder (`PERSISTED`),
4. older persisted folders (`OLDER_PERSISTED`).

Newer steps come first: a verified image of step 120 in a peer's replica wins
over the own copy of step 100 (both are in memory; the newer one loses less
work). Between places that hold the same step, the order above holds: the
nearer copy is the cheaper read. Every place passed over is said, with why
(missing, a checksum that does not match, a shape that is not the model's),
so a person reading the log knows what the restore fell back from.

A restart-loop breaker (a job failing at the same step after every restore)
asks for a step below the one that keeps failing: `below_step`.

The ladder is pure: it reads no file and no clock. The caller hands it the
candidates and a `verify` function that looks at one candidate's bytes; the
ladder calls `verify` in order and stops at the first that passes, so a
restore that finds its own image intact checks nothing else.

Lives in every training process (rank) that restores.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


class Rung(enum.Enum):
    """Where a candidate step is held, in the order a restore prefers them."""

    SHARED_MEMORY = "shared memory"
    PEER_REPLICA = "peer replica"
    PERSISTED = "persisted"
    OLDER_PERSISTED = "older persisted"

    @property
    def order(self) -> int:
        return _ORDER[self]


_ORDER = {rung: index for index, rung in enumerate(Rung)}


class Skip(enum.Enum):
    """Why a candidate was passed over."""

    MISSING = "missing"  # not there, or not whole (a rank's image absent)
    CHECKSUM = "checksum"  # its bytes do not match what was written
    SHAPE = "shape mismatch"  # it holds another model's tensors
    ABOVE_BREAKER = "at or above the failing step"  # the breaker asked for older


@dataclass(frozen=True)
class Candidate:
    """A step held somewhere: `where` names it for a person (a path, a
    peer's node id)."""

    rung: Rung
    step: int
    where: str


@dataclass(frozen=True)
class Verified:
    """The candidate's bytes match its checksums and its shapes the model's."""


@dataclass(frozen=True)
class Rejected:
    why: Skip
    detail: str = ""  # the file, the tensor, the numbers


Verification = Verified | Rejected


@dataclass(frozen=True)
class Passed:
    """A candidate the ladder passed over, and why."""

    candidate: Candidate
    why: Skip
    detail: str = ""

    def describe(self) -> str:
        where = f"{self.candidate.rung.value} step {self.candidate.step} ({self.candidate.where})"
        return f"{where}: {self.why.value}" + (f": {self.detail}" if self.detail else "")


@dataclass(frozen=True)
class Descent:
    """What the ladder chose (None: nothing verified, the job starts from
    step 0 or fails, as its caller decides) and what it passed over first."""

    chosen: Candidate | None
    passed: tuple[Passed, ...] = field(default=())

    def describe(self) -> str:
        """One line for the log: what the restore takes, after what."""
        chosen = self.chosen
        if chosen is None:
            head = "no checkpoint verifies"
        else:
            head = f"restoring step {chosen.step} from {chosen.rung.value} ({chosen.where})"
        if not self.passed:
            return head
        return head + "; passed over " + "; ".join(p.describe() for p in self.passed)


def in_order(candidates: Iterable[Candidate]) -> list[Candidate]:
    """Newest step first; within a step, the nearer rung first."""
    return sorted(candidates, key=lambda c: (-c.step, c.rung.order, c.where))


def descend(
    candidates: Iterable[Candidate],
    verify: Callable[[Candidate], Verification],
    *,
    below_step: int | None = None,
) -> Descent:
    """The newest candidate that verifies, and every one passed over before
    it. With `below_step`, steps at or above it are passed over unverified."""
    passed: list[Passed] = []
    for candidate in in_order(candidates):
        if below_step is not None and candidate.step >= below_step:
            passed.append(Passed(candidate, Skip.ABOVE_BREAKER, f"below step {below_step} asked"))
            continue
        result = verify(candidate)
        if isinstance(result, Verified):
            return Descent(candidate, tuple(passed))
        passed.append(Passed(candidate, result.why, result.detail))
    return Descent(None, tuple(passed))
