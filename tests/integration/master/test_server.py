"""The master's RPCs through a real gRPC server on 127.0.0.1:0, the real client
and a real store (SQLite file and PostgreSQL)."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import psycopg
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness import TOKEN, LoopThread, Running

from dlfleet.api.client import MasterClient, RetryPolicy
from dlfleet.api.errors import InvalidArgument, NotFound, StaleError, Unauthenticated, Unavailable
from dlfleet.api.v1 import shards_pb2
from dlfleet.master.core.liveness import LivenessSettings
from dlfleet.master.core.shards import ShardSettings
from dlfleet.master.service.state import MasterSettings

pytestmark = pytest.mark.integration


def spec(
    name: str = "data", size: int = 100, shard: int = 10, epochs: int = 1
) -> shards_pb2.DatasetSpec:
    return shards_pb2.DatasetSpec(
        name=name, size=size, batch_size=5, shard_size=shard, epochs=epochs, shuffle=True, seed=3
    )


def test_registration_is_idempotent_and_conflicts_are_invalid_argument(
    start_master: Callable[..., Running],
) -> None:
    client = start_master().client
    assert client.register_dataset(spec()).created
    again = client.register_dataset(spec())
    assert not again.created
    assert again.status.records_per_epoch == 100
    with pytest.raises(InvalidArgument, match="size=200"):
        client.register_dataset(spec(size=200))
    assert client.register_dataset(spec(name="tiny", size=3)).status.records_per_epoch == 3
    tiny_cut = spec(name="tiny-cut", size=3)
    tiny_cut.drop_last = True
    with pytest.raises(InvalidArgument, match="fewer than one global batch of 5"):
        client.register_dataset(tiny_cut)
    with pytest.raises(InvalidArgument, match="has no records"):
        client.register_dataset(spec(name="empty", size=0))


def test_a_full_epoch_of_lease_and_ack_covers_every_position_once(
    start_master: Callable[..., Running],
) -> None:
    client = start_master().client
    client.register_dataset(spec(size=95, shard=10))
    covered: list[int] = []
    held: list[int] = []
    while True:
        resp = client.lease("data", node_id="n", rank=0, done=held)
        held = []
        kind = resp.WhichOneof("outcome")
        if kind != "shard":
            assert kind in {"end_of_dataset", "end_of_epoch"}
            if kind == "end_of_dataset":
                break
            continue
        covered.extend(range(resp.shard.start, resp.shard.end))
        held = [resp.shard.lease_id]
    assert sorted(covered) == list(range(95))
    status = client.dataset_status("data")
    assert status.finished


def test_errors_map_to_documented_status_codes(start_master: Callable[..., Running]) -> None:
    running = start_master()
    client = running.client
    with pytest.raises(NotFound, match="not registered"):
        client.lease("nope", node_id="n", rank=0)
    client.register_dataset(spec())
    with pytest.raises(StaleError, match="not live"):
        client.report_done("data", 424242)
    with pytest.raises(InvalidArgument, match="names no consumer"):
        client._call(  # a malformed request that the typed methods cannot build
            "Lease", client._shards.Lease, shards_pb2.LeaseRequest(dataset="data")
        )
    lease = client.lease("data", node_id="n", rank=0).shard
    with pytest.raises(InvalidArgument, match="consumed 11 is outside"):
        client.renew("data", lease.lease_id, consumed=11)
    assert client.renew("data", lease.lease_id, consumed=4).deadline_unix_ms > 0
    # A stale report changed nothing: the lease is still live and can be acked once.
    assert not client.report_done("data", lease.lease_id).duplicate
    assert client.report_done("data", lease.lease_id).duplicate


def test_every_rpc_needs_the_job_token_but_health_does_not(
    start_master: Callable[..., Running],
) -> None:
    running = start_master()
    target = running.client.target
    for token in ("", "wrong", TOKEN + "x"):
        with MasterClient(target, token=token) as bad, pytest.raises(Unauthenticated):
            bad.register_dataset(spec())
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        answer = health.Check(health_pb2.HealthCheckRequest(service="dlfleet.api.v1.Shards"))
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(NotFound):  # nothing was registered by the rejected calls
        running.client.dataset_status("data")


def test_expired_lease_is_requeued_by_the_server_ticker(
    start_master: Callable[..., Running],
) -> None:
    settings = MasterSettings(job_name="job", shard=ShardSettings(lease_timeout_ms=200))
    client = start_master(settings).client
    client.register_dataset(spec(size=20, shard=10))
    first = client.lease("data", node_id="a", rank=0).shard
    client.renew("data", first.lease_id, consumed=4)
    time.sleep(0.6)
    with pytest.raises(StaleError):
        client.report_done("data", first.lease_id)
    again = client.lease("data", node_id="b", rank=0).shard
    assert (again.start, again.end) == (first.start + 4, first.end)


def test_node_that_stops_heartbeating_loses_its_leases(
    start_master: Callable[..., Running],
) -> None:
    settings = MasterSettings(
        job_name="job",
        liveness=LivenessSettings(heartbeat_interval_ms=50, heartbeat_timeout_ms=300),
    )
    client = start_master(settings).client
    node = client.register_node(job_name="job", node_name="host-a", local_world_size=2)
    assert node.node_id == "host-a#1"
    client.register_dataset(spec(size=20, shard=10))
    lease = client.lease("data", node_id=node.node_id, rank=0).shard
    client.heartbeat(node.node_id, node.incarnation)
    time.sleep(0.8)
    with pytest.raises(StaleError):
        client.heartbeat(node.node_id, node.incarnation)
    status = client.dataset_status("data")
    assert status.leases_active == 0
    assert status.records_todo == 20
    with pytest.raises(StaleError):
        client.report_done("data", lease.lease_id)


def test_a_node_is_not_dropped_for_the_masters_own_stall(
    start_master: Callable[..., Running], loop_thread: LoopThread
) -> None:
    """The master's loop blocked for longer than the heartbeat timeout (a long
    callback, a paused process): the node could not have been heard, and is
    not blamed."""
    settings = MasterSettings(
        job_name="job",
        liveness=LivenessSettings(heartbeat_interval_ms=50, heartbeat_timeout_ms=500),
    )
    client = start_master(settings).client
    node = client.register_node(job_name="job", node_name="host-a", local_world_size=1)
    stalled = threading.Event()

    def stall() -> None:
        time.sleep(1.5)  # blocks the master's loop: 3 heartbeat timeouts
        stalled.set()

    client.heartbeat(node.node_id, node.incarnation)
    loop_thread.loop.call_soon_threadsafe(stall)
    assert stalled.wait(5)
    time.sleep(0.1)  # a tick or two after the stall (every 50 ms here)
    client.heartbeat(node.node_id, node.incarnation)  # still registered
    time.sleep(1.0)  # a silence of its own, the loop free: dropped
    with pytest.raises(StaleError):
        client.heartbeat(node.node_id, node.incarnation)


def test_a_node_is_not_dropped_while_the_master_commits_its_registration(
    start_master: Callable[..., Running], store_url: str
) -> None:
    """The store held by someone else for longer than the heartbeat timeout:
    the registration's durable commit waits, and so does its answer. The node
    could not beat before it had that answer, and is not blamed."""
    settings = MasterSettings(
        job_name="job",
        liveness=LivenessSettings(heartbeat_interval_ms=50, heartbeat_timeout_ms=300),
    )
    client = start_master(settings).client
    with held_store(store_url, seconds=1.0):
        started = time.monotonic()
        node = client.register_node(job_name="job", node_name="host-a", local_world_size=1)
        assert time.monotonic() - started >= 0.9  # the commit waited for the store
    client.heartbeat(node.node_id, node.incarnation)  # still registered


@contextlib.contextmanager
def held_store(store_url: str, seconds: float) -> Iterator[None]:
    """Another client holds the master's store for `seconds` from now: its
    writes wait (SQLite's exclusive lock; PostgreSQL's lock on the journal)."""
    if store_url.startswith("sqlite:///"):
        sqlite = sqlite3.connect(
            store_url.removeprefix("sqlite:///"), isolation_level=None, check_same_thread=False
        )
        sqlite.execute("BEGIN EXCLUSIVE")
        release: Callable[[], object] = lambda: sqlite.execute("COMMIT")  # noqa: E731
        close: Callable[[], object] = sqlite.close
    else:
        postgres = psycopg.connect(store_url.replace("postgresql+psycopg", "postgresql"))
        postgres.execute("LOCK TABLE dlfleet_journal IN ACCESS EXCLUSIVE MODE")
        release, close = postgres.commit, postgres.close
    released = threading.Timer(seconds, release)
    released.start()
    try:
        yield
    finally:
        released.join()
        close()


def test_node_of_another_job_is_rejected(start_master: Callable[..., Running]) -> None:
    client = start_master().client
    with pytest.raises(InvalidArgument, match="belongs to job 'other'"):
        client.register_node(job_name="other", node_name="x", local_world_size=1)


def test_reregistering_a_node_releases_the_old_incarnations_leases(
    start_master: Callable[..., Running],
) -> None:
    client = start_master().client
    first = client.register_node(job_name="job", node_name="h", local_world_size=1)
    client.register_dataset(spec(size=20, shard=10))
    client.lease("data", node_id=first.node_id, rank=0)
    second = client.register_node(job_name="job", node_name="h", local_world_size=1)
    assert second.incarnation == first.incarnation + 1
    assert client.dataset_status("data").leases_active == 0
    with pytest.raises(StaleError):
        client.heartbeat(first.node_id, first.incarnation)


def test_snapshot_and_restore_through_the_wire(start_master: Callable[..., Running]) -> None:
    client = start_master().client
    client.register_dataset(spec(size=40, shard=10))
    a = client.lease("data", node_id="n", rank=0).shard
    client.report_done("data", a.lease_id)
    b = client.lease("data", node_id="n", rank=0).shard
    snap = client.snapshot("data", progress=[(b.lease_id, 3)])
    assert [(r.start, r.end) for r in snap.done] == [(a.start, b.start + 3)]
    c = client.lease("data", node_id="n", rank=0).shard
    client.report_done("data", c.lease_id)
    assert client.restore(snap, round=1).applied
    assert not client.restore(snap, round=1).applied, "every rank of the round may restore"
    with pytest.raises(StaleError):
        client.report_done("data", b.lease_id)
    assert client.snapshot("data") == snap
    bad = shards_pb2.DatasetSnapshot()
    bad.CopyFrom(snap)
    bad.spec_digest = "0" * 16
    with pytest.raises(InvalidArgument, match="different dataset spec"):
        client.restore(bad)


def test_client_gives_up_with_a_clear_error_when_the_master_is_unreachable() -> None:
    policy = RetryPolicy(attempts=4, initial_backoff_s=0.01, max_backoff_s=0.05, total_budget_s=2)
    with MasterClient("127.0.0.1:1", token=TOKEN, timeout_s=0.5, retry=policy) as client:
        started = time.monotonic()
        with pytest.raises(Unavailable, match=r"master 127\.0\.0\.1:1 failed after 4 attempts"):
            client.dataset_status("data")
        assert time.monotonic() - started < 5


def test_a_round_lease_with_count_carries_the_following_shards_in_one_answer(
    start_master: Callable[..., Running],
) -> None:
    client = start_master().client
    client.register_dataset(spec(size=30, shard=10))
    with client.lease_session() as session:
        run = session.lease_for_round("data", round=1, position=0, count=4)
        shards = [run.shard, *run.more]
        assert [(s.start, s.end) for s in shards] == [(0, 10), (10, 20), (20, 30)]
        # Another rank asking one position at a time hears the same shards.
        for position, shard in enumerate(shards):
            alone = client.lease_for_round("data", round=1, position=position)
            assert alone.shard == shard and not alone.more
        # Position 3 was not decided by the run: it is END_OF_EPOCH once asked.
        done = [s.lease_id for s in shards]
        end = session.lease_for_round("data", round=1, position=3, done=done, count=4)
        assert end.WhichOneof("outcome") == "end_of_epoch" and not end.more


def test_lease_stream_answers_in_order_and_survives_a_refused_request(
    start_master: Callable[..., Running],
) -> None:
    client = start_master().client
    client.register_dataset(spec(size=30, shard=10))
    with client.lease_session() as session:
        first = session.lease("data", node_id="n", rank=0).shard
        with pytest.raises(StaleError, match="not live"):
            session.lease("data", node_id="n", rank=0, done=[first.lease_id + 1000])
        # The refused request changed nothing, and the stream is still usable.
        assert client.dataset_status("data").leases_active == 1
        second = session.lease("data", node_id="n", rank=0, done=[first.lease_id]).shard
        assert second.start == first.end
        third = session.lease("data", node_id="n", rank=0, done=[second.lease_id]).shard
        end = session.lease("data", node_id="n", rank=0, done=[third.lease_id])
        assert end.WhichOneof("outcome") == "end_of_epoch"
        assert session.lease("data", node_id="n", rank=0).WhichOneof("outcome") == "end_of_dataset"
        with pytest.raises(NotFound):
            session.lease("other", node_id="n", rank=0)
