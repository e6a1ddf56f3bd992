"""The master's gRPC server: a thin adapter from RPCs to `MasterState`.

Every handler runs on one asyncio loop, so the cores need no lock: decode the
request, let the core decide and apply, hand the events to the group committer,
and answer only once they are durable. A rejected request raises a DlfleetError
before any event is applied; it is answered with the status code from
`dlfleet.api.status` and changes nothing.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dlfleet.api.errors import DlfleetError, InvalidArgument
from dlfleet.api.status import TOKEN_METADATA_KEY, status_of
from dlfleet.api.v1 import (
    nodes_pb2,
    nodes_pb2_grpc,
    rendezvous_pb2_grpc,
    shards_pb2,
    shards_pb2_grpc,
)
from dlfleet.master import wire
from dlfleet.master.core.events import Event
from dlfleet.master.membership import Membership
from dlfleet.master.rendezvous_service import RendezvousService
from dlfleet.master.rpc import Clock, Durable, rpc, system_clock
from dlfleet.master.state import MasterState

_log = logging.getLogger(__name__)

SERVICE_NAMES = ("dlfleet.api.v1.Shards", "dlfleet.api.v1.Nodes", "dlfleet.api.v1.Rendezvous")


class _Handlers:
    def __init__(
        self, state: MasterState, clock: Clock, durable: Durable, membership: Membership
    ) -> None:
        self.state = state
        self.clock = clock
        self.durable = durable
        self.membership = membership

    async def persist(self, events: list[Event]) -> None:
        await self.durable.wait(self.state.persist(events))


class ShardsService(shards_pb2_grpc.ShardsServicer, _Handlers):
    @rpc
    async def RegisterDataset(
        self, request: shards_pb2.RegisterDatasetRequest, context: Any
    ) -> shards_pb2.RegisterDatasetResponse:
        config = wire.config_from_spec(request.spec)
        created, events = self.state.book.register(config)
        await self.persist(events)
        status = wire.status_to_wire(self.state.book.status(config.name))
        return shards_pb2.RegisterDatasetResponse(created=created, status=status)

    @rpc
    async def Lease(
        self, request: shards_pb2.LeaseRequest, context: Any
    ) -> shards_pb2.LeaseResponse:
        return await self._lease(request)

    async def LeaseStream(
        self, request_iterator: AsyncIterator[shards_pb2.LeaseRequest], context: Any
    ) -> AsyncIterator[shards_pb2.LeaseResponse]:
        """One answer per request, in order; a refused request is answered with
        its status code in the message and the stream stays open."""
        async for request in request_iterator:
            try:
                response = await self._lease(request)
            except DlfleetError as error:
                code = status_of(error).value[0]
                response = shards_pb2.LeaseResponse(
                    error=shards_pb2.StreamError(code=code, message=str(error))
                )
            yield response

    async def _lease(self, request: shards_pb2.LeaseRequest) -> shards_pb2.LeaseResponse:
        consumer = wire.consumer_from_request(request)
        outcome, events = self.state.book.lease(
            request.dataset, consumer, self.clock(), request.request_id, request.done
        )
        await self.persist(events)
        return wire.lease_response(outcome)

    @rpc
    async def Renew(
        self, request: shards_pb2.RenewRequest, context: Any
    ) -> shards_pb2.RenewResponse:
        deadline, events = self.state.book.renew(
            request.dataset, request.lease_id, request.round, request.consumed, self.clock()
        )
        await self.persist(events)
        return shards_pb2.RenewResponse(deadline_unix_ms=deadline)

    @rpc
    async def Report(
        self, request: shards_pb2.ReportRequest, context: Any
    ) -> shards_pb2.ReportResponse:
        now = self.clock()
        which = request.WhichOneof("result")
        duplicate = False
        if which == "done":
            duplicate, events = self.state.book.report_done(
                request.dataset, request.lease_id, request.round, now
            )
        elif which == "failure":
            events = self.state.book.report_failure(
                request.dataset,
                request.lease_id,
                request.round,
                request.failure.consumed,
                request.failure.reason,
                now,
            )
        else:
            raise InvalidArgument("report names no result: set `done` or `failure`")
        await self.persist(events)
        return shards_pb2.ReportResponse(duplicate=duplicate)

    @rpc
    async def Snapshot(
        self, request: shards_pb2.SnapshotRequest, context: Any
    ) -> shards_pb2.DatasetSnapshot:
        progress = [(p.lease_id, p.consumed) for p in request.progress]
        snap, events = self.state.book.snapshot(
            request.dataset, request.round, progress, self.clock()
        )
        await self.persist(events)
        return wire.snapshot_to_wire(snap)

    @rpc
    async def Restore(
        self, request: shards_pb2.RestoreRequest, context: Any
    ) -> shards_pb2.RestoreResponse:
        snap = wire.snapshot_from_wire(request.snapshot)
        applied, events = self.state.book.restore(snap, request.round, self.clock())
        await self.persist(events)
        return shards_pb2.RestoreResponse(applied=applied)

    @rpc
    async def GetDatasetStatus(
        self, request: shards_pb2.DatasetStatusRequest, context: Any
    ) -> shards_pb2.DatasetStatus:
        return wire.status_to_wire(self.state.book.status(request.dataset))


class NodesService(nodes_pb2_grpc.NodesServicer, _Handlers):
    @rpc
    async def Register(
        self, request: nodes_pb2.RegisterNodeRequest, context: Any
    ) -> nodes_pb2.RegisterNodeResponse:
        job = self.state.settings.job_name
        if request.job_name != job:
            raise InvalidArgument(
                f"node {request.node_name!r} belongs to job {request.job_name!r}; "
                f"this master runs job {job!r}"
            )
        previous = self.state.nodes.nodes.get(request.node_name)
        record = self.state.nodes.register(
            request.node_name, request.local_world_size, request.host, self.clock()
        )
        await self.durable.wait(self.state.persist_node(record))
        if previous is not None:
            await self.membership.node_lost(previous.node_id, "was replaced by a new incarnation")
        liveness = self.state.nodes.settings
        return nodes_pb2.RegisterNodeResponse(
            node_id=record.node_id,
            incarnation=record.incarnation,
            heartbeat_interval_ms=liveness.heartbeat_interval_ms,
            heartbeat_timeout_ms=liveness.heartbeat_timeout_ms,
        )

    @rpc
    async def Heartbeat(
        self, request: nodes_pb2.HeartbeatRequest, context: Any
    ) -> nodes_pb2.HeartbeatResponse:
        now = self.clock()
        self.state.nodes.heartbeat(request.node_id, request.incarnation, now)
        return nodes_pb2.HeartbeatResponse(server_time_unix_ms=now)

    @rpc
    async def Deregister(
        self, request: nodes_pb2.DeregisterNodeRequest, context: Any
    ) -> nodes_pb2.DeregisterNodeResponse:
        record = self.state.nodes.live(request.node_id, request.incarnation)
        await self.membership.node_lost(record.node_id, "deregistered")
        return nodes_pb2.DeregisterNodeResponse()


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Every RPC but the health check carries the job token (constant-time
    compare); without it the answer is UNAUTHENTICATED."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

        async def deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong job token")

        self._deny: grpc.RpcMethodHandler[Any, Any] = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        if handler_call_details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(given, self._token):
                    return await continuation(handler_call_details)
                break
        return self._deny


class MasterServer:
    """Binds the services on `host:port` (0 = any free port) and runs the
    periodic expiry of leases and nodes."""

    def __init__(
        self,
        state: MasterState,
        *,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        clock: Clock = system_clock,
        tick_ms: int | None = None,
        extra_services: Sequence[Callable[[grpc.aio.Server], None]] = (),
    ) -> None:
        if not token:
            raise InvalidArgument("the master needs a non-empty job token")
        self.state = state
        self.clock = clock
        self._token = token
        self._address = f"{host}:{port}"
        self._tick_s = (tick_ms or min(1000, state.settings.shard.lease_timeout_ms // 4)) / 1000
        self._server: grpc.aio.Server | None = None
        self._ticker: asyncio.Task[None] | None = None
        self.membership: Membership | None = None
        self.rendezvous: RendezvousService | None = None
        self._extra_services = extra_services
        self.port = 0

    async def start(self) -> int:
        loop = asyncio.get_running_loop()
        durable = Durable(loop)
        membership = Membership(self.state, self.clock, durable.wait)
        server = grpc.aio.server(
            interceptors=[TokenInterceptor(self._token)],
            options=[
                ("grpc.so_reuseport", 0),
                # Clients ping every 10 s to notice a dead master on streams.
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
                ("grpc.http2.max_ping_strikes", 0),
            ],
        )
        shards_pb2_grpc.add_ShardsServicer_to_server(
            ShardsService(self.state, self.clock, durable, membership), server
        )
        nodes_pb2_grpc.add_NodesServicer_to_server(
            NodesService(self.state, self.clock, durable, membership), server
        )
        self.rendezvous = RendezvousService(self.state, self.clock, durable, membership)
        rendezvous_pb2_grpc.add_RendezvousServicer_to_server(self.rendezvous, server)
        for add_service in self._extra_services:
            add_service(server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        self.port = server.add_insecure_port(self._address)
        if self.port == 0:
            raise DlfleetError(f"could not bind the master to {self._address}")
        await server.start()
        for name in ("", *SERVICE_NAMES):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        self._durable = durable
        self.membership = membership
        self._ticker = asyncio.create_task(self._tick_forever())
        self._timer = asyncio.create_task(membership.run_timer())
        return self.port

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(self._tick_s)
            await self.tick()

    async def tick(self) -> None:
        """Expire overdue leases and silent nodes, releasing what they held."""
        now = self.clock()
        events = self.state.book.expire(now)
        if events:
            await self._durable.wait(self.state.persist(events))
        assert self.membership is not None, "tick before start"
        for record in self.state.nodes.expire(now):
            _log.warning("node %s missed its heartbeats: dropping it", record.node_id)
            await self._durable.wait(self.state.persist_node(record, gone=True))
            await self.membership.node_lost(record.node_id, "missed its heartbeats")

    async def wait(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()

    async def stop(self, grace_s: float = 1.0) -> None:
        if self.membership is not None:
            self.membership.stopping = True
        if self._ticker is not None:
            self._ticker.cancel()
            self._timer.cancel()
        if self._server is not None:
            await self._server.stop(grace_s)
