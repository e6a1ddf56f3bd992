"""Leases: the requests that ask for a shard, and the LeaseStream session a
consumer thread leases shard after shard on (the hot path: one message each
way per shard, nothing else allocated per lease)."""

from __future__ import annotations

import asyncio
import itertools
import os
import uuid
from collections.abc import Iterable

import grpc

from dlfleet.api.client.answers import LeaseAnswer, lease_answer
from dlfleet.api.client.channel import Connection
from dlfleet.api.client.loop import _IoLoop
from dlfleet.api.status import error_from_code
from dlfleet.api.v1 import shards_pb2


class _RequestIds:
    """Lease request ids, unique across processes and restarts: a random
    prefix per process (a new one after fork) and a counter. A `uuid4` each
    costs a getrandom syscall per lease, a tenth of a client's CPU per pair at
    thousands of leases a second."""

    def __init__(self) -> None:
        self._renew()
        os.register_at_fork(after_in_child=self._renew)

    def _renew(self) -> None:
        self._prefix = uuid.uuid4().hex[:16]
        self._counter = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._counter):x}"


_request_ids = _RequestIds()


def rank_lease_request(
    dataset: str, node_id: str, rank: int, done: Iterable[int], request_id: str | None
) -> shards_pb2.LeaseRequest:
    """Async mode: a lease for one node-rank. The request id makes a retry
    return the same lease instead of a second one."""
    return shards_pb2.LeaseRequest(
        dataset=dataset,
        rank=shards_pb2.RankConsumer(node_id=node_id, rank=rank),
        request_id=request_id or _request_ids.next(),
        done=done,
    )


def round_lease_request(
    dataset: str, round: int, position: int, done: Iterable[int], count: int = 1
) -> shards_pb2.LeaseRequest:
    """Sync mode: position `position` of rendezvous round `round`, and with
    `count` > 1 the shards of up to `count - 1` positions after it
    (`LeaseResponse.more`)."""
    return shards_pb2.LeaseRequest(
        dataset=dataset,
        round=shards_pb2.RoundConsumer(round=round, position=position),
        done=done,
        count=count,
    )


class LeaseSession:
    """One consumer's long-lived LeaseStream: each request gets one response,
    in order. Not thread-safe: one session per consumer thread.

    A broken stream (master restart, network) is reopened and the request in
    flight is sent again under the client's retry budget; that is safe because
    the request is idempotent (its request id, round position, and DONE
    reports). A dead connection is noticed by gRPC keepalive.
    """

    def __init__(self, client: Connection) -> None:
        self._client = client
        self._call: (
            grpc.aio.StreamStreamCall[shards_pb2.LeaseRequest, shards_pb2.LeaseResponse] | None
        ) = None

    def lease(
        self,
        dataset: str,
        *,
        node_id: str,
        rank: int,
        done: Iterable[int] = (),
        request_id: str | None = None,
    ) -> shards_pb2.LeaseResponse:
        return self.request(rank_lease_request(dataset, node_id, rank, done, request_id))

    def lease_for_round(
        self,
        dataset: str,
        *,
        round: int,
        position: int,
        done: Iterable[int] = (),
        count: int = 1,
    ) -> shards_pb2.LeaseResponse:
        return self.request(round_lease_request(dataset, round, position, done, count))

    def request(self, request: shards_pb2.LeaseRequest) -> shards_pb2.LeaseResponse:
        response = self._exchange_with_retries(request)
        if response.WhichOneof("outcome") == "error":
            raise error_from_code(response.error.code, response.error.message)
        return response

    def ask(self, request: shards_pb2.LeaseRequest) -> LeaseAnswer:
        """`request`'s answer as a type: `Leased | EndOfEpoch | EndOfDataset |
        Wait` (built from `rank_lease_request` or `round_lease_request`)."""
        response = self._exchange_with_retries(request)
        kind = response.WhichOneof("outcome")
        if kind == "error":
            raise error_from_code(response.error.code, response.error.message)
        return lease_answer(response, kind)

    def _exchange_with_retries(self, request: shards_pb2.LeaseRequest) -> shards_pb2.LeaseResponse:
        io = self._client._io()
        return self._client._with_retries(
            "LeaseStream", lambda: self._exchange_within_deadline(io, request)
        )

    def _exchange_within_deadline(
        self, io: _IoLoop, request: shards_pb2.LeaseRequest
    ) -> shards_pb2.LeaseResponse:
        """Every message has the client's deadline, like a unary call: a stream
        that does not answer in time is dropped and the request retried.

        The calling thread keeps the deadline while it waits, rather than an
        `asyncio.wait_for` on the loop, which costs the loop that every session
        of the process shares a task and a timer per message."""
        exchange = io.handoff.submit(self._exchange(io, request))
        try:
            return exchange.result(self._client.timeout_s)
        except TimeoutError:
            # Cancelled on the loop, the exchange drops its stream.
            raise _StreamTimeout(self._client.timeout_s) from None

    async def _exchange(
        self, io: _IoLoop, request: shards_pb2.LeaseRequest
    ) -> shards_pb2.LeaseResponse:
        if self._call is None:
            self._call = io.stub.LeaseStream(metadata=self._client._metadata)
        call = self._call
        try:
            await call.write(request)
            response = await call.read()
        except asyncio.InvalidStateError:
            # The stream had ended under us (the master went away between two
            # requests): open a new one.
            self._call = None
            raise _StreamEnded() from None
        except grpc.RpcError as error:
            self._call = None
            call.cancel()
            if error.code() is grpc.StatusCode.INTERNAL:
                # gRPC's core reports a transport that broke mid-stream as
                # INTERNAL; our server never answers a lease with it.
                raise _StreamEnded() from error
            raise
        except asyncio.CancelledError:
            # A timed-out stream is never reused: its answers could be out of
            # step with the requests. (The caller may have moved on already;
            # a stream it opened since is not this one's to drop.)
            if self._call is call:
                self._call = None
            call.cancel()
            raise
        if not isinstance(response, shards_pb2.LeaseResponse):  # grpc.aio.EOF
            self._call = None
            raise _StreamEnded()
        return response

    def close(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            self._client._io().loop.call_soon_threadsafe(call.cancel)

    def __enter__(self) -> LeaseSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _StreamTimeout(grpc.RpcError):
    """No answer on the lease stream within the client's deadline."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__()
        self._timeout_s = timeout_s

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return f"no answer on the lease stream within {self._timeout_s:g}s"


class _StreamEnded(grpc.RpcError):
    """The server closed the stream without an error (it is shutting down)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the master closed the lease stream"
