"""Handlers raise domain errors; these decorators answer them with the status
code that `dlfleet.api.status` maps them to (the one table), `rpc` for asyncio
servicers, `answer` and `answer_stream` (a handler that yields its answers)
for thread-pool ones. Status details are bounded here too.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, NoReturn, TypeVar

import grpc

from dlfleet.api.errors import DlfleetError
from dlfleet.api.status import status_of

_log = logging.getLogger(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")

# Status details echo client input (names, ids, ranges). A trailer past the
# client's metadata limit (8 KiB soft, 16 KiB hard by default) is refused by the
# client, which then sees RESOURCE_EXHAUSTED instead of the real code; non-ASCII
# bytes are percent-encoded (x3) on the wire.
MAX_DETAILS_BYTES = 2_000


def bounded_details(details: str) -> str:
    raw = details.encode()
    if len(raw) <= MAX_DETAILS_BYTES:
        return details
    cut = raw[:MAX_DETAILS_BYTES].decode(errors="ignore")
    return f"{cut}... ({len(raw)} bytes in all)"


def rpc(
    handler: Callable[[Any, Req, grpc.aio.ServicerContext[Req, Resp]], Awaitable[Resp]],
) -> Callable[[Any, Req, grpc.aio.ServicerContext[Req, Resp]], Awaitable[Resp]]:
    """Map domain errors to status codes: the handlers raise, this answers.
    Details are bounded by the request guard's context where one runs."""

    async def wrapper(
        self: Any, request: Req, context: grpc.aio.ServicerContext[Req, Resp]
    ) -> Resp:
        try:
            return await handler(self, request, context)
        except DlfleetError as error:
            await context.abort(status_of(error), str(error))

    wrapper.__name__ = handler.__name__
    return wrapper


def answer(
    handler: Callable[[Any, Req, grpc.ServicerContext], Resp],
) -> Callable[[Any, Req, grpc.ServicerContext], Resp]:
    """`rpc` for a thread-pool servicer, with details bounded; an INTERNAL or
    UNAVAILABLE answer is logged (the server's own trouble, not the caller's)."""

    @functools.wraps(handler)
    def wrapper(self: Any, request: Req, context: grpc.ServicerContext) -> Resp:
        try:
            return handler(self, request, context)
        except DlfleetError as error:
            _abort(context, handler.__name__, error)

    return wrapper


def answer_stream(
    handler: Callable[[Any, Req, grpc.ServicerContext], Iterator[Resp]],
) -> Callable[[Any, Req, grpc.ServicerContext], Iterator[Resp]]:
    """`answer` for a thread-pool handler that yields its answers: an error
    raised while it yields ends the stream with its status."""

    @functools.wraps(handler)
    def wrapper(self: Any, request: Req, context: grpc.ServicerContext) -> Iterator[Resp]:
        try:
            yield from handler(self, request, context)
        except DlfleetError as error:
            _abort(context, handler.__name__, error)

    return wrapper


def _abort(context: grpc.ServicerContext, name: str, error: DlfleetError) -> NoReturn:
    code = status_of(error)
    if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE):
        _log.warning("%s failed: %s", name, error)
    context.abort(code, bounded_details(str(error)))
    raise AssertionError("abort returned")  # pragma: no cover - abort raises
