"""The one request guard: a request that does not parse is answered
INVALID_ARGUMENT (gRPC itself would answer UNKNOWN or INTERNAL: an exception
escaped the handler), with its details bounded, and never reaches a handler.

`AsyncRequestGuard` (the master) also bounds the details of every abort its
handlers make and guards bidirectional streams; `RequestGuard` (the brain)
guards unary methods, all the brain has. Each wraps a method once, not per
call (the services' handlers are built once).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError

from dlfleet.api.serving.answers import bounded_details
from dlfleet.api.serving.tokens import HEALTH_METHODS, AsyncContinuation, Continuation


class _Malformed:
    """What a request that does not parse decodes to."""

    def __init__(self, why: str) -> None:
        self.why = why


def _tolerant(handler: grpc.RpcMethodHandler[Any, Any]) -> Any:
    """The handler's deserializer, answering `_Malformed` where it would raise."""
    parse = handler.request_deserializer

    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw) if parse is not None else raw
        except DecodeError as error:
            return _Malformed(f"malformed request: {error}")

    return deserialize


class _Context:
    """The servicer context as handlers see it: every abort's details bounded."""

    def __init__(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self._context = context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def abort(self, code: grpc.StatusCode, details: str = "", *args: Any) -> NoReturn:
        await self._context.abort(code, bounded_details(details), *args)
        raise AssertionError("abort returned")  # pragma: no cover - abort raises


def _guarded_async(
    handler: grpc.RpcMethodHandler[Any, Any],
) -> grpc.RpcMethodHandler[Any, Any]:
    deserialize = _tolerant(handler)

    async def refuse(request: _Malformed, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded_details(request.why))

    async def each_checked(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        async for request in requests:
            if type(request) is _Malformed:
                await refuse(request, context)
            yield request

    serialize = handler.response_serializer
    unary: Any = handler.unary_unary
    streams: Any = handler.stream_stream
    if inspect.iscoroutinefunction(unary):

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if type(request) is _Malformed:
                await refuse(request, context)
            return await unary(request, _Context(context))

        return grpc.unary_unary_rpc_method_handler(unary_unary, deserialize, serialize)
    if inspect.isasyncgenfunction(streams):

        async def stream_stream(
            requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            responses = streams(each_checked(requests, context), _Context(context))
            async with contextlib.aclosing(responses):
                async for response in responses:
                    yield response

        return grpc.stream_stream_rpc_method_handler(stream_stream, deserialize, serialize)
    return handler  # no other kind among the master's services


def _guarded_sync(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    call: Any = handler.unary_unary
    if call is None:
        return handler  # no other kind among the brain's services

    def checked(request: Any, context: grpc.ServicerContext) -> Any:
        if type(request) is _Malformed:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded_details(request.why))
        return call(request, context)

    return grpc.unary_unary_rpc_method_handler(
        checked, _tolerant(handler), handler.response_serializer
    )


class _Guarded:
    """Each method's handler guarded once: method -> (as registered, guarded)."""

    def __init__(self, guard: Any) -> None:
        self._guard = guard
        self._known: dict[str, tuple[Any, grpc.RpcMethodHandler[Any, Any]]] = {}

    def __call__(
        self, method: str, handler: grpc.RpcMethodHandler[Any, Any] | None
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        if handler is None:
            return None
        known = self._known.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        if method.startswith(HEALTH_METHODS):
            return handler
        guarded: grpc.RpcMethodHandler[Any, Any] = self._guard(handler)
        self._known[method] = (handler, guarded)
        return guarded


class RequestGuard(grpc.ServerInterceptor):
    """The request guard of a thread-pool server (`grpc.server`)."""

    def __init__(self) -> None:
        self._guarded = _Guarded(_guarded_sync)

    def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = handler_call_details.method
        return self._guarded(method, continuation(handler_call_details))


class AsyncRequestGuard(grpc.aio.ServerInterceptor):
    """The request guard of an asyncio server (`grpc.aio.server`)."""

    def __init__(self) -> None:
        self._guarded = _Guarded(_guarded_async)

    async def intercept_service(
        self, continuation: AsyncContinuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = handler_call_details.method
        return self._guarded(method, await continuation(handler_call_details))
