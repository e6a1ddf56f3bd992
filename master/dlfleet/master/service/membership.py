"""Membership: ties node liveness, the rendezvous and the shard book together
on the master's event loop.

What one core decides, the others must hear: a round that forms makes the
shard book serve that round (older rounds' leases are released); a node that
dies or leaves is dropped from the rendezvous (closing its round) and loses its
leases and the checkpoint copies it held; a round that closes is pushed to
its members' sessions (within 0.1 s of a loss), so they re-rendezvous
instead of waiting in a collective.

Each of these is one `Decision` (`service/executor.py`): the events of every
core it touched, applied as decided, then ONE journal append, and only once
that is durable the effects: wakes, pushes, the timeline. A node's loss is one
append of the node forgotten, its leases released, its checkpoint images lost
and its rendezvous place removed (with the shard book's new round, if one
formed), so a master that crashes midway has written all of it or none, and
no survivor is sent to restore from a node whose loss is not yet written.

The survivors of a closed round whose last join left a spare port are joined
into the next round by the master itself (`Rejoiner`): the round forms as the
old one closes, and each survivor's push carries its answer, one message per
survivor instead of a push, a join and an answer.

What interrupts training is also told to the job's goodput ledger
(`core/goodput.py`, `self.goodput`) as it is delivered: a round closing, a
member lost or finished, a round formed (and the step a restore takes now,
from which the ledger counts the steps rolled back), each member's heartbeat
metrics (`heard_metrics`), and whether the job is short of its minimum of nodes.

A waiting joiner is woken only by what concerns it (its round formed, or it
was dropped): with thousands waiting, waking all of them on every event
would cost O(N) per event, O(N^2) per re-formation after a loss.

Lives in the master service process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from dlfleet.api.v1 import rendezvous_pb2
from dlfleet.master.core.goodput import Cause
from dlfleet.master.core.node_events import NodeEvent
from dlfleet.master.core.rendezvous import (
    MemberFinished,
    NodeDropped,
    NodeJoined,
    RendezvousEvent,
    RoundClosed,
    RoundFormed,
    describe,
)
from dlfleet.master.service.executor import Decision, Executor
from dlfleet.master.service.journal import JournalEvent
from dlfleet.master.service.metrics import MasterMetrics
from dlfleet.master.service.state import MasterState
from dlfleet.master.service.timeline import EventKind, Timeline

_log = logging.getLogger(__name__)


# How long the master waits, once a round has closed on a node's loss, before
# it joins the survivors into the next one and tells them (see
# `Membership.apply`; a round closed by a join, say a member restarting its
# workers, re-forms at once).
LOSS_COALESCE_S = 0.1


class Rejoiner(Protocol):
    """Joins the survivors of a closed round into the next one (the
    rendezvous service, which knows their last joins)."""

    def can_rejoin(self, node_id: str) -> bool:
        """Whether `rejoin` may join `node_id` (a spare port on record)."""

    def rejoin(self, node_id: str) -> tuple[int, list[RendezvousEvent]]:
        """Join `node_id` if it can: (the join id its push carries, the
        events), or (0, [])."""

    def answer(self, node_id: str, join_id: int) -> rendezvous_pb2.JoinResponse | None:
        """The answer to the join `join_id` if its round has formed; else
        None, and it goes down the node's session once it forms."""


