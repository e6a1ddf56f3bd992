"""The Checkpoints gRPC service: agents report the copies of in-memory
checkpoint images they hold, restores ask for the newest restorable step.

Decode, validate, decide in `CheckpointTable`, persist, answer: an answer
leaves only once the events it reflects are durable, so a master restarted on
the same store never answers an older `Latest` than one it already gave. A
report must come from a live node incarnation and name a round that has
formed; a stale round is not an error (the table ignores it).

Lives in the master service process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dlfleet.api.errors import InvalidArgument
from dlfleet.api.serving.answers import rpc
from dlfleet.api.v1 import checkpoint_pb2, checkpoint_pb2_grpc
from dlfleet.master.core.checkpoint_events import CheckpointEvent
from dlfleet.master.core.checkpoints import validate_persisted, validate_report
from dlfleet.master.service import wire
from dlfleet.master.service.rpc import Durable
from dlfleet.master.service.state import MasterState


class CheckpointsService(checkpoint_pb2_grpc.CheckpointsServicer):
    def __init__(self, state: MasterState, durable: Durable) -> None:
        self.state = state
        self.durable = durable

    async def _persist(self, events: Sequence[CheckpointEvent]) -> None:
        await self.durable.wait(self.state.persist_checkpoints(events))

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
        await self._persist(events)
        return checkpoint_pb2.CheckpointReportResponse(
            committed_step=answer.committed_step, replicated_step=answer.replicated_step
        )

    @rpc
    async def Latest(
        self, request: checkpoint_pb2.LatestCheckpointRequest, context: Any
    ) -> checkpoint_pb2.CheckpointRecord:
        view = self.state.checkpoints.latest(request.before_step)
        await self._persist(())  # what it read is durable before it is told
        return wire.checkpoint_record_to_wire(view)

    @rpc
    async def Persisted(
        self, request: checkpoint_pb2.PersistedReport, context: Any
    ) -> checkpoint_pb2.PersistedResponse:
        persisted = wire.persisted_from_wire(request)
        validate_persisted(persisted)
        self._check_formed(persisted.round)
        await self._persist(self.state.checkpoints.report_persisted(persisted))
        return checkpoint_pb2.PersistedResponse()

    @rpc
    async def Status(
        self, request: checkpoint_pb2.CheckpointStatusRequest, context: Any
    ) -> checkpoint_pb2.CheckpointStatus:
        return wire.checkpoint_status_to_wire(self.state.checkpoints.status())
