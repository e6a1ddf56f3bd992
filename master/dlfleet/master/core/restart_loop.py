"""The restart-loop breaker: a job that fails again at the same step after
every restore steps down to an older step, and fails when none is left.

A deterministic fault (a NaN at step N+1, a bad record leased at that step, a
corrupt image that still verifies) survives every restart: each round restores
step N and fails again. Restarting more changes nothing; an older step might
(it replays other data, or the state before the fault crept in), and when no
older step is left, the job must fail and say why rather than loop.

The decision is job-wide, so the master makes it: each node's agent sees only
its own failures, and rank 0 alone picks the restored step for every rank.
The master learns, per round:

- the step it restored (`restored`): the first answer a rank of the round got
  from `Latest` (the newest restorable step, NONE at a fresh start). A round
  that never asked restored nothing the breaker could step down from, and its
  failures do not count;
- how far it got (`reached`): the newest step that round itself committed;
- that it failed (`failed`), once however many of its ranks report.

A round that restored step S and failed without committing beyond
S + `window` is a strike against S. `failures` strikes against S lower the
restore ceiling to S: `Latest` then answers only steps below it, and tells
the ranks `below_step`, so that their persisted-folder ladder obeys it too.
A round that commits beyond S + `window` made progress: the strikes are
forgotten, and a ceiling it passed by `window` is lifted.

When the ceiling would leave nothing to restore (`older(S)` says no step
below S is held: no restorable image in memory and no persisted step the
master knows of below it), or the loop is at a fresh start (S is NONE), the
job is *broken*: the master refuses further joins with the `Diagnosis`, which
names the step, the leases of the failing rounds and the last error.

Pure: the caller passes the time-free facts in (what the checkpoint table and
the shard book say) and journals the events; `apply` is the only way the
state changes, and replaying the events rebuilds it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dlfleet.api.diagnosis import RESTART_LOOP_REFUSAL
from dlfleet.api.errors import DlfleetError, ErrorCode, InvalidArgument
from dlfleet.master.core.shards import ShardBook
from dlfleet.master.settings import STANDALONE

NONE = -1  # a fresh start: no step restored
ROUNDS_KEPT = 256  # rounds whose restored step, and strikes, are remembered
LEASES_NAMED = 16  # leases a diagnosis names, at most
MESSAGE_KEPT = 2000  # characters of the last error a diagnosis keeps


class RestartLoopBroken(DlfleetError):
    """The job failed at the same step after every restore, down to the
    oldest: a join is refused with the diagnosis."""

    code = ErrorCode.FAILED_PRECONDITION


@dataclass(frozen=True)
class BreakerSettings:
    """`failures`: strikes against one restored step before the ceiling drops
    below it (0: the breaker is off). `window`: steps beyond the restored one
    a round may commit and still count as failing at the same step."""

    failures: int = STANDALONE.restart_loop_failures
    window: int = STANDALONE.restart_loop_window

    def __post_init__(self) -> None:
        if self.failures < 0:
            raise InvalidArgument(f"restart_loop failures must be >= 0, got {self.failures}")
        if self.window < 0:
            raise InvalidArgument(f"restart_loop window must be >= 0, got {self.window}")


@dataclass(frozen=True)
class Strike:
    """A round that restored `restored` and failed having committed `reached`."""

    round: int
    restored: int
    reached: int
    message: str
    leases: tuple[str, ...] = ()


@dataclass(frozen=True)
class Diagnosis:
    step: int  # the step every restore failed after (NONE: a fresh start)
    strikes: tuple[Strike, ...]

    @property
    def leases(self) -> tuple[str, ...]:
        named = dict.fromkeys(lease for s in self.strikes for lease in s.leases)
        return tuple(named)[:LEASES_NAMED]

    @property
    def message(self) -> str:
        return self.strikes[-1].message if self.strikes else ""

    def describe(self) -> str:
        where = f"after restoring step {self.step}" if self.step >= 0 else "from a fresh start"
        rounds = ", ".join(str(s.round) for s in self.strikes)
        leases = "; ".join(self.leases) or "none known"
        return (
            f"{RESTART_LOOP_REFUSAL} the job failed {len(self.strikes)} times {where} "
            f"(rounds {rounds}) and no older step is left to restore; "
            f"leased in those rounds: {leases}; last error: {self.message.strip() or 'none given'}"
        )


# ------------------------------------------------------------------ events


@dataclass(frozen=True)
class BreakerEvent:
    """What the breaker decided, as the journal keeps it."""

    KIND: ClassVar[str] = ""

    def to_json(self) -> str:
        return json.dumps({"t": self.KIND, **dataclasses.asdict(self)}, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> BreakerEvent:
        data = json.loads(text)
        kind = _KINDS[data.pop("t")]
        if "strike" in data:
            data["strike"] = _strike(data["strike"])
        return kind(**data)


@dataclass(frozen=True)
class RoundRestored(BreakerEvent):
    KIND: ClassVar[str] = "RoundRestored"
    round: int
    step: int


@dataclass(frozen=True)
class Struck(BreakerEvent):
    KIND: ClassVar[str] = "Struck"
    strike: Strike


@dataclass(frozen=True)
class Progressed(BreakerEvent):
    """A round committed beyond its restored step's window: strikes are
    forgotten, and the ceiling lifted when `lift`."""

    KIND: ClassVar[str] = "Progressed"
    round: int
    lift: bool


@dataclass(frozen=True)
class CeilingLowered(BreakerEvent):
    KIND: ClassVar[str] = "CeilingLowered"
    step: int


@dataclass(frozen=True)
class Broken(BreakerEvent):
    KIND: ClassVar[str] = "Broken"
    step: int


_KINDS: dict[str, type[BreakerEvent]] = {
    k.KIND: k for k in (RoundRestored, Struck, Progressed, CeilingLowered, Broken)
}


def _strike(data: dict[str, Any]) -> Strike:
    return Strike(**{**data, "leases": tuple(data.get("leases", ()))})


# ------------------------------------------------------------------- state


@dataclass
class BreakerState:
    restored: dict[int, int] = field(default_factory=dict)  # round -> step, oldest first
    strikes: list[Strike] = field(default_factory=list)
    progressed: set[int] = field(default_factory=set)  # rounds that made progress
    ceiling: int | None = None  # restores take a step below it
    broken: Diagnosis | None = None


class RestartLoopBreaker:
    """Not thread-safe: the master's event loop drives it."""

    def __init__(self, settings: BreakerSettings | None = None) -> None:
        self.settings = settings or BreakerSettings()
        self.state = BreakerState()

    @property
    def ceiling(self) -> int | None:
        return self.state.ceiling

    @property
    def broken(self) -> Diagnosis | None:
        return self.state.broken

    def check_open(self) -> None:
        """Raise RestartLoopBroken once the job is broken (a join is refused)."""
        if self.state.broken is not None:
            raise RestartLoopBroken(self.state.broken.describe())

    def below(self, before_step: int) -> int:
        """The `before_step` a restore asking for `before_step` (0: any) may
        have under the ceiling."""
        ceiling = self.state.ceiling
        if ceiling is None:
            return before_step
        return ceiling if before_step <= 0 else min(before_step, ceiling)

    # ------------------------------------------------------------ decisions

    def restored(self, round_: int, step: int) -> list[BreakerEvent]:
        """A rank of `round_` was told to restore `step` (NONE: nothing). The
        first answer of a round is the one it restored."""
        if round_ < 1 or round_ in self.state.restored or not self._on():
            return []
        return self._emit([RoundRestored(round_, max(step, NONE))])

    def progress(self, round_: int, reached: int) -> list[BreakerEvent]:
        """`round_` has committed step `reached`."""
        restored = self.state.restored.get(round_)
        if restored is None or round_ in self.state.progressed:
            return []
        if reached <= restored + self.settings.window:
            return []
        ceiling = self.state.ceiling
        lift = ceiling is not None and reached > ceiling + self.settings.window
        return self._emit([Progressed(round_, lift)])

    def failed(
        self,
        round_: int,
        reached: int,
        message: str,
        leases: Iterable[str],
        older: Callable[[int], bool],
    ) -> list[BreakerEvent]:
        """A worker of `round_` failed, the round having committed `reached`.
        `older(S)` says whether a step below S is held to restore."""
        events = self.progress(round_, reached)
        restored = self.state.restored.get(round_)
        state = self.state
        if (
            restored is None
            or state.broken is not None
            or round_ in state.progressed
            or any(s.round == round_ for s in state.strikes)
        ):
            return events
        strike = Strike(round_, restored, reached, message[-MESSAGE_KEPT:], tuple(leases))
        events += self._emit([Struck(strike)])
        against = [s for s in state.strikes if s.restored == restored]
        if len(against) < self.settings.failures:
            return events
        if restored <= 0 or not older(restored):
            return events + self._emit([Broken(restored)])
        if state.ceiling is None or restored < state.ceiling:
            events += self._emit([CeilingLowered(restored)])
        return events

    def _on(self) -> bool:
        return self.settings.failures > 0

    # ------------------------------------------------------- snapshot form

    def to_dict(self) -> dict[str, Any]:
        """The whole state as JSON-able data (journal compaction, tests)."""
        state = self.state
        broken = state.broken
        return {
            "restored": [[r, s] for r, s in state.restored.items()],
            "strikes": [dataclasses.asdict(s) for s in state.strikes],
            "progressed": sorted(state.progressed),
            "ceiling": state.ceiling,
            "broken": None
            if broken is None
            else {"step": broken.step, "strikes": [dataclasses.asdict(s) for s in broken.strikes]},
        }

    def install(self, data: dict[str, Any]) -> None:
        """Adopt a state from `to_dict` (recovery), replacing the current one."""
        broken = data["broken"]
        self.state = BreakerState(
            restored={r: s for r, s in data["restored"]},
            strikes=[_strike(s) for s in data["strikes"]],
            progressed=set(data["progressed"]),
            ceiling=data["ceiling"],
            broken=None
            if broken is None
            else Diagnosis(broken["step"], tuple(_strike(s) for s in broken["strikes"])),
        )

    # ----------------------------------------------------------------- apply

    def _emit(self, events: list[BreakerEvent]) -> list[BreakerEvent]:
        for event in events:
            self.apply(event)
        return events

    def apply(self, event: BreakerEvent) -> None:
        state = self.state
        match event:
            case RoundRestored(round=round_, step=step):
                state.restored[round_] = step
                while len(state.restored) > ROUNDS_KEPT:
                    del state.restored[next(iter(state.restored))]
                state.progressed &= set(state.restored)
            case Struck(strike=strike):
                state.strikes.append(strike)
                del state.strikes[:-ROUNDS_KEPT]
            case Progressed(round=round_, lift=lift):
                state.progressed.add(round_)
                state.strikes.clear()
                if lift:
                    state.ceiling = None
            case CeilingLowered(step=step):
                state.ceiling = step
            case Broken(step=step):
                state.broken = Diagnosis(
                    step, tuple(s for s in state.strikes if s.restored == step)
                )
            case _:
                raise TypeError(f"the breaker applies no {event!r}")


def leased_in_round(book: ShardBook, round_: int, nodes: Iterable[str]) -> list[str]:
    """The live leases of `round_` (or of its nodes' ranks), in words: which
    records the failing step was reading."""
    members = set(nodes)
    named: list[str] = []
    for name, dataset in sorted(book.datasets.items()):
        for lease in dataset.doing.values():
            if lease.round == round_ or (lease.node_id and lease.node_id in members):
                named.append(
                    f"{name} records {lease.start}..{lease.end} "
                    f"(epoch {lease.epoch}, lease {lease.lease_id})"
                )
    return named[:LEASES_NAMED]
