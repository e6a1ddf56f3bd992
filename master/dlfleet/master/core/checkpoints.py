"""In-memory checkpoints: which steps every rank has saved, and where the copies are.

A training rank saves an *image* of its state into its node's shared memory;
the node's agent copies it to one peer and reports the copies it holds. This
table keeps one record per step: the round that saved it, that round's world
size, and the copies reported per rank (node, own or replica, address, size).

- A step is *committed* once every rank 0..world_size-1 has had a copy of
  its image reported, its own node's or a replica on another node (a replica
  is a verified copy of the image: it proves the rank saved the step as well
  as the rank's own report does; a later loss of copies does not undo that),
  *replicated* once it is committed and every rank has also had a replica
  reported (when the ranks saved on more than one node: losing any one node
  then loses no image of it), and *restorable* while it is committed and
  every rank has at least one copy on a node that is not gone. `latest`
  answers the newest restorable step. Agents hold a save's answer until its
  step is replicated (bounded), so that a rank finishing step s+1 knows step
  s survives the loss of any one node.
- A double fault: while the master is away (it restarts), the saves do not
  wait for it; an agent then answers its workers once its node holds every
  rank's image of the step, own or replica (`dlfleet.worker.agent.keeper`),
  and when the master answers again it reports every image it holds. If a
  node was lost meanwhile, the survivor's own images and its replicas of the
  lost node's make the step committed and restorable here, because replicas
  count as saves: the survivors restore it, not the last step committed
  before the outage, and no step is counted that is not held whole.
- Lineage: a step belongs to one round. A report of round R for step s abandons
  every record (and the persisted step) of an older round at a step >= s: a
  restore went back before them, so they are a future that will not happen.
  A report is *stale*, and ignored without an error, when a newer round holds
  a step at or below s, or when s has no record and a newer round has already
  reported (then s can only be an abandoned future as well).
- Bounded: at most `keep_steps` records (at least MIN_KEEP_STEPS), the
  oldest dropped first, but never the newest restorable one, the newest
  replicated one, the step being copied or the newest; `gone` remembers the
  last `GONE_KEPT` node ids.

Invariants (tests/unit/core/test_checkpoints_properties.py): `latest()` is
committed and has a copy of every rank on a node that is not gone; a stale
report changes nothing; replaying the events on a fresh table rebuilds the
same state. Every operation validates, then decides events
(`checkpoint_events.py`) and applies them (the same `apply` replays the
journal). Nothing here reads a clock.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dlfleet.api.errors import InvalidArgument
from dlfleet.master.core.checkpoint_events import (
    CheckpointEvent,
    CopiesDropped,
    CopiesReported,
    ImageCopy,
    NodeGone,
    StepDropped,
    StepPersisted,
    StepsAbandoned,
)

MAX_WORLD_SIZE = 1 << 20
MAX_COPIES_PER_REPORT = 4096
MAX_EARLIER_STEPS = 64
TARGET_PATIENCE = 100  # reports a replica step stays chosen without being replicated
MAX_TEXT = 1024  # node ids and addresses
MAX_PATH = 4096
GONE_KEPT = 10_000
# The steps the bound never drops: the newest restorable, the newest
# replicated, the one being copied and the newest.
MIN_KEEP_STEPS = 4
NONE = -1  # "no such step" on the wire


@dataclass(frozen=True)
class CheckpointSettings:
    keep_steps: int = 8

    def __post_init__(self) -> None:
        if self.keep_steps < MIN_KEEP_STEPS:
            raise InvalidArgument(
                f"keep_steps must be at least {MIN_KEEP_STEPS} (the steps the bound never"
                f" drops), got {self.keep_steps}"
            )


@dataclass(frozen=True, slots=True)
class CheckpointReport:
    """A node's copies of one step, as it holds them now."""

    node_id: str
    step: int
    round: int
    world_size: int
    copies: tuple[ImageCopy, ...]
    dropped_below: int = 0  # the node no longer holds its copies of earlier steps
    # Earlier steps (same round and world size) at which it holds the same copies.
    earlier_steps: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ReportAnswer:
    committed_step: int  # NONE when no step is committed
    stale: bool
    replicated_step: int = NONE
    replica_step: int = NONE  # see CheckpointTable.replica_step


@dataclass(frozen=True, slots=True)
class CheckpointView:
    """A restorable step: for each rank its copies, own copies first."""

    step: int
    round: int
    world_size: int
    copies: tuple[ImageCopy, ...]


@dataclass(frozen=True, slots=True)
class PersistedStep:
    step: int
    path: str
    round: int
    world_size: int


