"""The master's gRPC server: a thin adapter from RPCs to `MasterState`.

Every handler runs on one asyncio loop, so the cores need no lock: decode the
request, let the core decide (and apply), hand the events to the `Executor`
(one journal append), and answer only once they are durable
(`service/executor.py`). A rejected request raises a DlfleetError before any
event is applied; it is answered with the status code from `dlfleet.api.status`
and changes nothing.

Lives in the master service process. The token check, the request guard and
the TLS pair are `dlfleet.api.serving`'s, shared with the job supervisor and
the brain.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dlfleet.api.addresses import peer_host
from dlfleet.api.errors import DlfleetError, InvalidArgument
from dlfleet.api.serving.answers import bounded_details, rpc
from dlfleet.api.serving.guard import AsyncRequestGuard
from dlfleet.api.serving.ports import Endpoint, check_port_free
from dlfleet.api.serving.tls import TlsPair, server_credentials
from dlfleet.api.serving.tokens import AsyncTokenCheck
from dlfleet.api.status import status_number
from dlfleet.api.status_document import status_document
from dlfleet.api.v1 import (
    checkpoint_pb2_grpc,
    job_pb2,
    job_pb2_grpc,
    nodecheck_pb2_grpc,
    nodes_pb2,
    nodes_pb2_grpc,
    rendezvous_pb2_grpc,
    shards_pb2,
    shards_pb2_grpc,
)
from dlfleet.master.core.node_range import judge_range, requested_range
from dlfleet.master.core.shards import RoundConsumer
from dlfleet.master.service import wire
from dlfleet.master.service.checkpoint_service import CheckpointsService
from dlfleet.master.service.executor import Decision, Executor
from dlfleet.master.service.http_api import HttpEndpoint, HttpSettings
from dlfleet.master.service.membership import Membership
from dlfleet.master.service.metrics import (
    GoodputCollector,
    MasterMetrics,
    RpcMetrics,
    StateCollector,
)
from dlfleet.master.service.node_check_service import NodeCheckService
from dlfleet.master.service.rendezvous_service import RendezvousService
from dlfleet.master.service.rpc import Clock, Durable, system_clock
from dlfleet.master.service.state import MasterState
from dlfleet.master.service.status_service import (
    MasterStatusService,
    SupervisorView,
    job_status,
)
from dlfleet.master.service.timeline import EventKind, Timeline

_log = logging.getLogger(__name__)
# How late the ticker may wake without it counting as a stall of the loop:
# a busy loop's ordinary latency, in which beats are still heard, at least
# this and a twentieth of the heartbeat timeout (a delay that much shorter
# than the timeout cannot cost a node its place). Only the lateness beyond
# it is credited to the nodes: crediting all of it, a loop late by 25 ms a
# tick under load put off a dead node's drop by 1.5 s.
STALL_SLACK_MS = 100
# A stall of the master's loop this long is worth a warning (shorter ones are
# credited to the nodes silently).
STALL_WARNING_MS = 1000

SERVICE_NAMES = (
    "dlfleet.api.v1.Shards",
    "dlfleet.api.v1.Nodes",
    "dlfleet.api.v1.Rendezvous",
    "dlfleet.api.v1.Master",
    "dlfleet.api.v1.Checkpoints",
    "dlfleet.api.v1.NodeCheck",
)
MAX_PENDING_CALLS = 100_000
# How often the goodput ledger is written to the journal (when it changed):
# what a killed master's successor may not know of the last events it heard.
GOODPUT_WRITE_MS = 2_000


class _Handlers:
    def __init__(self, state: MasterState, clock: Clock, membership: Membership) -> None:
        self.state = state
        self.clock = clock
        self.membership = membership
        # `await self.commit(events)`: the events written, in one append.
        self.commit = membership.executor.commit


class ShardsService(shards_pb2_grpc.ShardsServicer, _Handlers):
    @rpc
    async def RegisterDataset(
        self, request: shards_pb2.RegisterDatasetRequest, context: Any
    ) -> shards_pb2.RegisterDatasetResponse:
        config = wire.config_from_spec(request.spec)
        created, events = self.state.book.register(config)
        await self.commit(events)
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
                code = status_number(error)
                response = shards_pb2.LeaseResponse(
                    error=shards_pb2.StreamError(code=code, message=bounded_details(str(error)))
                )
            yield response

    async def _lease(self, request: shards_pb2.LeaseRequest) -> shards_pb2.LeaseResponse:
        start = time.perf_counter()
        consumer = wire.consumer_from_request(request)
        if request.count > 1 and isinstance(consumer, RoundConsumer):
            outcomes, events = self.state.book.lease_run(
                request.dataset, consumer, request.count, self.clock(), request.done
            )
        else:
            outcome, events = self.state.book.lease(
                request.dataset, consumer, self.clock(), request.request_id, request.done
            )
            outcomes = [outcome]
        await self.commit(events)
        self.membership.metrics.leased(time.perf_counter() - start, acked=bool(request.done))
        return wire.lease_response(*outcomes)

    @rpc
    async def Renew(
        self, request: shards_pb2.RenewRequest, context: Any
    ) -> shards_pb2.RenewResponse:
        start = time.perf_counter()
        deadline, events = self.state.book.renew(
            request.dataset, request.lease_id, request.round, request.consumed, self.clock()
        )
        await self.commit(events)
        self.membership.metrics.renewed(time.perf_counter() - start)
        return shards_pb2.RenewResponse(deadline_unix_ms=deadline)

    @rpc
    async def Report(
        self, request: shards_pb2.ReportRequest, context: Any
    ) -> shards_pb2.ReportResponse:
        start = time.perf_counter()
        now = self.clock()
        report = wire.lease_report_from_wire(request)
        duplicate = False
        if report.done:
            duplicate, events = self.state.book.report_done(
                report.dataset, report.lease_id, report.round, now
            )
        else:
            events = self.state.book.report_failure(
                report.dataset, report.lease_id, report.round, report.consumed, report.reason, now
            )
        await self.commit(events)
        if report.done:
            self.membership.metrics.acked(time.perf_counter() - start)
        return shards_pb2.ReportResponse(duplicate=duplicate)

    @rpc
    async def Snapshot(
        self, request: shards_pb2.SnapshotRequest, context: Any
    ) -> shards_pb2.DatasetSnapshot:
        progress = [(p.lease_id, p.consumed) for p in request.progress]
        snap, events = self.state.book.snapshot(
            request.dataset, request.round, progress, self.clock()
        )
        await self.commit(events)
        return wire.snapshot_to_wire(snap)

    @rpc
    async def Restore(
        self, request: shards_pb2.RestoreRequest, context: Any
    ) -> shards_pb2.RestoreResponse:
        snap = wire.snapshot_from_wire(request.snapshot)
        applied, events = self.state.book.restore(snap, request.round, self.clock())
        await self.commit(events)
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
        nnodes_warning = self._judge_nnodes(request)
        record, events = self.state.nodes.register(
            request.node_name, request.local_world_size, request.host, self.clock(), pending=True
        )
        seen = peer_host(context.peer()) or ""

        async def registered() -> None:
            if seen:
                self.state.seen_from[record.node_id] = seen
            self.membership.timeline.record(
                EventKind.NODE_REGISTERED,
                self.clock(),
                node_id=record.node_id,
                host=record.host,
                local_world_size=record.local_world_size,
            )

        decision = Decision([*events], [registered])
        *forgotten, registration = events
        if forgotten:
            # The live incarnation it replaces is lost in the same append:
            # written before the registration (replay forgets it first), said
            # after it.
            replaced = forgotten[0].node_id
            lost = self.membership.loss(replaced, "was replaced by a new incarnation", forgotten)
            decision = Decision([*lost.events, registration], [registered, *lost.effects])
        try:
            await self.membership.executor.carry_out(decision)
        finally:
            # The node cannot beat before it has this answer: its silence
            # starts now, not when the registration was applied (a busy
            # master's durable commit can take longer than a heartbeat timeout).
            self.state.nodes.answered(record.node_id, record.incarnation, self.clock())
        liveness = self.state.nodes.settings
        return nodes_pb2.RegisterNodeResponse(
            node_id=record.node_id,
            incarnation=record.incarnation,
            heartbeat_interval_ms=liveness.heartbeat_interval_ms,
            heartbeat_timeout_ms=liveness.heartbeat_timeout_ms,
            restarts_in_place=self.state.restarts_in_place,
            observed_host=seen,
            nnodes_warning=nnodes_warning,
            max_nodes=self.state.rendezvous.settings.max_nodes,
        )

    def _judge_nnodes(self, request: nodes_pb2.RegisterNodeRequest) -> str:
        """The node's --nnodes against this master's range (`core.node_range`):
        said in the master's log too, so that both sides show a mismatch."""
        try:
            requested = requested_range(request.min_nodes, request.max_nodes)
            warning = judge_range(requested, self.state.rendezvous.settings)
        except InvalidArgument as error:
            _log.warning("node %s refused: %s", request.node_name, error)
            raise
        if warning:
            _log.warning("node %s: %s", request.node_name, warning)
        return warning

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
        tls: TlsPair | None = None,
        metrics: MasterMetrics | None = None,
        http: HttpSettings | None = None,
    ) -> None:
        """`tls`: (certificate chain PEM, private key PEM) to serve TLS only
        (HTTPS too). `metrics`: where to count (a fresh registry if None).
        `http`: where to serve the HTTP endpoint (none if None)."""
        if not token:
            raise InvalidArgument("the master needs a non-empty job token")
        self.state = state
        self.clock = clock
        self._token = token
        self._host = host
        self._address = f"{host}:{port}"
        self._port = port
        # Expiry runs often enough that a silent node is dropped within its
        # heartbeat timeout plus a quarter of it, and at most 0.25 s after it
        # (each run looks only at what is overdue: heaps and heartbeat order).
        settings = state.settings
        every_ms = min(
            250, settings.shard.lease_timeout_ms // 4, settings.liveness.heartbeat_timeout_ms // 4
        )
        self._tick_s = (tick_ms or max(every_ms, 10)) / 1000
        self._stall_slack_ms = max(STALL_SLACK_MS, settings.liveness.heartbeat_timeout_ms // 20)
        self._server: grpc.aio.Server | None = None
        self._ticker: asyncio.Task[None] | None = None
        self.membership: Membership | None = None
        self.rendezvous: RendezvousService | None = None
        # The goodput ledger as last written, and when.
        self._goodput_written: dict[str, Any] | None = None
        self._goodput_written_ms = 0
        self._extra_services = extra_services
        self._tls = tls
        self.metrics = metrics if metrics is not None else MasterMetrics()
        self.timeline = Timeline()
        self.supervisor_view = SupervisorView(timeline=self.timeline)
        self._http_settings = http
        self.http: HttpEndpoint | None = None
        self.port = 0

    def _job_status(self) -> job_pb2.JobStatus:
        """/api/v1/status: this master's view, with the supervisor's facts."""
        assert self.rendezvous is not None
        now = self.clock()
        assert self.membership is not None
        goodput = self.membership.goodput.report()
        own = job_status(
            self.state, self.rendezvous.failures, self.rendezvous.reports, now, goodput
        )
        return self.supervisor_view.merge(own, now)

    async def start(self) -> int:
        """Listen; `PortInUse` when the port is taken (gRPC alone would log
        and raise a bare RuntimeError)."""
        check_port_free(Endpoint.GRPC, self._host, self._port)
        loop = asyncio.get_running_loop()
        executor = Executor(self.state.journal, Durable(loop))
        membership = Membership(self.state, self.clock, executor, self.metrics, self.timeline)
        self.state.committer.on_commit = self.metrics.committed
        self.state.journal.on_events = self.metrics.shard_events
        server = grpc.aio.server(
            interceptors=[
                RpcMetrics(self.metrics),
                AsyncTokenCheck(self._token),
                AsyncRequestGuard(),
            ],
            options=[
                ("grpc.so_reuseport", 0),
                # Clients ping every 10 s to notice a dead master on streams.
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
                ("grpc.http2.max_ping_strikes", 0),
                # Calls that arrived before the loop took them: gRPC refuses
                # those past 1,000 (RESOURCE_EXHAUSTED), which a fleet of
                # thousands joining at once exceeds. Room for every node's
                # session and join, a few times over.
                ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
                ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
                # ... and cancels those still untaken after 30 s (a burst of
                # thousands of joins on a busy loop): a join waits minutes anyway.
                ("grpc.server_max_unrequested_time_in_server", 600),
            ],
        )
        shards_pb2_grpc.add_ShardsServicer_to_server(
            ShardsService(self.state, self.clock, membership), server
        )
        nodes_pb2_grpc.add_NodesServicer_to_server(
            NodesService(self.state, self.clock, membership), server
        )
        self.rendezvous = RendezvousService(self.state, self.clock, membership)
        rendezvous_pb2_grpc.add_RendezvousServicer_to_server(self.rendezvous, server)
        self.metrics.watch(StateCollector(self.state, self.rendezvous.metrics, self.clock))
        self.metrics.watch(GoodputCollector(membership.goodput.report))
        job_pb2_grpc.add_MasterServicer_to_server(
            MasterStatusService(
                self.state,
                self.rendezvous.failures,
                self.rendezvous.reports,
                self.clock,
                on_supervisor=self.metrics.supervisor.reported,
                supervisor_view=self.supervisor_view,
                goodput=membership.goodput.report,
            ),
            server,
        )
        checkpoint_pb2_grpc.add_CheckpointsServicer_to_server(
            CheckpointsService(self.state, executor, membership), server
        )
        node_check = NodeCheckService(self.state, self.clock, membership)
        nodecheck_pb2_grpc.add_NodeCheckServicer_to_server(node_check, server)
        for add_service in self._extra_services:
            add_service(server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        try:
            if self._tls is not None:
                self.port = server.add_secure_port(self._address, server_credentials(self._tls))
            else:
                self.port = server.add_insecure_port(self._address)
        except RuntimeError:  # how gRPC says it bound no address
            self.port = 0
        if self.port == 0:
            raise DlfleetError(f"could not bind the master to {self._address}")
        await server.start()
        self._server = server
        if self._http_settings is not None:
            endpoint = HttpEndpoint(
                self._http_settings,
                token=self._token,
                registry=self.metrics.registry,
                status=lambda: status_document(self._job_status()),
                tls=self._tls,
                timeline=self.timeline,
            )
            try:
                await endpoint.start()
            except DlfleetError:
                await server.stop(0)
                raise
            self.http = endpoint
        for name in ("", *SERVICE_NAMES):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.membership = membership
        self._ticker = asyncio.create_task(self._tick_forever())
        self._timer = asyncio.create_task(membership.run_timer())
        self._check_timer = asyncio.create_task(node_check.run_timer())
        return self.port

    async def _tick_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            slept_at, clock_at = loop.time(), self.clock()
            await asyncio.sleep(self._tick_s)
            # Woken late: the loop was stalled, and no beat was heard meanwhile
            # (on both clocks: a test's clock moves only when told).
            late_ms = min(
                (loop.time() - slept_at - self._tick_s) * 1000,
                self.clock() - clock_at - self._tick_s * 1000,
            )
            if late_ms > self._stall_slack_ms:
                self.state.nodes.credit_stall(int(late_ms - self._stall_slack_ms))
                if late_ms >= STALL_WARNING_MS:
                    _log.warning(
                        "the master's loop stalled for %.1fs: no node's heartbeats are counted "
                        "missing for that time",
                        late_ms / 1000,
                    )
            await self.tick()

    async def tick(self) -> None:
        """Expire overdue leases and silent nodes, releasing what they held."""
        now = self.clock()
        membership = self.membership
        assert membership is not None, "tick before start"
        events = self.state.book.expire(now)
        if events:
            await membership.executor.commit(events)
        for forgotten in self.state.nodes.expire(now):
            _log.warning("node %s missed its heartbeats: dropping it", forgotten.node_id)
            loss = membership.loss(
                forgotten.node_id, "missed its heartbeats", [forgotten], died=True
            )
            await membership.executor.carry_out(loss)
        if now - self._goodput_written_ms >= GOODPUT_WRITE_MS:
            self._write_goodput(now)

    def _write_goodput(self, now_ms: int) -> None:
        """Journal the goodput ledger, if it changed since the last write
        (nothing before the job's first step: there is nothing to keep)."""
        self._goodput_written_ms = now_ms
        if self.state.goodput.opened_ms is None:
            return
        ledger = self.state.goodput.to_dict()
        if ledger != self._goodput_written:
            self.state.journal.record_goodput(ledger)
            self._goodput_written = ledger

    async def wait(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()

    async def stop(self, grace_s: float = 1.0) -> None:
        if self.membership is not None:
            self.membership.stopping = True
        if self._ticker is not None:
            self._ticker.cancel()
            self._timer.cancel()
            self._check_timer.cancel()
            self._write_goodput(self.clock())
        if self.http is not None:
            await self.http.stop()
        if self._server is not None:
            await self._server.stop(grace_s)
