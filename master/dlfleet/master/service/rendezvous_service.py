"""The Rendezvous gRPC service: Join (blocks until the node's round forms),
the agent Session (heartbeats up, re-rendezvous pushes down; a broken session
is a dead agent), Leave, ReportFailure, and GetState for torchrun's handler.

The job's goodput ledger hears two things here: the steps in each heartbeat
of a member of the active round, and each failure of the active round (a
hang is lost to its detection, then to the restart).

Lives in the master service process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from dlfleet.api.addresses import peer_host
from dlfleet.api.diagnosis import FailureFacts, diagnose
from dlfleet.api.errors import (
    TRAINING_DONE_REFUSAL,
    DlfleetError,
    InvalidArgument,
    StaleError,
    TrainingDone,
)
from dlfleet.api.serving.answers import bounded_details, rpc
from dlfleet.api.status import status_number, status_of
from dlfleet.api.v1 import rendezvous_pb2, rendezvous_pb2_grpc, shards_pb2
from dlfleet.master.core.goodput import Cause
from dlfleet.master.core.reachability import Published, Publishers, unreachable
from dlfleet.master.core.rendezvous import RendezvousEvent, Round
from dlfleet.master.core.restart_loop import leased_in_round
from dlfleet.master.service.membership import Membership
from dlfleet.master.service.metrics import failure_reason_label
from dlfleet.master.service.node_reports import NodeReports
from dlfleet.master.service.rpc import Clock
from dlfleet.master.service.state import MasterState
from dlfleet.master.service.timeline import EventKind

_log = logging.getLogger(__name__)

FAILURES_KEPT = 100


class RendezvousService(rendezvous_pb2_grpc.RendezvousServicer):
    def __init__(self, state: MasterState, clock: Clock, membership: Membership) -> None:
        self.state = state
        self.clock = clock
        self.membership = membership
        self.failures: deque[rendezvous_pb2.FailureReport] = deque(maxlen=FAILURES_KEPT)
        # The latest metrics each node's heartbeats carried, and when (ms);
        # and the same as the status RPC sends them.
        self.metrics: dict[str, tuple[rendezvous_pb2.NodeMetrics, int]] = {}
        self.reports = NodeReports()
        # Each open session's node: its last join on the session (what the
        # master joins it with after a loss) and the tasks answering its joins.
        self._last_join: dict[str, rendezvous_pb2.JoinRequest] = {}
        self._joins: dict[str, set[asyncio.Task[None]]] = {}
        self._master_joins = 0
        # What the nodes publish, for the reachability check at each join.
        self._publishers = Publishers()
        membership.rejoiner = self

    @rpc
    async def Join(
        self, request: rendezvous_pb2.JoinRequest, context: Any
    ) -> rendezvous_pb2.JoinResponse:
        return await self._join(request.node_id, request.incarnation, request, None)

    async def _join(
        self,
        node_id: str,
        incarnation: int,
        request: rendezvous_pb2.JoinRequest,
        answered_round: int | None,
    ) -> rendezvous_pb2.JoinResponse:
        """Until `node_id` is a member of a formed round: its place in it."""
        self.state.nodes.live(node_id, incarnation)
        self.state.breaker.check_open()  # a job in a restart loop takes no round
        rdzv = self.state.rendezvous
        await self._refuse_unreachable(node_id, request.host)
        events = rdzv.join(
            node_id,
            request.local_world_size,
            request.host,
            request.bootstrap_port,
            self.clock(),
            keeper_address=request.keeper_address,
            answered_round=answered_round,
        )
        await self.membership.apply(events)
        return await self._round_of(node_id)

    async def _refuse_unreachable(self, node_id: str, host: str) -> None:
        """A loopback address published while the job's nodes are on several
        machines (`core.reachability`): the joiner is refused, and so are the
        nodes waiting with one, so that no such round forms."""
        rdzv, seen = self.state.rendezvous, self.state.seen_from
        self._publishers.joined(node_id, Published(host, seen.get(node_id, "")))

        def present(other: str) -> bool:
            active = rdzv.state.active
            return (
                other == node_id
                or other in rdzv.state.waiting
                or (active is not None and active.member(other) is not None)
            )

        if not self._publishers.may_refuse(present):
            return  # no loopback publisher, or one machine: nothing to refuse
        nodes = {
            p.node_id: Published(p.host, seen.get(p.node_id, ""))
            for p in rdzv.state.waiting.values()
        }
        if rdzv.state.active is not None:
            nodes.update(
                (m.node_id, Published(m.host, seen.get(m.node_id, "")))
                for m in rdzv.state.active.members
            )
        nodes[node_id] = Published(host, seen.get(node_id, ""))
        refused = unreachable(nodes)
        events: list[RendezvousEvent] = []
        for other, why in refused.items():
            if other != node_id and other in rdzv.state.waiting:
                _log.error("%s", why)
                events += rdzv.remove(other, why, self.clock(), close_round=False)
        await self.membership.apply(events)
        if node_id in refused:
            _log.error("%s", refused[node_id])
            raise InvalidArgument(refused[node_id])

    async def _round_of(self, node_id: str) -> rendezvous_pb2.JoinResponse:
        """Until the waiting `node_id` is a member of a formed round."""
        rdzv = self.state.rendezvous
        while True:
            round_ = rdzv.assignment(node_id)
            if round_ is not None:
                return join_answer(round_, node_id)
            if node_id not in rdzv.state.waiting:
                why = rdzv.state.dropped.get(node_id, "it left the rendezvous")
                if why.startswith(TRAINING_DONE_REFUSAL):
                    raise TrainingDone(why)
                raise StaleError(f"join of {node_id} failed: {why}")
            await self.membership.news_for(node_id)

    async def Session(
        self, request_iterator: AsyncIterator[rendezvous_pb2.SessionMessage], context: Any
    ) -> AsyncIterator[rendezvous_pb2.SessionEvent]:
        """Opened by the agent before it joins; lives as long as the agent.
        The agent joins on it too (`SessionMessage.join`): at thousands of
        nodes a message on a stream that is open anyway costs the master a
        fraction of a call of its own."""
        first = await anext(aiter(request_iterator), None)
        if first is None:
            return
        node_id, incarnation = first.node_id, first.incarnation
        try:
            self.state.nodes.live(node_id, incarnation)
        except DlfleetError as error:
            await context.abort(status_of(error), str(error))
        seen = peer_host(context.peer())
        if seen:
            self.state.seen_from[node_id] = seen
        # None: the agent's side of the stream ended.
        queue: asyncio.Queue[rendezvous_pb2.SessionEvent | None] = asyncio.Queue()
        self.membership.sessions[node_id] = queue
        missed = self._missed_close(node_id, first.round)
        if missed is not None:
            queue.put_nowait(missed)
        joins: set[asyncio.Task[None]] = set()
        self._joins[node_id] = joins
        reader = asyncio.create_task(
            self._read_session(request_iterator, first, node_id, incarnation, queue, joins)
        )
        try:
            while (event := await queue.get()) is not None:
                yield event
        finally:
            # Also when the RPC itself is cancelled (the master stopping).
            reader.cancel()
            for join in list(joins):
                join.cancel()
            if self.membership.sessions.get(node_id) is queue:
                del self.membership.sessions[node_id]
                self._last_join.pop(node_id, None)
            if self._joins.get(node_id) is joins:
                del self._joins[node_id]
            self.metrics.pop(node_id, None)
            self.reports.remove(node_id)
            await self._session_ended(node_id, incarnation)

    def _missed_close(self, node_id: str, round_: int) -> rendezvous_pb2.SessionEvent | None:
        """The push a session that opens may have missed: its agent says it
        is in `round_`, which closed while it had no session (its link was
        down, or this master was restarting and another node re-joined
        first), and it is not waiting for the next. A round closes only for
        the sessions open then; without this the node's workers would wait
        in a collective on peers that left until something fails."""
        if round_ <= 0:
            return None
        rendezvous = self.state.rendezvous.state
        active = rendezvous.active
        if node_id in rendezvous.waiting or round_ > rendezvous.last_round:
            return None  # waiting already, or a round this job never formed
        if active is not None and active.round == round_ and active.member(node_id) is not None:
            return None
        _log.info("round %d closed while the session of %s was down: telling it", round_, node_id)
        return rendezvous_pb2.SessionEvent(
            re_rendezvous=rendezvous_pb2.ReRendezvous(
                closed_round=round_,
                reason=f"round {round_} closed while this node's session was down",
            )
        )

    async def _read_session(
        self,
        messages: AsyncIterator[rendezvous_pb2.SessionMessage],
        first: rendezvous_pb2.SessionMessage,
        node_id: str,
        incarnation: int,
        queue: asyncio.Queue[rendezvous_pb2.SessionEvent | None],
        joins: set[asyncio.Task[None]],
    ) -> None:
        """Every message is a heartbeat; one with `join` is a join too."""
        try:
            # A stream that breaks (or a stale beat) ends the session.
            with contextlib.suppress(Exception):
                self._heard(first, node_id, incarnation, queue, joins)
                async for message in messages:
                    self._heard(message, node_id, incarnation, queue, joins)
        finally:
            queue.put_nowait(None)

    def _heard(
        self,
        message: rendezvous_pb2.SessionMessage,
        node_id: str,
        incarnation: int,
        queue: asyncio.Queue[rendezvous_pb2.SessionEvent | None],
        joins: set[asyncio.Task[None]],
    ) -> None:
        now = self.clock()
        self.state.nodes.heartbeat(node_id, incarnation, now)
        if message.HasField("metrics"):
            self.metrics[node_id] = (message.metrics, now)
            self.reports.update(node_id, message.metrics, now)
            self.membership.heard_metrics(node_id, message.round, message.metrics, now)
        if message.restarts_in_place:
            self.state.restarts_in_place = True
        if message.next_bootstrap_port:
            last = self._last_join.get(node_id)
            if last is not None and message.next_bootstrap_port != last.bootstrap_port:
                last.next_bootstrap_port = message.next_bootstrap_port
        if message.HasField("join"):
            join = asyncio.create_task(
                self._session_join(node_id, incarnation, message.join_id, message.join, queue)
            )
            joins.add(join)
            join.add_done_callback(joins.discard)

    async def _session_join(
        self,
        node_id: str,
        incarnation: int,
        join_id: int,
        request: rendezvous_pb2.JoinRequest,
        queue: asyncio.Queue[rendezvous_pb2.SessionEvent | None],
    ) -> None:
        """A join sent on the session, answered on it."""
        try:
            if request.node_id not in ("", node_id) or request.incarnation not in (0, incarnation):
                raise InvalidArgument(
                    f"a join on the session of {node_id} (incarnation {incarnation}) names "
                    f"{request.node_id} (incarnation {request.incarnation})"
                )
            last = rendezvous_pb2.JoinRequest()
            last.CopyFrom(request)
            last.node_id, last.incarnation = node_id, incarnation
            self._last_join[node_id] = last
            answer = await self._join(node_id, incarnation, request, request.answered_round)
            joined = rendezvous_pb2.SessionJoined(join_id=join_id, answer=answer)
        except DlfleetError as error:
            joined = join_failed(join_id, error)
        queue.put_nowait(rendezvous_pb2.SessionEvent(joined=joined))

    def can_rejoin(self, node_id: str) -> bool:
        last = self._last_join.get(node_id)
        return last is not None and last.next_bootstrap_port != 0

    def rejoin(self, node_id: str) -> tuple[int, list[RendezvousEvent]]:
        """Join a survivor of a closed round into the next one, as its agent
        would on being told (with its last join on the session and its spare
        port): at ten thousand nodes a join per survivor is a third of the
        messages a re-formation costs. (The join id for its push, its events);
        (0, []) when the node must join itself: no session join on record,
        or no unused spare port (a round's store may still hold the last)."""
        last = self._last_join.get(node_id)
        joins = self._joins.get(node_id)
        queue = self.membership.sessions.get(node_id)
        if last is None or joins is None or queue is None or not last.next_bootstrap_port:
            return 0, []
        if self.state.breaker.broken is not None:
            return 0, []  # its own join is refused with the diagnosis
        rdzv = self.state.rendezvous
        if node_id in rdzv.state.waiting or rdzv.assignment(node_id) is not None:
            # It joined already (its own join closed the round), or is in a
            # round formed since (by the events that closed this one).
            return 0, []
        try:
            self.state.nodes.live(node_id, last.incarnation)
            events = self.state.rendezvous.join(
                node_id,
                last.local_world_size,
                last.host,
                last.next_bootstrap_port,
                self.clock(),
                keeper_address=last.keeper_address,
            )
        except DlfleetError as error:
            _log.warning("could not join %s into the next round: %s", node_id, error)
            return 0, []
        last.bootstrap_port, last.next_bootstrap_port = last.next_bootstrap_port, 0
        self._master_joins += 1
        return -self._master_joins, events

    def answer(self, node_id: str, join_id: int) -> rendezvous_pb2.JoinResponse | None:
        round_ = self.state.rendezvous.assignment(node_id)
        if round_ is not None:
            return join_answer(round_, node_id)
        joins = self._joins.get(node_id)
        queue = self.membership.sessions.get(node_id)
        if joins is not None and queue is not None:
            answer = asyncio.create_task(self._answer(node_id, join_id, queue))
            joins.add(answer)
            answer.add_done_callback(joins.discard)
        return None

    async def _answer(
        self,
        node_id: str,
        join_id: int,
        queue: asyncio.Queue[rendezvous_pb2.SessionEvent | None],
    ) -> None:
        """The answer to a join the master made for `node_id`, on its session."""
        try:
            answer = await self._round_of(node_id)
            joined = rendezvous_pb2.SessionJoined(join_id=join_id, answer=answer)
        except DlfleetError as error:
            joined = join_failed(join_id, error)
        queue.put_nowait(rendezvous_pb2.SessionEvent(joined=joined))

    async def _session_ended(self, node_id: str, incarnation: int) -> None:
        """A session that ends while its node is live means the agent died
        (or its link did): its round closes now, not after a timeout."""
        if self.membership.stopping:
            return  # the master is going down, not the agent
        try:
            self.state.nodes.live(node_id, incarnation)
        except StaleError:
            return  # it left cleanly, or a newer incarnation took over
        _log.warning("node %s lost its session: dropping it", node_id)
        await asyncio.shield(self.membership.node_lost(node_id, "lost its session", died=True))

    @rpc
    async def Leave(
        self, request: rendezvous_pb2.LeaveRequest, context: Any
    ) -> rendezvous_pb2.LeaveResponse:
        record = self.state.nodes.live(request.node_id, request.incarnation)
        reason = request.reason or "left"
        if reason == "succeeded":
            # Its workers are done: it leaves without disturbing the others,
            # who may still be finishing their last steps.
            await self.membership.node_finished(record.node_id, reason)
        else:
            await self.membership.node_lost(record.node_id, reason)
        return rendezvous_pb2.LeaveResponse()

    @rpc
    async def ReportFailure(
        self, request: rendezvous_pb2.FailureReport, context: Any
    ) -> rendezvous_pb2.ReportFailureResponse:
        self.state.nodes.live(request.node_id, request.incarnation)
        members: dict[str, str] = {}
        if request.round:
            active = self.state.rendezvous.check_member(request.node_id, request.round)
            members = active.hosts
        if request.local_rank < 0:
            raise InvalidArgument(f"local_rank must be >= 0, got {request.local_rank}")
        named: tuple[str, ...] = ()
        if members:
            named = self.state.suspicion.failed(
                request.round, request.node_id, request.category, request.message, members
            )
        self.failures.append(request)
        self.membership.metrics.worker_failed(request)
        if request.round:
            await self._breaker_heard(request, members)
        current = self.state.rendezvous.state.active
        if current is None or request.round in (0, current.round):
            hung = failure_reason_label(request) == "hang"
            detected = Cause.HANG_DETECTION if hung else Cause.RESTART
            self.membership.goodput.interrupted(detected, Cause.RESTART, self.clock())
        self.membership.timeline.record(
            EventKind.WORKER_FAILED,
            self.clock(),
            node_id=request.node_id,
            round=request.round,
            local_rank=request.local_rank,
            global_rank=request.global_rank,
            exit_code=request.exit_code,
            signal=request.signal,
            reason=failure_reason_label(request),
            restart_count=request.restart_count,
            rule=request.rule,
            category=request.category,
            action=request.action,
            message=request.message.strip().splitlines()[-1][:500]
            if request.message.strip()
            else "",
            **({"names": list(named)} if named else {}),
        )
        _log.error(
            "worker failed on %s (round %d, local rank %d, exit %d%s): %s",
            request.node_id,
            request.round,
            request.local_rank,
            request.exit_code,
            f", {request.signal}" if request.signal else "",
            request.message.strip().splitlines()[-1] if request.message.strip() else "",
        )
        return rendezvous_pb2.ReportFailureResponse()

    async def _breaker_heard(
        self, request: rendezvous_pb2.FailureReport, members: dict[str, str]
    ) -> None:
        """The restart-loop breaker hears the failure of a round; once it
        breaks, its diagnosis is the job's last failure (what the job
        supervisor gives as the root cause)."""
        state = self.state
        breaker, table = state.breaker, state.checkpoints
        events = breaker.failed(
            request.round,
            table.committed_in_round(request.round),
            request.message,
            leased_in_round(state.book, request.round, members),
            table.held_below,
        )
        await self.membership.executor.commit(events)
        if events and breaker.broken is not None:
            _log.error("%s", breaker.broken.describe())
            self.failures.append(loop_failure(request, breaker.broken.describe()))

    @rpc
    async def GetState(
        self, request: rendezvous_pb2.RendezvousStateRequest, context: Any
    ) -> rendezvous_pb2.RendezvousStateResponse:
        state = self.state.rendezvous.state
        active = state.active
        members = active.members if active and not request.waiting_only else ()
        return rendezvous_pb2.RendezvousStateResponse(
            round=active.round if active else 0,
            num_nodes_waiting=len(state.waiting),
            waiting=self.state.rendezvous.why_waiting(self.clock()),
            members=[m.node_id for m in members],
            last_round=state.last_round,
            local_world_sizes=[m.local_world_size for m in members],
            keeper_addresses=[m.keeper_address for m in members],
        )


def join_answer(round_: Round, node_id: str) -> rendezvous_pb2.JoinResponse:
    """`node_id`'s place in `round_`: O(1) (the round's O(N) sums are built
    once per round), so that a round of N members costs O(N) to answer."""
    member = round_.member(node_id)
    assert member is not None
    return rendezvous_pb2.JoinResponse(
        round=round_.round,
        group_rank=member.group_rank,
        group_world_size=round_.world_size,
        bootstrap_host=round_.bootstrap_host,
        bootstrap_port=round_.bootstrap_port,
        world_size=round_.world_processes,
        rank_offset=round_.rank_offset(member),
        local_world_size=member.local_world_size,
        keeper_peer=round_.keeper_peer(member),
        local_world_size_runs=[
            rendezvous_pb2.SizeRun(size=size, count=count) for size, count in round_.size_runs
        ],
    )


def loop_failure(
    request: rendezvous_pb2.FailureReport, diagnosis: str
) -> rendezvous_pb2.FailureReport:
    """The failure that broke a restart loop, as the rule table diagnoses it."""
    verdict = diagnose(FailureFacts(restart_loop=True))
    failure = rendezvous_pb2.FailureReport()
    failure.CopyFrom(request)
    failure.message = diagnosis
    failure.rule, failure.category = verdict.rule, verdict.category.value
    failure.action = verdict.action.value
    return failure


def join_failed(join_id: int, error: DlfleetError) -> rendezvous_pb2.SessionJoined:
    """The answer to a join on the session that failed: its error as the
    `Join` call would have raised it."""
    return rendezvous_pb2.SessionJoined(
        join_id=join_id,
        error=shards_pb2.StreamError(
            code=status_number(error), message=bounded_details(str(error))
        ),
    )