@dataclass(frozen=True, slots=True)
class CheckpointStatusView:
    committed_step: int
    restorable_step: int
    bytes_held: int
    persisted_step: int
    persisted_path: str
    replicated_step: int = NONE


# ------------------------------------------------------------------- state


@dataclass
class StepRecord:
    """One step's copies, indexed by holder (a lost node's copies go at once)
    and counted per rank (restorable is a lookup, not a scan)."""

    step: int
    round: int
    world_size: int
    by_node: dict[str, dict[tuple[int, bool], ImageCopy]] = field(default_factory=dict)
    saved: set[int] = field(default_factory=set)  # ranks with a copy ever reported
    savers: set[str] = field(default_factory=set)  # nodes that ever reported an own copy
    replicated: set[int] = field(default_factory=set)  # ranks whose replica was ever reported
    holders: Counter[int] = field(default_factory=Counter)  # copies per rank, > 0

    @property
    def committed(self) -> bool:
        return len(self.saved) == self.world_size

    @property
    def safe(self) -> bool:
        """Committed, and no single node's loss could take every copy of a
        rank's image (a round of one node has no peer to copy to: it made
        no replica, and its own copies came from that node alone)."""
        if not self.committed:
            return False
        alone = len(self.savers) <= 1 and not self.replicated
        return alone or len(self.replicated) == self.world_size

    @property
    def restorable(self) -> bool:
        return self.committed and len(self.holders) == self.world_size

    def copies(self) -> Iterator[ImageCopy]:
        for held in self.by_node.values():
            yield from held.values()

    def find(self, copy: ImageCopy) -> ImageCopy | None:
        return self.by_node.get(copy.node_id, {}).get((copy.rank, copy.replica))

    def add(self, copy: ImageCopy) -> None:
        held = self.by_node.setdefault(copy.node_id, {})
        if (copy.rank, copy.replica) not in held:
            self.holders[copy.rank] += 1
        held[(copy.rank, copy.replica)] = copy
        self.saved.add(copy.rank)
        if copy.replica:
            self.replicated.add(copy.rank)
        else:
            self.savers.add(copy.node_id)

    def remove_node(self, node_id: str) -> None:
        for copy in self.by_node.pop(node_id, {}).values():
            self.holders[copy.rank] -= 1
            if not self.holders[copy.rank]:
                del self.holders[copy.rank]


