"""The master's server interceptors build each wrapped handler once per method
(and per kind of denial), not once per call: at thousands of nodes the
per-call closures and handler tuples were a visible part of the master's CPU."""

from __future__ import annotations

import asyncio
from typing import Any, NamedTuple

import grpc

from dlfleet.api.serving.guard import AsyncRequestGuard as RequestGuard
from dlfleet.api.serving.tokens import AsyncTokenCheck as TokenInterceptor
from dlfleet.api.status import TOKEN_METADATA_KEY
from dlfleet.master.service.metrics import MasterMetrics, RpcMetrics


class Details(NamedTuple):
    method: str
    invocation_metadata: tuple[tuple[str, str], ...]


async def _unary(request: Any, context: Any) -> Any:
    return request


async def _streams(requests: Any, context: Any) -> Any:
    async for request in requests:
        yield request


UNARY: grpc.RpcMethodHandler[Any, Any] = grpc.unary_unary_rpc_method_handler(_unary)
STREAM: grpc.RpcMethodHandler[Any, Any] = grpc.stream_stream_rpc_method_handler(_streams)
HANDLERS = {"/dlfleet.api.v1.Nodes/Heartbeat": UNARY, "/dlfleet.api.v1.Rendezvous/Session": STREAM}


def intercept(interceptor: Any, method: str, token: str = "t") -> Any:
    async def continuation(details: Any) -> Any:
        return HANDLERS.get(details.method)

    details = Details(method, ((TOKEN_METADATA_KEY, token),))
    return asyncio.run(interceptor.intercept_service(continuation, details))


def test_the_guard_wraps_each_method_once_and_leaves_unknown_methods_unknown() -> None:
    guard = RequestGuard()
    for method, handler in HANDLERS.items():
        first = intercept(guard, method)
        assert first is not handler
        assert intercept(guard, method) is first
    assert intercept(guard, "/dlfleet.api.v1.Nodes/NoSuch") is None


def test_a_denial_is_shared_by_every_method_of_its_kind() -> None:
    tokens = TokenInterceptor("t")
    assert intercept(tokens, "/dlfleet.api.v1.Nodes/Heartbeat") is UNARY
    denied = intercept(tokens, "/dlfleet.api.v1.Nodes/Heartbeat", token="wrong")
    assert not denied.request_streaming and not denied.response_streaming
    stream_denied = intercept(tokens, "/dlfleet.api.v1.Rendezvous/Session", token="wrong")
    assert stream_denied.request_streaming and stream_denied.response_streaming
    assert intercept(tokens, "/dlfleet.api.v1.Nodes/NoSuch", token="wrong") is denied


def test_the_counter_wraps_each_methods_handler_once() -> None:
    counter = RpcMetrics(MasterMetrics())
    first = intercept(counter, "/dlfleet.api.v1.Nodes/Heartbeat")
    assert intercept(counter, "/dlfleet.api.v1.Nodes/Heartbeat") is first
    assert intercept(counter, "/dlfleet.api.v1.Rendezvous/Session") is not first
