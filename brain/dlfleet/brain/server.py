"""The brain's gRPC service (what `dlbrain` runs): `Brain` plus the standard
`grpc.health.v1` health service, on a thread pool.

Every RPC but the health check carries the token (constant-time compare;
UNAUTHENTICATED otherwise, before the request is read). Domain errors become
status codes in `answer`; a request that does not parse is INVALID_ARGUMENT.
All three are `dlfleet.api.serving`'s, as on the master.
"""

from __future__ import annotations

from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dlfleet.api.errors import DlfleetError, InvalidArgument
from dlfleet.api.serving.answers import answer
from dlfleet.api.serving.guard import RequestGuard
from dlfleet.api.serving.tls import TlsPair, server_credentials
from dlfleet.api.serving.tokens import TokenCheck
from dlfleet.api.v1 import brain_pb2, brain_pb2_grpc
from dlfleet.brain import wire
from dlfleet.brain.api import BrainApi
from dlfleet.brain.records import PlanId


class BrainService(brain_pb2_grpc.BrainServicer):
    def __init__(self, brain: BrainApi) -> None:
        self.brain = brain

    @answer
    def PersistMetrics(
        self, request: brain_pb2.PersistMetricsRequest, context: Any
    ) -> brain_pb2.PersistMetricsResponse:
        self.brain.persist(wire.batch_from_wire(request))
        return brain_pb2.PersistMetricsResponse()

    @answer
    def Plan(self, request: brain_pb2.PlanRequest, context: Any) -> brain_pb2.BrainPlan:
        return wire.plan_to_wire(self.brain.plan(wire.plan_request_from_wire(request)))

    @answer
    def MarkApplied(
        self, request: brain_pb2.MarkAppliedRequest, context: Any
    ) -> brain_pb2.BrainPlan:
        return wire.plan_to_wire(self.brain.mark_applied(PlanId(request.plan_id)))

    @answer
    def GetReport(self, request: brain_pb2.GetReportRequest, context: Any) -> brain_pb2.BrainReport:
        if not request.job_name:
            raise InvalidArgument("job_name is empty")
        return wire.report_to_wire(self.brain.report(request.job_name))


class BrainServer:
    """`Brain` and the health service on `host:port` (0: any free port)."""

    def __init__(
        self,
        brain: BrainApi,
        *,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        max_workers: int = 8,
        tls: TlsPair | None = None,
    ) -> None:
        """`tls`: (certificate chain PEM, private key PEM) to serve TLS only."""
        if not token:
            raise InvalidArgument("the brain service needs a non-empty token")
        self.brain = brain
        self._address = f"{host}:{port}"
        self._token = token
        self._max_workers = max_workers
        self._tls = tls
        self._server: grpc.Server | None = None
        self._health = health.HealthServicer()
        self.host = host
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> int:
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix="brain"),
            interceptors=[TokenCheck(self._token, "missing or wrong token"), RequestGuard()],
            options=[("grpc.so_reuseport", 0)],
        )
        brain_pb2_grpc.add_BrainServicer_to_server(BrainService(self.brain), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        if self._tls is not None:
            port = server.add_secure_port(self._address, server_credentials(self._tls))
        else:
            port = server.add_insecure_port(self._address)
        if port == 0:
            raise DlfleetError(f"could not bind the brain to {self._address}")
        server.start()
        for name in ("", wire.SERVICE_NAME):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server, self.port = server, port
        return port

    def wait(self, timeout_s: float | None = None) -> bool:
        """True once the server has stopped."""
        assert self._server is not None, "wait before start"
        return bool(self._server.wait_for_termination(timeout_s))

    def stop(self, grace_s: float = 1.0) -> None:
        if self._server is None:
            return
        self._health.enter_graceful_shutdown()
        self._server.stop(grace_s).wait()
