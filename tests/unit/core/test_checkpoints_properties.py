"""Property-based tests of the checkpoint table: a hypothesis state machine
reports copies of random steps from random rounds and nodes (own images,
replicas, copies on gone nodes, drops of old steps), loses nodes, persists
steps, and after every step checks the invariants of
`dlfleet.master.core.checkpoints`:

- `latest()` is committed (every rank's image was reported in its round, own
  or replica)
  and has a copy of every rank, none on a gone node, own copies first;
- the replicated step is the newest committed one whose every rank also had a
  replica reported, or whose images all came from one node and none as a
  replica;
- a stale report (an older round) changes nothing;
- no record of an older round sits at or above a step a newer round saved;
- the table stays within `keep_steps`, and its per-rank counts match its copies;
- replaying the journal on a fresh table rebuilds the same state.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from dlfleet.master.core.checkpoint_events import CheckpointEvent, ImageCopy, StepDropped
from dlfleet.master.core.checkpoints import (
    MIN_KEEP_STEPS,
    CheckpointReport,
    CheckpointSettings,
    CheckpointTable,
    PersistedStep,
)

NAMES = ("a", "b", "c")


def world_of(round_: int) -> int:
    """Each round has its own world size (1..3 ranks)."""
    return 1 + round_ % 3


class CheckpointTableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.settings = CheckpointSettings()
        self.table = CheckpointTable(self.settings)
        self.journal: list[str] = []
        self.incarnation = dict.fromkeys(NAMES, 1)
        self.gone: set[str] = set()
        # Ranks with an accepted copy (own or replica), per (round, step): the
        # model of "committed".
        self.saved: defaultdict[tuple[int, int], set[int]] = defaultdict(set)
        # ... and ranks with an accepted replica, nodes with an accepted own image.
        self.replicas: defaultdict[tuple[int, int], set[int]] = defaultdict(set)
        self.savers: defaultdict[tuple[int, int], set[str]] = defaultdict(set)
        self.newest_round = 0
        # (round, step) of every accepted report that saved copies.
        self.saves: list[tuple[int, int]] = []

    @initialize(keep=st.integers(MIN_KEEP_STEPS, MIN_KEEP_STEPS + 3))
    def configure(self, keep: int) -> None:
        self.settings = CheckpointSettings(keep_steps=keep)
        self.table = CheckpointTable(self.settings)

    def node(self, name: str, stale: bool = False) -> str:
        incarnation = self.incarnation[name]
        return f"{name}#{incarnation - 1 if stale and incarnation > 1 else incarnation}"

    def _record(self, events: list[CheckpointEvent]) -> None:
        self.journal += [event.to_json() for event in events]

    # ------------------------------------------------------------- rules

    @rule(
        name=st.sampled_from(NAMES),
        stale_node=st.booleans(),
        step=st.integers(0, 12),
        round_=st.integers(1, 4),
        copies=st.lists(
            st.tuples(st.integers(0, 2), st.sampled_from(NAMES), st.booleans()), max_size=4
        ),
        dropped_below=st.integers(0, 12),
    )
    def report(
        self,
        name: str,
        stale_node: bool,
        step: int,
        round_: int,
        copies: list[tuple[int, str, bool]],
        dropped_below: int,
    ) -> None:
        world = world_of(round_)
        reporter = self.node(name, stale_node)
        images = {
            (rank % world, self.node(holder), replica): ImageCopy(
                rank % world, self.node(holder), f"{holder}:1", replica, 10 + rank
            )
            for rank, holder, replica in copies
        }
        request = CheckpointReport(
            reporter, step, round_, world, tuple(images.values()), min(dropped_below, step)
        )
        record = self.table.records.get(step)
        if record is not None and record.round == round_ and record.world_size != world:
            return  # cannot happen: world sizes are per round
        before = self.table.to_dict()
        answer, events = self.table.report(request)
        self._record(events)
        if answer.stale:
            assert events == []
            assert self.table.to_dict() == before, "a stale report changed the table"
            event("stale report")
            return
        assert answer.committed_step == self.table.committed_step()
        if any(e.__class__.__name__ == "CopiesReported" for e in events):
            self.newest_round = max(self.newest_round, round_)
            self.saves.append((round_, step))
            for copy in images.values():
                if copy.node_id in self.gone:
                    continue
                self.saved[(round_, step)].add(copy.rank)
                if copy.replica:
                    self.replicas[(round_, step)].add(copy.rank)
                else:
                    self.savers[(round_, step)].add(copy.node_id)
        for dropped in events:
            if isinstance(dropped, StepDropped):
                # Over the bound: the record goes with what was reported of
                # it, and a later report of that step starts a new one.
                for model in (self.saved, self.replicas, self.savers):
                    for key in [key for key in model if key[1] == dropped.step]:
                        del model[key]

    @rule(name=st.sampled_from(NAMES))
    def lose_node(self, name: str) -> None:
        node_id = self.node(name)
        self._record(self.table.node_gone(node_id))
        self.gone.add(node_id)
        self.incarnation[name] += 1
        for record in self.table.records.values():
            assert all(c.node_id != node_id for c in record.copies())

    @rule(step=st.integers(0, 12), round_=st.integers(1, 4))
    def persist(self, step: int, round_: int) -> None:
        self._record(self.table.report_persisted(PersistedStep(step, f"/ckpt/{step}", round_, 1)))

    @rule()
    def stale_round_report_changes_nothing(self) -> None:
        """A report from a round older than a step's round, for that step."""
        for step, record in sorted(self.table.records.items()):
            if record.round > 1:
                old = record.round - 1
                copy = ImageCopy(0, self.node("a"), "a:1", False, 1)
                before = self.table.to_dict()
                answer, events = self.table.report(
                    CheckpointReport(self.node("a"), step, old, world_of(old), (copy,))
                )
                assert answer.stale and events == []
                assert self.table.to_dict() == before
                return

    # -------------------------------------------------------- invariants

    @invariant()
    def latest_is_committed_and_every_rank_has_a_live_copy(self) -> None:
        latest = self.table.latest()
        event("restorable" if latest is not None else "nothing restorable")
        if latest is None:
            assert self.table.status().restorable_step == -1
            return
        ranks = set(range(latest.world_size))
        assert self.saved[(latest.round, latest.step)] >= ranks, "latest is not committed"
        assert {c.rank for c in latest.copies} == ranks
        assert all(c.node_id not in self.gone for c in latest.copies)
        order = [(c.rank, c.replica) for c in latest.copies]
        assert order == sorted(order), "own copies come before replicas"
        for before in (latest.step, latest.step + 1):
            earlier = self.table.latest(before)
            if before > 0:  # 0 asks for any step
                assert earlier is None or earlier.step < before

    @invariant()
    def the_replicated_step_is_the_newest_committed_one_on_two_nodes(self) -> None:
        expected = -1
        for step, record in self.table.records.items():
            key = (record.round, step)
            ranks = set(range(record.world_size))
            alone = len(self.savers[key]) <= 1 and not self.replicas[key]
            if self.saved[key] >= ranks and (alone or self.replicas[key] >= ranks):
                expected = max(expected, step)
        assert self.table.replicated_step() == expected
        assert self.table.status().replicated_step == expected
        assert expected <= self.table.committed_step()
        event("replicated" if expected >= 0 else "nothing replicated")

    @invariant()
    def no_older_round_sits_at_or_above_a_newer_rounds_step(self) -> None:
        records = self.table.records
        for step, record in records.items():
            for other_step, other in records.items():
                if other.round > record.round:
                    assert step < other_step, (step, record.round, other_step, other.round)

    @invariant()
    def the_table_stays_bounded_and_holds_no_copy_on_a_gone_node(self) -> None:
        assert len(self.table.records) <= self.settings.keep_steps
        for record in self.table.records.values():
            assert all(c.node_id not in self.gone for c in record.copies())
            assert record.holders == Counter(c.rank for c in record.copies())
        assert self.table.newest_round == self.newest_round

    @invariant()
    def replaying_the_journal_rebuilds_the_same_table(self) -> None:
        fresh = CheckpointTable(self.settings)
        for line in self.journal:
            fresh.apply(CheckpointEvent.from_json(line))
        assert fresh.to_dict() == self.table.to_dict()
        installed = CheckpointTable(self.settings)
        installed.install(self.table.to_dict())
        assert installed.to_dict() == self.table.to_dict()


CheckpointTableMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCheckpointTable = CheckpointTableMachine.TestCase
