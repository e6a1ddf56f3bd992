"""`RemoteBrain`: `BrainApi` over gRPC, to a `dlbrain` service.

One attempt per call, within `timeout_s`: the caller decides whether to try
again (`BrainReporter` does, with backoff; the master's planning loop simply
asks at its next tick). A failed call raises the domain error of its status
code (`dlfleet.api.status`), naming the brain's address and the method.
Thread-safe (one channel).
"""

from __future__ import annotations

from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dlfleet.api.client import channel_credentials
from dlfleet.api.errors import Unavailable
from dlfleet.api.status import TOKEN_METADATA_KEY, error_from_status
from dlfleet.api.v1 import brain_pb2, brain_pb2_grpc
from dlfleet.brain import wire
from dlfleet.brain.records import JobReport, MetricsBatch, Plan, PlanId, PlanRequest

Resp = TypeVar("Resp")


class RemoteBrain:
    def __init__(
        self,
        target: str,
        *,
        token: str,
        timeout_s: float = 10.0,
        tls_ca: bytes | None = None,
    ) -> None:
        """`tls_ca`: PEM root certificate(s) to verify a TLS brain with; when
        None, the file named by $DLFLEET_TLS_CA if set, else plaintext."""
        self.target = target
        self.timeout_s = timeout_s
        self._metadata = ((TOKEN_METADATA_KEY, token),)
        credentials = channel_credentials(tls_ca)
        options = [("grpc.enable_retries", 0)]
        self._channel = (
            grpc.secure_channel(target, credentials, options=options)
            if credentials is not None
            else grpc.insecure_channel(target, options=options)
        )
        self._stub = brain_pb2_grpc.BrainStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> RemoteBrain:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, name: str, method: Any, request: Any, timeout_s: float | None = None) -> Any:
        timeout = timeout_s or self.timeout_s
        try:
            return method(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            code: grpc.StatusCode = error.code()
            details: str = error.details() or code.name
            if code is grpc.StatusCode.DEADLINE_EXCEEDED:  # as MasterClient: no answer in time
                raise Unavailable(
                    f"brain at {self.target}: {name}: no answer within {timeout:g} s"
                ) from None
            raise error_from_status(code, f"brain at {self.target}: {name}: {details}") from None

    def persist(self, batch: MetricsBatch) -> None:
        self._call("PersistMetrics", self._stub.PersistMetrics, wire.batch_to_wire(batch))

    def plan(self, request: PlanRequest) -> Plan:
        reply: brain_pb2.BrainPlan = self._call(
            "Plan", self._stub.Plan, wire.plan_request_to_wire(request)
        )
        return wire.plan_from_wire(reply)

    def mark_applied(self, plan_id: PlanId) -> Plan:
        request = brain_pb2.MarkAppliedRequest(plan_id=plan_id)
        reply: brain_pb2.BrainPlan = self._call("MarkApplied", self._stub.MarkApplied, request)
        return wire.plan_from_wire(reply)

    def report(self, job: str) -> JobReport:
        request = brain_pb2.GetReportRequest(job_name=job)
        reply: brain_pb2.BrainReport = self._call("GetReport", self._stub.GetReport, request)
        return wire.report_from_wire(reply)

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """Whether the service answers SERVING (a health check needs no token)."""
        try:
            reply = self._health.Check(
                health_pb2.HealthCheckRequest(service=wire.SERVICE_NAME), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Block until the service is up (the channel connects and the health
        check says SERVING), or raise Unavailable."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise Unavailable(f"brain at {self.target}: not reachable in {timeout_s:g} s") from None
        if not self.healthy(timeout_s):
            raise Unavailable(f"brain at {self.target}: not serving")
