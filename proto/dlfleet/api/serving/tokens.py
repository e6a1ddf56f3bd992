"""The one token check: every RPC but the health check carries the token in
the `x-dlfleet-token` metadata (`dlfleet.api.status.TOKEN_METADATA_KEY`),
compared in constant time (`token_matches`, which the HTTP endpoint uses
too). Without it the call is answered UNAUTHENTICATED before any request is
read, by a handler of the method's own kind: a unary
denial of a streaming method would wait for a request that a streaming
client may never send (a hang, not a status).

`TokenCheck` is for thread-pool servers (the brain, the keeper),
`AsyncTokenCheck` for asyncio servers (the master, the job supervisor). Each
denial handler is built once per kind, not per call.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from dlfleet.api.status import TOKEN_METADATA_KEY

# The health service's method prefix: no token, no guard.
HEALTH_METHODS = "/grpc.health.v1.Health/"

# What a refused call reads, by default (the brain says "token": it is not a job's).
JOB_TOKEN_REFUSAL = "missing or wrong job token"

# What a server interceptor calls for the next handler in the chain.
Continuation = Callable[[grpc.HandlerCallDetails], "grpc.RpcMethodHandler[Any, Any] | None"]
AsyncContinuation = Callable[
    [grpc.HandlerCallDetails], Awaitable["grpc.RpcMethodHandler[Any, Any] | None"]
]

Denials = dict[tuple[bool, bool], "grpc.RpcMethodHandler[Any, Any]"]


def token_matches(given: str | bytes | None, token: bytes) -> bool:
    """Whether `given` is `token`, compared in constant time: the one
    comparison of every server that checks the job token (gRPC metadata,
    the HTTP endpoint's header, cookie and login)."""
    if given is None:
        return False
    return hmac.compare_digest(given.encode() if isinstance(given, str) else given, token)


def carries_token(metadata: Sequence[tuple[str, str | bytes]] | None, token: bytes) -> bool:
    """Whether the call's metadata holds `token`."""
    for key, value in metadata or ():
        if key == TOKEN_METADATA_KEY:
            return token_matches(value, token)
    return False


def _denials(deny: Any) -> Denials:
    """A denial of each kind, by (request streaming, response streaming)."""
    return {
        (False, False): grpc.unary_unary_rpc_method_handler(deny),
        (False, True): grpc.unary_stream_rpc_method_handler(deny),
        (True, False): grpc.stream_unary_rpc_method_handler(deny),
        (True, True): grpc.stream_stream_rpc_method_handler(deny),
    }


def _denial_for(
    denials: Denials, handler: grpc.RpcMethodHandler[Any, Any] | None
) -> grpc.RpcMethodHandler[Any, Any]:
    if handler is None:
        return denials[False, False]
    return denials[bool(handler.request_streaming), bool(handler.response_streaming)]


class TokenCheck(grpc.ServerInterceptor):
    """The token check of a thread-pool server (`grpc.server`)."""

    def __init__(self, token: str, refusal: str = JOB_TOKEN_REFUSAL) -> None:
        self._token = token.encode()

        def deny(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)

        self._denials = _denials(deny)

    def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        if handler_call_details.method.startswith(HEALTH_METHODS) or carries_token(
            handler_call_details.invocation_metadata, self._token
        ):
            return handler
        return _denial_for(self._denials, handler)


class AsyncTokenCheck(grpc.aio.ServerInterceptor):
    """The token check of an asyncio server (`grpc.aio.server`)."""

    def __init__(self, token: str, refusal: str = JOB_TOKEN_REFUSAL) -> None:
        self._token = token.encode()

        async def deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)

        self._denials = _denials(deny)

    async def intercept_service(
        self, continuation: AsyncContinuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler_call_details.method.startswith(HEALTH_METHODS) or carries_token(
            handler_call_details.invocation_metadata, self._token
        ):
            return handler
        return _denial_for(self._denials, handler)