class CheckpointTable:
    """Not thread-safe: one owner (the master's event loop) drives it."""

    def __init__(self, settings: CheckpointSettings | None = None) -> None:
        self.settings = settings or CheckpointSettings()
        self.records: dict[int, StepRecord] = {}
        self.newest_round = 0  # the newest round that reported copies
        self.gone: dict[str, None] = {}  # node ids, oldest first
        self.persisted: PersistedStep | None = None
        # The step chosen for every node to copy to its peer (a hint to the
        # nodes, derived from the records: not journaled, chosen afresh after
        # a restart).
        self._replica_target = NONE
        self._target_age = 0  # reports since it was chosen
        self._appliers: dict[type[CheckpointEvent], Callable[[Any], None]] = {
            CopiesReported: self._apply_reported,
            StepsAbandoned: self._apply_abandoned,
            StepDropped: self._apply_dropped,
            CopiesDropped: self._apply_copies_dropped,
            NodeGone: self._apply_node_gone,
            StepPersisted: self._apply_persisted,
        }

    # ----------------------------------------------------------- operations

    def report(self, report: CheckpointReport) -> tuple[ReportAnswer, list[CheckpointEvent]]:
        """Record a node's copies of one step (and of its `earlier_steps`,
        oldest first, as reports of their own). A stale report is ignored
        (the answer says so); a repeated one changes nothing."""
        validate_report(report)
        steps = sorted(report.earlier_steps)
        for step in (*steps, report.step):
            self._check_world(step, report.round, report.world_size)
        if report.node_id in self.gone or self._stale(report.round, report.step):
            return self._answer(stale=True), []
        events: list[CheckpointEvent] = []
        copies = tuple(c for c in report.copies if c.node_id not in self.gone)
        for step in steps:
            if not self._stale(report.round, step):
                self._report_step(events, report, step, copies)
        self._report_step(events, report, report.step, copies)
        if report.dropped_below > 0 and self._holds_below(report.node_id, report.dropped_below):
            self._emit(events, CopiesDropped(report.node_id, report.dropped_below))
        return self._answer(stale=False), events

    def _report_step(
        self,
        events: list[CheckpointEvent],
        report: CheckpointReport,
        step: int,
        copies: tuple[ImageCopy, ...],
    ) -> None:
        if not copies or self._hopeless(step):
            return
        if self._abandons(report.round, step):
            self._emit(events, StepsAbandoned(report.round, step))
        record = self.records.get(step)
        if record is None or any(record.find(c) != c for c in copies):
            self._emit(
                events,
                CopiesReported(report.node_id, step, report.round, report.world_size, copies),
            )
            self._bound(events)

    def _answer(self, *, stale: bool) -> ReportAnswer:
        return ReportAnswer(
            self.committed_step(), stale, self.replicated_step(), self.replica_step()
        )

    def replica_step(self) -> int:
        """The step every node is to copy to its peer next: one step for
        all, or the ranks' replicas, each of the newest step its node had
        time for, would rarely be of one step, and no step would count as
        replicated. It stays chosen until it or a newer step is replicated
        (the nodes copy steps of their own accord too), or it is gone, or of
        an older round than the newest, or still not replicated after
        TARGET_PATIENCE reports: a node no longer holds it); then the
        newest committed step is."""
        record = self.records.get(self._replica_target)
        self._target_age += 1
        if (
            record is None
            or self.replicated_step() >= self._replica_target
            or record.round < self.newest_round
            or self._target_age > TARGET_PATIENCE
        ):
            self._replica_target = self.committed_step()
            self._target_age = 0
        return self._replica_target

    def report_persisted(self, persisted: PersistedStep) -> list[CheckpointEvent]:
        """A step written to disk. Only the newest of the lineage is kept:
        newer rounds first, then higher steps; anything else is ignored."""
        validate_persisted(persisted)
        current = self.persisted
        if self._fenced(persisted.round, persisted.step):
            return []
        if current is not None and (persisted.round, persisted.step) <= (
            current.round,
            current.step,
        ):
            return []
        events: list[CheckpointEvent] = []
        self._emit(
            events,
            StepPersisted(persisted.step, persisted.path, persisted.round, persisted.world_size),
        )
        return events

    def node_gone(self, node_id: str) -> list[CheckpointEvent]:
        """The node died, left or was replaced: its copies are lost."""
        if not node_id:
            raise InvalidArgument("node_gone needs a node id")
        if node_id in self.gone:
            return []
        events: list[CheckpointEvent] = []
        self._emit(events, NodeGone(node_id))
        return events

    def nodes_gone_except(self, live: Iterable[str]) -> list[CheckpointEvent]:
        """Every node holding copies that is not in `live` is gone (after a
        master restart: nodes forgotten while their loss was not yet written)."""
        keep = set(live)
        holders = {node_id for r in self.records.values() for node_id in r.by_node}
        events: list[CheckpointEvent] = []
        for node_id in sorted(holders - keep):
            events += self.node_gone(node_id)
        return events

    # --------------------------------------------------------------- queries

    def latest(self, before_step: int = 0) -> CheckpointView | None:
        """The newest restorable step (below `before_step` when it is > 0)."""
        if before_step < 0:
            raise InvalidArgument(f"before_step must be >= 0, got {before_step}")
        for step in sorted(self.records, reverse=True):
            record = self.records[step]
            if before_step and step >= before_step:
                continue
            if record.restorable:
                copies = sorted(record.copies(), key=lambda c: (c.rank, c.replica, c.node_id))
                return CheckpointView(step, record.round, record.world_size, tuple(copies))
        return None

    def committed_step(self) -> int:
        return max((s for s, r in self.records.items() if r.committed), default=NONE)

    def lost_step(self) -> int:
        """The newest committed step that is neither restorable nor persisted
        (its images went with the nodes that held them), when nothing newer
        or as new is restorable or persisted; NONE otherwise."""
        committed = self.committed_step()
        kept = max(self.restorable_step(), self.persisted.step if self.persisted else NONE)
        return committed if committed > kept else NONE

    def committed_in_round(self, round_: int) -> int:
        """The newest step `round_` itself saved that is committed: how far
        that round got (the restart-loop breaker's measure of progress)."""
        return max(
            (s for s, r in self.records.items() if r.round == round_ and r.committed),
            default=NONE,
        )

    def held_below(self, step: int) -> bool:
        """Whether a step below `step` can be restored: a restorable image in
        memory, or the persisted step the table knows of (older persisted
        folders it does not know of may exist as well)."""
        if step <= 0:
            return False
        persisted = self.persisted
        return self.latest(step) is not None or (persisted is not None and persisted.step < step)

    def replicated_step(self) -> int:
        return max((s for s, r in self.records.items() if r.safe), default=NONE)

    def restorable_step(self) -> int:
        return max((s for s, r in self.records.items() if r.restorable), default=NONE)

    def status(self) -> CheckpointStatusView:
        persisted = self.persisted
        return CheckpointStatusView(
            committed_step=self.committed_step(),
            restorable_step=self.restorable_step(),
            bytes_held=sum(c.size for r in self.records.values() for c in r.copies()),
            persisted_step=persisted.step if persisted is not None else NONE,
            persisted_path=persisted.path if persisted is not None else "",
            replicated_step=self.replicated_step(),
        )

    # ------------------------------------------------------- snapshot form

    def to_dict(self) -> dict[str, Any]:
        """The whole state as JSON-able data (journal compaction, tests)."""
        return {
            "records": [
                {
                    "step": r.step,
                    "round": r.round,
                    "world_size": r.world_size,
                    "saved": sorted(r.saved),
                    "savers": sorted(r.savers),
                    "replicated": sorted(r.replicated),
                    "copies": [dataclasses.asdict(c) for c in sorted(r.copies(), key=_key)],
                }
                for _, r in sorted(self.records.items())
            ],
            "newest_round": self.newest_round,
            "gone": list(self.gone),
            "persisted": dataclasses.asdict(self.persisted) if self.persisted else None,
        }

    def install(self, data: dict[str, Any]) -> None:
        """Adopt a state from `to_dict` (recovery), replacing the current one."""
        self.records = {}
        for r in data["records"]:
            record = StepRecord(r["step"], r["round"], r["world_size"])
            for copy in r["copies"]:
                record.add(ImageCopy(**copy))
            # Ranks and nodes whose copies were lost since count too (snapshots
            # written before "savers"/"replicated" existed: what the copies say).
            record.saved = set(r["saved"])
            record.savers = set(r.get("savers", record.savers))
            record.replicated = set(r.get("replicated", record.replicated))
            self.records[record.step] = record
        self.newest_round = data["newest_round"]
        self.gone = dict.fromkeys(data["gone"])
        persisted = data["persisted"]
        self.persisted = PersistedStep(**persisted) if persisted is not None else None

    # ----------------------------------------------------------------- apply

    def apply(self, event: CheckpointEvent) -> None:
        self._appliers[type(event)](event)

    def _emit(self, events: list[CheckpointEvent], event: CheckpointEvent) -> None:
        """Apply `event` as soon as it is decided, and keep it for the
        journal: a report abandons older rounds' steps, then adds its copies,
        then bounds the table, each step reading what the one before changed.
        `apply` is still the only way state changes, and the events the whole
        of it (one journal append; replay applies them with the same
        `apply`)."""
        self.apply(event)
        events.append(event)

    def _apply_reported(self, event: CopiesReported) -> None:
        record = self.records.get(event.step)
        if record is None:
            record = StepRecord(event.step, event.round, event.world_size)
            self.records[event.step] = record
        for copy in event.copies:
            record.add(copy)
        self.newest_round = max(self.newest_round, event.round)

    def _apply_abandoned(self, event: StepsAbandoned) -> None:
        for step in [s for s, r in self.records.items() if self._abandoned(r.round, s, event)]:
            del self.records[step]
        persisted = self.persisted
        if persisted is not None and self._abandoned(persisted.round, persisted.step, event):
            self.persisted = None

    @staticmethod
    def _abandoned(round_: int, step: int, event: StepsAbandoned) -> bool:
        return round_ < event.round and step >= event.from_step

    def _apply_dropped(self, event: StepDropped) -> None:
        del self.records[event.step]

    def _apply_copies_dropped(self, event: CopiesDropped) -> None:
        for step, record in self.records.items():
            if step < event.below_step:
                record.remove_node(event.node_id)

    def _apply_node_gone(self, event: NodeGone) -> None:
        for record in self.records.values():
            record.remove_node(event.node_id)
        self.gone[event.node_id] = None
        while len(self.gone) > GONE_KEPT:
            del self.gone[next(iter(self.gone))]

    def _apply_persisted(self, event: StepPersisted) -> None:
        self.persisted = PersistedStep(event.step, event.path, event.round, event.world_size)

    # --------------------------------------------------------------- helpers

    def _check_world(self, step: int, round_: int, world_size: int) -> None:
        record = self.records.get(step)
        if record is not None and record.round == round_ and record.world_size != world_size:
            raise InvalidArgument(
                f"step {step} of round {round_} was saved by {record.world_size} ranks; "
                f"this report says world_size {world_size}"
            )

    def _fenced(self, round_: int, step: int) -> bool:
        """A newer round holds a step at or below `step`: round `round_`'s
        step is not on the lineage any more."""
        return any(r.round > round_ and s <= step for s, r in self.records.items())

    def _stale(self, round_: int, step: int) -> bool:
        if self._fenced(round_, step):
            return True
        return step not in self.records and round_ < self.newest_round

    def _hopeless(self, step: int) -> bool:
        """A new step older than every kept one while the table is full: the
        bound would drop it at once."""
        if step in self.records or len(self.records) < self.settings.keep_steps:
            return False
        return step < min(self.records)

    def _abandons(self, round_: int, step: int) -> bool:
        event = StepsAbandoned(round_, step)
        persisted = self.persisted
        return any(self._abandoned(r.round, s, event) for s, r in self.records.items()) or (
            persisted is not None and self._abandoned(persisted.round, persisted.step, event)
        )

    def _bound(self, events: list[CheckpointEvent]) -> None:
        if len(self.records) <= self.settings.keep_steps:
            return
        # The newest restorable step; the newest replicated one, which a
        # node's loss falls back to (replicas trail the saves); the step
        # being copied, which becomes that; the newest, just reported (a
        # table full of those would otherwise drop every new step at once).
        keep = {
            self.restorable_step(),
            self.replicated_step(),
            self._replica_target,
            max(self.records),
        }
        for step in sorted(self.records):
            if len(self.records) <= self.settings.keep_steps:
                return
            if step not in keep:
                self._emit(events, StepDropped(step))

    def _holds_below(self, node_id: str, below: int) -> bool:
        return any(node_id in r.by_node for s, r in self.records.items() if s < below)


