"""A LeaseSession's per-message deadline, against a real gRPC server whose
LeaseStream holds its first stream's request unanswered: the session drops
that stream and sends the request again on a new one."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from dlfleet.api.client import MasterClient, RetryPolicy
from dlfleet.api.errors import Unavailable
from dlfleet.api.v1 import shards_pb2

pytestmark = pytest.mark.integration

TIMEOUT_S = 0.5


class _SilentFirstStream:
    """Leaves the request on its first `silent_streams` streams unanswered
    until the client gives the stream up; answers every other with a shard
    whose lease id counts the streams opened."""

    def __init__(self, silent_streams: int) -> None:
        self._silent_streams = silent_streams
        self._lock = threading.Lock()
        self.streams = 0
        self.abandoned = 0

    def LeaseStream(
        self, request_iterator: Iterator[shards_pb2.LeaseRequest], context: grpc.ServicerContext
    ) -> Iterator[shards_pb2.LeaseResponse]:
        with self._lock:
            self.streams += 1
            stream = self.streams
        for request in request_iterator:
            if stream <= self._silent_streams:
                ended = threading.Event()
                context.add_callback(ended.set)
                ended.wait(10 * TIMEOUT_S)
                with self._lock:
                    self.abandoned += not context.is_active()
                return
            yield shards_pb2.LeaseResponse(
                shard=shards_pb2.Shard(dataset=request.dataset, lease_id=stream)
            )


def _serve(servicer: _SilentFirstStream) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    lease_stream = grpc.stream_stream_rpc_method_handler(
        servicer.LeaseStream,
        request_deserializer=shards_pb2.LeaseRequest.FromString,
        response_serializer=shards_pb2.LeaseResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "dlfleet.api.v1.Shards", {"LeaseStream": lease_stream}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_unanswered_message_drops_its_stream_and_is_sent_again_on_a_new_one() -> None:
    servicer = _SilentFirstStream(silent_streams=1)
    server, port = _serve(servicer)
    client = MasterClient(f"127.0.0.1:{port}", token="t", timeout_s=TIMEOUT_S)
    try:
        with client.lease_session() as session:
            start = time.monotonic()
            first = session.lease("d", node_id="n", rank=0)
            waited = time.monotonic() - start
            second = session.lease("d", node_id="n", rank=0)
    finally:
        client.close()
        server.stop(None)

    assert first.shard.lease_id == 2  # answered on the second stream
    assert second.shard.lease_id == 2  # which the session keeps
    assert TIMEOUT_S <= waited < 5 * TIMEOUT_S
    assert servicer.streams == 2
    assert servicer.abandoned == 1


def test_a_stream_that_never_answers_spends_the_retry_budget() -> None:
    servicer = _SilentFirstStream(silent_streams=100)
    server, port = _serve(servicer)
    retry = RetryPolicy(attempts=3, initial_backoff_s=0.01, max_backoff_s=0.01)
    client = MasterClient(f"127.0.0.1:{port}", token="t", timeout_s=TIMEOUT_S, retry=retry)
    try:
        with (
            client.lease_session() as session,
            pytest.raises(Unavailable, match=r"LeaseStream .* after 3 attempts"),
        ):
            session.lease("d", node_id="n", rank=0)
    finally:
        client.close()
        server.stop(None)

    assert servicer.streams == 3
