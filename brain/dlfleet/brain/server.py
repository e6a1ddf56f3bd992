"""The brain's gRPC service (what `dlbrain` runs): `Brain` plus the standard
`grpc.health.v1` health service, on a thread pool.

Every RPC but the health check carries the token (constant-time compare;
UNAUTHENTICATED otherwise, before the request is read). Domain errors become
status codes in `_answer`, the one place; a request that does not parse is
INVALID_ARGUMENT. The approach follows the master's server, without importing
it (the master imports the brain, never the reverse).
"""

from __future__ import annotations

import functools
import hmac
import logging
from collections.abc import Callable
from concurrent import futures
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dlfleet.api.errors import DlfleetError, InvalidArgument
from dlfleet.api.status import TOKEN_METADATA_KEY, status_of
from dlfleet.api.v1 import brain_pb2, brain_pb2_grpc
from dlfleet.brain import wire
from dlfleet.brain.api import BrainApi
from dlfleet.brain.records import PlanId

_log = logging.getLogger(__name__)

_HEALTH = "/grpc.health.v1.Health/"
MAX_DETAILS_BYTES = 2_000  # status details past the client's metadata limit are refused

Req = TypeVar("Req")
Resp = TypeVar("Resp")


def bounded(details: str) -> str:
    raw = details.encode()
    if len(raw) <= MAX_DETAILS_BYTES:
        return details
    return raw[:MAX_DETAILS_BYTES].decode(errors="ignore") + f"... ({len(raw)} bytes in all)"


def _answer(
    handler: Callable[[Any, Req, grpc.ServicerContext], Resp],
) -> Callable[[Any, Req, grpc.ServicerContext], Resp]:
    """Map domain errors to status codes: the handlers raise, this answers."""

    @functools.wraps(handler)
    def wrapper(self: Any, request: Req, context: grpc.ServicerContext) -> Resp:
        try:
            return handler(self, request, context)
        except DlfleetError as error:
            if status_of(error) in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE):
                _log.warning("%s failed: %s", handler.__name__, error)
            context.abort(status_of(error), bounded(str(error)))
            raise  # abort raises; this line is never reached

    return wrapper


class BrainService(brain_pb2_grpc.BrainServicer):
    def __init__(self, brain: BrainApi) -> None:
        self.brain = brain

    @_answer
    def PersistMetrics(
        self, request: brain_pb2.PersistMetricsRequest, context: Any
    ) -> brain_pb2.PersistMetricsResponse:
        self.brain.persist(wire.batch_from_wire(request))
        return brain_pb2.PersistMetricsResponse()

    @_answer
    def Plan(self, request: brain_pb2.PlanRequest, context: Any) -> brain_pb2.BrainPlan:
        return wire.plan_to_wire(self.brain.plan(wire.plan_request_from_wire(request)))

    @_answer
    def MarkApplied(
        self, request: brain_pb2.MarkAppliedRequest, context: Any
    ) -> brain_pb2.BrainPlan:
        return wire.plan_to_wire(self.brain.mark_applied(PlanId(request.plan_id)))

    @_answer
    def GetReport(self, request: brain_pb2.GetReportRequest, context: Any) -> brain_pb2.BrainReport:
        if not request.job_name:
            raise InvalidArgument("job_name is empty")
        return wire.report_to_wire(self.brain.report(request.job_name))


class _Malformed:
    def __init__(self, why: str) -> None:
        self.why = why


def _deny(request: Any, context: grpc.ServicerContext) -> None:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")


def _guarded(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """A unary handler whose malformed requests are answered INVALID_ARGUMENT
    (gRPC alone would answer INTERNAL)."""
    parse = handler.request_deserializer
    call: Any = handler.unary_unary

    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw) if parse is not None else raw
        except DecodeError as error:
            return _Malformed(f"malformed request: {error}")

    def checked(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded(request.why))
        return call(request, context)

    return grpc.unary_unary_rpc_method_handler(checked, deserialize, handler.response_serializer)


class TokenInterceptor(grpc.ServerInterceptor):
    """Every RPC but the health check carries the token; unary methods (all of
    the brain's) are guarded against malformed requests."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        if handler_call_details.method.startswith(_HEALTH):
            return handler
        if not self._authenticated(handler_call_details):
            return grpc.unary_unary_rpc_method_handler(_deny)
        if handler is not None and handler.unary_unary is not None:
            return _guarded(handler)
        return handler

    def _authenticated(self, details: grpc.HandlerCallDetails) -> bool:
        for key, value in details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(given, self._token)
        return False


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
        tls: tuple[bytes, bytes] | None = None,
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
            interceptors=[TokenInterceptor(self._token)],
            options=[("grpc.so_reuseport", 0)],
        )
        brain_pb2_grpc.add_BrainServicer_to_server(BrainService(self.brain), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        if self._tls is not None:
            cert, key = self._tls
            port = server.add_secure_port(self._address, grpc.ssl_server_credentials([(key, cert)]))
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
