"""The NodeCheck gRPC service: a node's agent begins its pre-flight check, its
check process reports what it measured and waits (a long poll of at most
`POLL_S`) for its next order; a healthy node's side of a pair for a late
node is pushed on that node's session. Verdicts go to the timeline, the
metrics and the log; the status reads them from the board.

The board (`dlfleet.master.core.node_check`) lives in `MasterState`, in
memory only: a master restarted mid-check starts a fresh board (a new
`check_id`), and the nodes in the middle of a check start over on it.

Lives in the master service process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any, overload

from dlfleet.api.serving.answers import rpc
from dlfleet.api.v1 import nodecheck_pb2, nodecheck_pb2_grpc, rendezvous_pb2
from dlfleet.master.core.node_check import CheckFailed, Effect, PairDone
from dlfleet.master.core.node_check_verdict import Verdict
from dlfleet.master.service import wire
from dlfleet.master.service.membership import Membership
from dlfleet.master.service.rpc import Clock
from dlfleet.master.service.state import MasterState
from dlfleet.master.service.timeline import EventKind

_log = logging.getLogger(__name__)

POLL_S = 5.0  # the longest a Next waits before it answers "wait"


class _Lazy(Sequence[str]):
    """A list computed on first use: the helpers are O(N log N) to find, and
    the board asks for them only when it plans pairs for a cohort, not on
    every lost node of a thousand-node loss."""

    def __init__(self, compute: Callable[[], list[str]]) -> None:
        self._compute = compute

    @cached_property
    def _items(self) -> list[str]:
        return self._compute()

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...
    def __getitem__(self, index: int | slice) -> str | Sequence[str]:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)


class NodeCheckService(nodecheck_pb2_grpc.NodeCheckServicer):
    def __init__(self, state: MasterState, clock: Clock, membership: Membership) -> None:
        self.state = state
        self.board = state.node_checks
        self.clock = clock
        self.membership = membership
        self.changed = asyncio.Condition()
        self._kick = asyncio.Event()
        membership.lost_listeners.append(self.node_lost)

    def helpers(self) -> list[str]:
        """Nodes past their check, which can run a pair for a late node: live,
        with a session, and in the rendezvous (joined, or in the round)."""
        rdzv = self.state.rendezvous.state
        members = rdzv.active.members if rdzv.active is not None else ()
        joined = set(rdzv.waiting) | {m.node_id for m in members}
        live = {record.node_id for record in self.state.nodes.nodes.values()}
        return sorted(n for n in joined & live if n in self.membership.sessions)

    def lazy_helpers(self) -> Sequence[str]:
        return _Lazy(self.helpers)

    @rpc
    async def Begin(
        self, request: nodecheck_pb2.NodeCheckBeginRequest, context: Any
    ) -> nodecheck_pb2.NodeCheckBeginResponse:
        record = self.state.nodes.live(request.node_id, request.incarnation)
        host = request.host or record.host
        await self._apply(self.board.begin(record.node_id, host, self.clock(), self.lazy_helpers()))
        _log.info("node %s begins its node check", record.node_id)
        return nodecheck_pb2.NodeCheckBeginResponse(
            check_id=self.board.check_id,
            step_timeout_ms=self.board.settings.step_timeout_ms,
        )

    @rpc
    async def Next(
        self, request: nodecheck_pb2.NodeCheckReport, context: Any
    ) -> nodecheck_pb2.NodeCheckOrder:
        node_id = request.node_id
        self.state.nodes.live(node_id, request.incarnation)
        result = wire.check_result_from_wire(request)
        current = request.check_id == self.board.check_id
        now = self.clock()
        if request.helper:
            if current and isinstance(result, PairDone):
                effects = self.board.helper_report(node_id, result, now, self.lazy_helpers())
                await self._apply(effects)
            return nodecheck_pb2.NodeCheckOrder(
                check_id=self.board.check_id, wait=nodecheck_pb2.NodeCheckPoll()
            )
        if not current and not isinstance(result, CheckFailed):
            result = None  # measured for another master's board: measure again here
        effects = self.board.report(
            node_id,
            request.done_order if current else -1,
            result,
            now,
            host=request.host,
            store_port=request.store_port,
            helpers=self.lazy_helpers(),
        )
        await self._apply(effects)
        return await self._next_order(node_id, request.done_order if current else -1)

    async def _next_order(self, node_id: str, done: int) -> nodecheck_pb2.NodeCheckOrder:
        """The node's next order (one newer than `done`), or `wait` after
        POLL_S; raises NotFound if the node left the board meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + POLL_S
        check_id = self.board.check_id
        async with self.changed:
            while True:
                seq, order = self.board.order(node_id)
                if seq > done or isinstance(order, Verdict):
                    return wire.check_order_to_wire(seq, order, check_id)
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return wire.check_order_to_wire(seq, None, check_id)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), remaining)

    async def node_lost(self, node_id: str) -> None:
        await self._apply(self.board.node_lost(node_id, self.clock(), self.lazy_helpers()))

    async def _apply(self, effects: Sequence[Effect]) -> None:
        """Announce verdicts, push helper pairs, and wake the waiting polls."""
        for effect in effects:
            if isinstance(effect, Verdict):
                self._announce(effect)
                continue
            queue = self.membership.sessions.get(effect.helper)
            if queue is not None:
                order = wire.pair_order_to_wire(effect.order, self.board.check_id)
                queue.put_nowait(rendezvous_pb2.SessionEvent(node_check_pair=order))
                _log.info("node check: %s runs a pair with late node %s (pair %d)",
                          effect.helper, effect.order.peer, effect.order.pair)  # fmt: skip
        async with self.changed:
            self.changed.notify_all()
        self._kick.set()

    def _announce(self, verdict: Verdict) -> None:
        self.membership.metrics.node_checked(
            verdict.rule.value, verdict.faulty, verdict.took_ms / 1000
        )
        self.membership.timeline.record(
            EventKind.NODE_CHECKED,
            verdict.at_ms,
            node_id=verdict.node_id,
            verdict="faulty" if verdict.faulty else "healthy",
            rule=verdict.rule.value,
            reason=verdict.reason,
            compute_ms=round(verdict.compute_ms, 3),
            compute_reference_ms=round(verdict.compute_reference_ms, 3),
            pairs=[
                {"peer": p.peer, "outcome": p.outcome.value, "ms": round(p.allreduce_ms, 3)}
                for p in verdict.pairs
            ],
            pair_reference_ms=round(verdict.pair_reference_ms, 3),
            slow_factor=verdict.slow_factor,
            took_ms=verdict.took_ms,
            measure_ms=verdict.measure_ms,
        )
        # A healthy verdict is said by the node's agent, which acts on it;
        # a faulty one here too, where the node is retired.
        how = _log.warning if verdict.faulty else _log.debug
        how("node check: %s is %s (rule %s, %.2fs): %s", verdict.node_id,
            "faulty" if verdict.faulty else "healthy", verdict.rule.value,
            verdict.took_ms / 1000, verdict.reason)  # fmt: skip

    async def run_timer(self) -> None:
        """Expire overdue steps and form cohorts exactly when due."""
        while True:
            deadline = self.board.next_deadline()
            self._kick.clear()
            timeout = None if deadline is None else max(0, deadline - self.clock()) / 1000
            try:
                await asyncio.wait_for(self._kick.wait(), timeout)
            except asyncio.TimeoutError:
                await self._apply(self.board.tick(self.clock(), self.lazy_helpers()))
