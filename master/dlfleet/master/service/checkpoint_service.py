"""The Checkpoints gRPC service: agents report the copies of in-memory
checkpoint images they hold, restores ask for the newest restorable step.

Decode, validate, decide in `CheckpointTable`, commit (`Executor.commit`: one
journal append), answer: an answer leaves only once the events it reflects are
durable, so a master restarted on the same store never answers an older
`Latest` than one it already gave. A
report must come from a live node incarnation and name a round that has
formed; a stale round is not an error (the table ignores it).

`Latest` obeys the restart-loop breaker (`core.restart_loop`): under a
ceiling it answers only older steps and says the ceiling (`below_step`), and
the first answer a round gets is the step that round restored.

Lives in the master service process.
"""

from __future__ import annotations

from typing import Any

from dlfleet.api.errors import InvalidArgument
from dlfleet.api.serving.answers import rpc
from dlfleet.api.v1 import checkpoint_pb2, checkpoint_pb2_grpc
from dlfleet.master.core.checkpoints import (
    NONE,
    CheckpointView,
    validate_persisted,
    validate_report,
)
from dlfleet.master.core.restart_loop import BreakerEvent
from dlfleet.master.service import wire
from dlfleet.master.service.executor import Executor
from dlfleet.master.service.membership import Membership
from dlfleet.master.service.state import MasterState


class CheckpointsService(checkpoint_pb2_grpc.CheckpointsServicer):
    def __init__(
        self, state: MasterState, executor: Executor, membership: Membership | None = None
    ) -> None:
        self.state = state
        self.commit = executor.commit
        self.membership = membership  # tells the round's nodes what a report moved

    def _check_formed(self, round_: int) -> None:
        last = self.state.rendezvous.state.last_round
        if round_ > last:
            raise InvalidArgument(
                f"round {round_} has not formed (the latest round is {last or 'none yet'})"
            )

    @rpc
    async def Report(
        self, request: checkpoint_pb2.CheckpointReport, context: Any
    ) -> checkpoint_pb2.CheckpointReportResponse:
        report = wire.checkpoint_report_from_wire(request)
        validate_report(report)
        self._check_formed(report.round)
        self.state.nodes.live(request.node_id, request.incarnation)
        answer, events = self.state.checkpoints.report(report)
        reached = self.state.checkpoints.committed_in_round(report.round)
        await self.commit([*events, *self.state.breaker.progress(report.round, reached)])
        if self.membership is not None:
            self.membership.tell_checkpoint_progress(
                report.round,
                answer.committed_step,
                answer.replicated_step,
                answer.replica_step,
                request.node_id,
            )
        return checkpoint_pb2.CheckpointReportResponse(
            committed_step=answer.committed_step,
            replicated_step=answer.replicated_step,
            replica_step=answer.replica_step,
        )

    @rpc
    async def Latest(
        self, request: checkpoint_pb2.LatestCheckpointRequest, context: Any
    ) -> checkpoint_pb2.CheckpointRecord:
        breaker, table = self.state.breaker, self.state.checkpoints
        view = table.latest(breaker.below(request.before_step))
        events: list[BreakerEvent] = []
        active = self.state.rendezvous.state.active
        if request.before_step == 0 and active is not None:
            events = breaker.restored(active.round, self._restored_step(view))
        await self.commit(events)  # what it read is durable before it is told
        record = wire.checkpoint_record_to_wire(view)
        record.below_step = breaker.ceiling or 0
        if view is None and request.before_step == 0 and breaker.ceiling is None:
            record.lost_step = max(0, table.lost_step())
        return record

    def _restored_step(self, view: CheckpointView | None) -> int:
        """What a round told `view` restores: that step, else the persisted
        step its ranks then read from disk (when under the ceiling)."""
        if view is not None:
            return view.step
        persisted = self.state.checkpoints.persisted
        ceiling = self.state.breaker.ceiling
        if persisted is not None and (ceiling is None or persisted.step < ceiling):
            return persisted.step
        return NONE

    @rpc
    async def Persisted(
        self, request: checkpoint_pb2.PersistedReport, context: Any
    ) -> checkpoint_pb2.PersistedResponse:
        persisted = wire.persisted_from_wire(request)
        validate_persisted(persisted)
        self._check_formed(persisted.round)
        await self.commit(self.state.checkpoints.report_persisted(persisted))
        return checkpoint_pb2.PersistedResponse()

    @rpc
    async def Status(
        self, request: checkpoint_pb2.CheckpointStatusRequest, context: Any
    ) -> checkpoint_pb2.CheckpointStatus:
        return wire.checkpoint_status_to_wire(self.state.checkpoints.status())