def _key(copy: ImageCopy) -> tuple[int, str, bool]:
    return copy.key


def validate_report(report: CheckpointReport) -> None:
    where = f"checkpoint report of step {report.step}"
    _check_text("node_id", report.node_id, MAX_TEXT)
    if report.step < 0:
        raise InvalidArgument(f"checkpoint step must be >= 0, got {report.step}")
    _check_round(report.round, report.world_size)
    if len(report.earlier_steps) > MAX_EARLIER_STEPS:
        raise InvalidArgument(
            f"{where}: {len(report.earlier_steps)} earlier steps; at most {MAX_EARLIER_STEPS}"
        )
    if len(set(report.earlier_steps)) != len(report.earlier_steps) or any(
        not 0 <= s < report.step for s in report.earlier_steps
    ):
        raise InvalidArgument(
            f"{where}: earlier steps must be distinct steps in 0..{report.step - 1}, "
            f"got {list(report.earlier_steps)}"
        )
    if not 0 <= report.dropped_below <= report.step:
        raise InvalidArgument(
            f"{where}: dropped_below must be in 0..{report.step}, got {report.dropped_below}"
        )
    if len(report.copies) > MAX_COPIES_PER_REPORT:
        raise InvalidArgument(
            f"{where}: {len(report.copies)} copies; at most {MAX_COPIES_PER_REPORT} per report"
        )
    keys: set[tuple[int, str, bool]] = set()
    for copy in report.copies:
        if not 0 <= copy.rank < report.world_size:
            raise InvalidArgument(
                f"{where}: rank {copy.rank} is outside 0..{report.world_size - 1}"
            )
        _check_text(f"rank {copy.rank}'s copy node_id", copy.node_id, MAX_TEXT)
        _check_text(f"rank {copy.rank}'s copy address", copy.address, MAX_TEXT, empty=True)
        if copy.size < 0:
            raise InvalidArgument(f"{where}: rank {copy.rank}'s copy has {copy.size} bytes")
        if copy.key in keys:
            raise InvalidArgument(
                f"{where}: rank {copy.rank}'s {'replica' if copy.replica else 'own copy'} "
                f"on {copy.node_id!r} is listed twice"
            )
        keys.add(copy.key)


def validate_persisted(persisted: PersistedStep) -> None:
    if persisted.step < 0:
        raise InvalidArgument(f"persisted step must be >= 0, got {persisted.step}")
    _check_text("persisted path", persisted.path, MAX_PATH)
    _check_round(persisted.round, persisted.world_size)


def _check_round(round_: int, world_size: int) -> None:
    if round_ < 1:
        raise InvalidArgument(f"a checkpoint's round must be >= 1, got {round_}")
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise InvalidArgument(f"world_size must be in 1..{MAX_WORLD_SIZE}, got {world_size}")


def _check_text(what: str, text: str, limit: int, *, empty: bool = False) -> None:
    if not text and not empty:
        raise InvalidArgument(f"{what} must not be empty")
    if len(text) > limit:
        raise InvalidArgument(f"{what} is longer than {limit} characters ({len(text)})")
