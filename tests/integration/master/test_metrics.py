"""The master's Prometheus metrics, read from its registry while real RPCs
(a real gRPC server on 127.0.0.1:0, the real client, a real store) move them."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from harness import Running
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dlfleet.api.client import MasterClient, RetryPolicy
from dlfleet.api.errors import Unauthenticated
from dlfleet.api.v1 import shards_pb2

pytestmark = pytest.mark.integration

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(running: Running) -> Samples:
    """Every sample of the master's registry, parsed as a scraper would."""
    text = generate_latest(running.server.metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def lease_all(client: MasterClient, dataset: str) -> int:
    """Lease and ack every shard of one epoch; the number of shards."""
    held: list[int] = []
    shards = 0
    while True:
        resp = client.lease(dataset, node_id="n", rank=0, done=held)
        held = []
        if resp.WhichOneof("outcome") != "shard":
            return shards
        shards += 1
        held = [resp.shard.lease_id]


def test_shards_records_and_rpcs_are_counted_as_a_dataset_is_consumed(
    start_master: Callable[..., Running],
) -> None:
    running = start_master()
    client = running.client
    client.register_dataset(
        shards_pb2.DatasetSpec(name="data", size=95, batch_size=5, shard_size=10, epochs=2)
    )
    before = scrape(running)
    assert value(before, "dlfleet_dataset_records_expected", dataset="data") == 190
    assert value(before, "dlfleet_dataset_records_done", dataset="data") == 0
    assert value(before, "dlfleet_dataset_epochs", dataset="data") == 2
    assert value(before, "dlfleet_dataset_records", dataset="data", epoch="0", state="todo") == 95

    shards = lease_all(client, "data")
    after = scrape(running)
    assert shards == 10
    assert value(after, "dlfleet_shards_leased_total", dataset="data") == 10
    assert value(after, "dlfleet_shards_done_total", dataset="data") == 10
    assert value(after, "dlfleet_dataset_records_done", dataset="data") == 95
    assert value(after, "dlfleet_epochs_completed_total", dataset="data") == 1
    leases = value(after, "dlfleet_rpc_requests_total", method="Lease", code="OK")
    assert leases >= shards
    assert value(after, "dlfleet_rpc_duration_seconds_count", method="Lease") == leases
    assert value(after, "dlfleet_shard_lease_duration_seconds_count") == leases
    assert value(after, "dlfleet_rpc_requests_total", method="RegisterDataset", code="OK") == 1
    assert value(after, "dlfleet_store_commit_duration_seconds_count") > 0
    assert value(after, "dlfleet_store_committed_entries_total") >= 20


def test_refused_rpcs_are_counted_by_their_status_code(
    start_master: Callable[..., Running],
) -> None:
    running = start_master()
    retry = RetryPolicy(attempts=1)
    with (
        MasterClient(running.address, token="wrong", retry=retry, timeout_s=5) as intruder,
        pytest.raises(Unauthenticated),
    ):
        intruder.dataset_status("data")
    # An abort sends the status before the handler's coroutine ends, and the
    # count is taken as it ends: the client may hear first.
    labels = {"method": "GetDatasetStatus", "code": "UNAUTHENTICATED"}
    deadline = time.monotonic() + 5
    while value(scrape(running), "dlfleet_rpc_requests_total", **labels) < 1:
        assert time.monotonic() < deadline, "the refused RPC was never counted"
        time.sleep(0.01)
    assert value(scrape(running), "dlfleet_rpc_requests_total", **labels) == 1


def test_nodes_are_counted_by_state_and_their_loss_by_reason(
    start_master: Callable[..., Running],
) -> None:
    running = start_master()
    client = running.client
    first = client.register_node(
        job_name="job", node_name="node-a", local_world_size=2, host="127.0.0.1"
    )
    assert value(scrape(running), "dlfleet_nodes", state="idle") == 1
    client.deregister_node(first.node_id, first.incarnation)
    samples = scrape(running)
    assert value(samples, "dlfleet_nodes", state="idle") == 0
    assert value(samples, "dlfleet_node_failures_total", reason="deregistered") == 1


def test_streamed_leases_are_timed_one_by_one(start_master: Callable[..., Running]) -> None:
    running = start_master()
    client = running.client
    client.register_dataset(
        shards_pb2.DatasetSpec(name="data", size=30, batch_size=5, shard_size=10, epochs=1)
    )
    session = client.lease_session()
    held: list[int] = []
    answers = 0
    while True:
        resp = session.lease("data", node_id="n", rank=0, done=held)
        answers += 1
        if resp.WhichOneof("outcome") != "shard":
            break
        held = [resp.shard.lease_id]
    session.close()
    samples = scrape(running)
    assert value(samples, "dlfleet_shard_lease_duration_seconds_count") == answers == 4
    assert value(samples, "dlfleet_shards_done_total", dataset="data") == 3