class Membership:
    def __init__(
        self,
        state: MasterState,
        clock: Callable[[], int],
        executor: Executor,
        metrics: MasterMetrics,
        timeline: Timeline,
    ) -> None:
        self.state = state
        self.metrics = metrics
        self.timeline = timeline
        self.clock = clock
        self.executor = executor
        # The waiting joiners, by node (a node may have more than one Join in flight).
        self._joiners: dict[str, list[asyncio.Future[None]]] = {}
        # Each node's open session: what is put here goes down its stream
        # (None ends it).
        self.sessions: dict[str, asyncio.Queue[rendezvous_pb2.SessionEvent | None]] = {}
        self._timer_kick = asyncio.Event()
        # The deadline the timer sleeps toward (None: until kicked).
        self._sleeping_until: int | None = None
        # Set while the master shuts down: sessions ending then are not deaths.
        self.stopping = False
        # Told of every node lost, after the cores above (the node check's board).
        self.lost_listeners: list[Callable[[str], Awaitable[None]]] = []
        # Joins the survivors of a closed round into the next one itself.
        self.rejoiner: Rejoiner | None = None
        self.goodput = state.goodput
        # The newest committed step when the last round closed (-1: none).
        self._committed_at_close = -1
        # The last (round, committed, replicated, replica step) told the members' sessions.
        self._progress_told = (0, -1, -1, -1)

    async def apply(self, events: list[RendezvousEvent], *, lost: bool = False) -> None:
        """Carry out what the rendezvous decided: write it, then tell who it
        concerns. `lost`: the events follow a node's loss (others lost with it
        may be noticed in a moment)."""
        if not events:
            return
        if all(type(event) is NodeJoined for event in events):
            # A join tells no one anything until its round forms, and the
            # round's event is written after it (the committer keeps the
            # order of submissions): the joiner need not wait for this write.
            self.executor.record(events)
            self._kick_timer()
            return
        await self.executor.carry_out(self.rendezvous_decided(events, lost=lost))

    def rendezvous_decided(self, events: list[RendezvousEvent], *, lost: bool) -> Decision:
        """The rendezvous's events with what the shard book decides of them
        (a formed round is the round it serves), and their delivery."""
        if not events:
            return Decision()
        decided: list[JournalEvent] = [*events]
        for event in events:
            if isinstance(event, RoundFormed):
                decided += self.state.book.begin_round(event.round)

        async def deliver() -> None:
            await self._deliver(events, lost)

        return Decision(decided, [deliver])

    async def _deliver(self, events: list[RendezvousEvent], lost: bool) -> None:
        """Once `events` are durable: say so, wake the joiners they concern,
        and push each closed round to its survivors (joined into the next
        round by the master where it can)."""
        # The events of the survivors the master joined into the next round,
        # and the pushes telling each survivor (session, the closed round,
        # join id).
        rejoined: list[RendezvousEvent] = []
        pushes: list[
            tuple[str, asyncio.Queue[rendezvous_pb2.SessionEvent | None], RoundClosed, int]
        ]
        pushes = []
        for event in events:
            if isinstance(event, RoundFormed):
                round_ = self.state.rendezvous.state.active
                _log.info("round %d formed: %s", event.round, describe(round_) if round_ else "")
                self.timeline.record(
                    EventKind.ROUND_FORMED,
                    event.formed_ms,
                    round=event.round,
                    nodes=[m.node_id for m in event.members],
                    world_size=sum(m.local_world_size for m in event.members),
                )
            elif isinstance(event, RoundClosed):
                _log.info("round %d closed: %s", event.round, event.reason)
                self.timeline.record(
                    EventKind.ROUND_CLOSED, self.clock(), round=event.round, reason=event.reason
                )
                for node_id in event.expected:
                    queue = self.sessions.get(node_id)
                    if queue is not None:
                        pushes.append((node_id, queue, event, 0))
        for event in events:
            if isinstance(event, RoundFormed):
                for member in event.members:
                    self._wake(member.node_id)
            elif isinstance(event, NodeDropped):
                self._wake(event.node_id)
        self._tell_goodput(events)
        self._kick_timer()
        try:
            rejoiner = self.rejoiner
            if rejoiner is not None and any(rejoiner.can_rejoin(push[0]) for push in pushes):
                if lost:
                    # Nodes lost together (a host, a rack) are noticed within
                    # tens of ms of each other: one re-formation for all of
                    # them, not a round formed with some and closed again.
                    await asyncio.sleep(LOSS_COALESCE_S)
                for index, (node_id, queue, closed, _) in enumerate(pushes):
                    if self.sessions.get(node_id) is queue:
                        join_id, joined = rejoiner.rejoin(node_id)
                        pushes[index] = (node_id, queue, closed, join_id)
                        rejoined += joined
            # With every survivor joined, the next round forms here, and each
            # push carries its answer: one message per survivor.
            await self.apply(rejoined)
        finally:
            for node_id, queue, closed, join_id in pushes:
                push = rendezvous_pb2.ReRendezvous(
                    closed_round=closed.round,
                    reason=closed.reason,
                    join_id=join_id,
                    gone_ranks=closed.gone_ranks,
                )
                if join_id and self.rejoiner is not None:
                    answer = self.rejoiner.answer(node_id, join_id)
                    if answer is not None:
                        push.answer.CopyFrom(answer)
                queue.put_nowait(rendezvous_pb2.SessionEvent(re_rendezvous=push))

    def tell_checkpoint_progress(
        self, round_: int, committed: int, replicated: int, replica: int, reporter: str
    ) -> None:
        """A report moved the active round's newest committed or replicated
        step, or the step to copy to the peers next: tell the round's other
        members on their sessions (the reporter has it in its answer), so
        that a save each of them answers once its step is committed and
        replicated is answered now, and each copies the same step, not when
        a report or replica of its own next brings the word."""
        active = self.state.rendezvous.state.active
        if active is None or active.round != round_:
            return
        told = self._progress_told
        if told[0] != round_:
            told = (round_, -1, -1, -1)
        if committed <= told[1] and replicated <= told[2] and replica == told[3]:
            return
        self._progress_told = (round_, max(committed, told[1]), max(replicated, told[2]), replica)
        event = rendezvous_pb2.SessionEvent(
            checkpoint=rendezvous_pb2.CheckpointProgress(
                round=round_,
                committed_step=committed,
                replicated_step=replicated,
                replica_step=replica,
            )
        )
        for member in active.members:
            queue = self.sessions.get(member.node_id)
            if queue is not None and member.node_id != reporter:
                queue.put_nowait(event)

    def _tell_goodput(self, events: list[RendezvousEvent]) -> None:
        """What of `events` interrupts or resumes training, for the ledger."""
        ledger, now = self.goodput, self.clock()
        for event in events:
            if isinstance(event, RoundClosed):
                self._committed_at_close = self.state.checkpoints.committed_step()
                ledger.interrupted(Cause.RE_RENDEZVOUS, Cause.RE_RENDEZVOUS, now)
            elif isinstance(event, RoundFormed):
                ledger.round_formed(frozenset(m.node_id for m in event.members))
                restored = self.state.checkpoints.restorable_step()
                ledger.restored(restored, self._committed_at_close, now)
                self._committed_at_close = -1
            elif isinstance(event, NodeDropped | MemberFinished):
                ledger.node_gone(event.node_id)
        self._short_of_nodes(now)

    def heard_metrics(
        self, node_id: str, round_: int, metrics: rendezvous_pb2.NodeMetrics, now_ms: int
    ) -> None:
        """A heartbeat's metrics about the node's workers in round `round_`,
        for the ledger. From a member of the active round: its steps, the step
        it trained to, and its checkpoint blocking (round 0: a session that
        does not say, taken as the active round). About a round that closed
        since (the agent's last word on the workers it stopped, or a beat sent
        before it took its next round): the steps they made before they
        stopped."""
        trained = metrics.trained_step if metrics.trained_step > 0 else None
        active = self.state.rendezvous.state.active
        current = active is not None and round_ in (0, active.round)
        age_ms = metrics.steps_age_s * 1000
        if current and active is not None and active.member(node_id) is not None:
            self.goodput.stepped(
                node_id,
                metrics.steps,
                metrics.step_time_ms,
                now_ms,
                trained,
                age_ms,
                metrics.stepping_age_s * 1000,
                metrics.run_ended_age_s * 1000,
            )
            self.goodput.checkpoint_blocked(node_id, metrics.checkpoint_blocked_s, now_ms)
        elif round_ > 0 and (active is None or round_ < active.round):
            self.goodput.stopped(node_id, metrics.steps, now_ms, trained, age_ms)

    def _short_of_nodes(self, now_ms: int) -> None:
        """Tell the ledger whether the job waits for nodes: no round, and
        fewer live nodes than a round needs."""
        short = (
            self.state.rendezvous.state.active is None
            and len(self.state.nodes.nodes) < self.state.settings.rendezvous.min_nodes
        )
        self.goodput.waiting_for_nodes(short, now_ms)

    def _kick_timer(self) -> None:
        """Wake the timer if the rendezvous's next deadline is now earlier than
        the one it sleeps toward (a later one it finds when it wakes: with
        thousands joining, most joins move no deadline or move it later)."""
        deadline = self.state.rendezvous.next_deadline()
        if deadline is not None and (
            self._sleeping_until is None or deadline < self._sleeping_until
        ):
            self._timer_kick.set()

    async def news_for(self, node_id: str) -> None:
        """Until the waiting joiner `node_id` is concerned by an event: a round
        formed with it, or it was dropped."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = self._joiners.setdefault(node_id, [])
        waiters.append(waiter)
        try:
            await waiter
        finally:
            waiters.remove(waiter)
            if not waiters and self._joiners.get(node_id) is waiters:
                del self._joiners[node_id]

    def _wake(self, node_id: str) -> None:
        for waiter in self._joiners.get(node_id, ()):
            if not waiter.done():
                waiter.set_result(None)

    async def node_lost(self, node_id: str, reason: str, *, died: bool = False) -> None:
        """A node died (`died`: its processes are gone with it), left, or was
        replaced by a newer incarnation."""
        forgotten = self.state.nodes.forget(node_id)
        await self.executor.carry_out(self.loss(node_id, reason, forgotten, died=died))

    def loss(
        self, node_id: str, reason: str, forgotten: Sequence[NodeEvent], *, died: bool = False
    ) -> Decision:
        """What losing `node_id` changes, decided and applied in every core:
        `forgotten` (the node table's events: empty when the table no longer
        held it), its leases released, the checkpoint images in its memory
        lost (in the same append as the rendezvous's events, so that no
        survivor is told to restore from it), its place in the rendezvous
        removed (closing its round). Delivered: the loss counted and said,
        the rendezvous's effects, then the lost listeners."""
        self.state.seen_from.pop(node_id, None)
        active = self.state.rendezvous.state.active
        member = active is not None and active.member(node_id) is not None
        decided: list[JournalEvent] = [*forgotten]
        decided += self.state.book.release_node(node_id)
        decided += self.state.checkpoints.node_gone(node_id)
        removed = self.state.rendezvous.remove(node_id, reason, self.clock(), died=died)
        rendezvous = self.rendezvous_decided(removed, lost=True)

        async def said() -> None:
            now = self.clock()
            self.metrics.node_lost(reason)
            self.timeline.record(EventKind.NODE_LOST, now, node_id=node_id, reason=reason)
            if member:
                self.goodput.interrupted(Cause.NODE_REPLACEMENT, Cause.NODE_REPLACEMENT, now)
            self.goodput.node_gone(node_id)
            self._short_of_nodes(now)

        async def listeners() -> None:
            for listener in self.lost_listeners:
                await listener(node_id)

        lost = Decision(decided, [said] if forgotten else [])
        return lost.then(rendezvous).then(Decision([], [listeners]))

    async def node_finished(self, node_id: str, reason: str) -> None:
        """The live node `node_id` leaves with its workers done: forgotten,
        its images with it, and its place in the active round ended without
        closing the round (the others may be in their last steps). One
        append, like a loss."""
        decided: list[JournalEvent] = [*self.state.nodes.forget(node_id)]
        decided += self.state.checkpoints.node_gone(node_id)
        removed = self.state.rendezvous.remove(node_id, reason, self.clock(), close_round=False)
        finished = Decision(decided).then(self.rendezvous_decided(removed, lost=False))
        await self.executor.carry_out(finished)

    async def run_timer(self) -> None:
        """Form rounds exactly when their last call ends, without polling."""
        while True:
            deadline = self._sleeping_until = self.state.rendezvous.next_deadline()
            self._timer_kick.clear()
            timeout = None if deadline is None else max(0, deadline - self.clock()) / 1000
            try:
                await asyncio.wait_for(self._timer_kick.wait(), timeout)
            except asyncio.TimeoutError:
                await self.apply(self.state.rendezvous.tick(self.clock()))
