"""The master's Prometheus metrics, read from its registry while real RPCs
(a real gRPC server on 127.0.0.1:0, the real client, a real store) move them."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from harness import TOKEN, Running
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dlfleet.api.client import MasterClient, RetryPolicy
from dlfleet.api.errors import Unauthenticated
from dlfleet.api.v1 import job_pb2, rendezvous_pb2, shards_pb2

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
    assert value(after, "dlfleet_rpc_duration_seconds_count", method="Lease", code="OK") == leases
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


def test_refused_and_accepted_calls_of_one_method_interleaved_each_get_their_answer(
    start_master: Callable[..., Running],
) -> None:
    """The interceptors wrap each handler once and reuse it: a denial cached
    for a method must not answer the next caller with the token, nor the
    reverse, and each is counted under its own code."""
    running = start_master()
    retry = RetryPolicy(attempts=1)
    with (
        MasterClient(running.address, token="wrong", retry=retry, timeout_s=5) as intruder,
        MasterClient(running.address, token=TOKEN, retry=retry, timeout_s=5) as member,
    ):
        for _ in range(3):
            with pytest.raises(Unauthenticated):
                intruder.master_status()
            assert member.master_status().round == 0
    labels = {"method": "GetStatus"}
    deadline = time.monotonic() + 5
    while (
        value(scrape(running), "dlfleet_rpc_requests_total", code="UNAUTHENTICATED", **labels) < 3
    ):
        assert time.monotonic() < deadline, "the refused RPCs were never counted"
        time.sleep(0.01)
    assert value(scrape(running), "dlfleet_rpc_requests_total", code="OK", **labels) == 3


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


def test_whole_shards_done_are_counted_per_epoch_against_the_shards_of_an_epoch(
    start_master: Callable[..., Running],
) -> None:
    running = start_master()
    client = running.client
    client.register_dataset(
        shards_pb2.DatasetSpec(name="data", size=95, batch_size=5, shard_size=10, epochs=2)
    )
    samples = scrape(running)
    assert value(samples, "dlfleet_dataset_epoch_shards", dataset="data") == 10
    assert value(samples, "dlfleet_dataset_shards_done", dataset="data", epoch="0") == 0
    held: list[int] = []
    for _ in range(4):  # three acknowledged, the fourth still held
        resp = client.lease("data", node_id="n", rank=0, done=held)
        held = [resp.shard.lease_id]
    samples = scrape(running)
    assert value(samples, "dlfleet_dataset_shards_done", dataset="data", epoch="0") == 3
    assert value(samples, "dlfleet_dataset_records", dataset="data", epoch="0", state="done") == 30


def test_acks_and_renewals_are_timed_unary_and_streamed(
    start_master: Callable[..., Running],
) -> None:
    running = start_master()
    client = running.client
    client.register_dataset(
        shards_pb2.DatasetSpec(name="data", size=100, batch_size=5, shard_size=10, epochs=1)
    )
    first = client.lease("data", node_id="n", rank=0)
    client.renew("data", first.shard.lease_id, consumed=5)
    client.report_done("data", first.shard.lease_id)
    second = client.lease("data", node_id="n", rank=0)
    with client.lease_session() as session:
        session.lease("data", node_id="n", rank=0, done=[second.shard.lease_id])
    samples = scrape(running)
    assert value(samples, "dlfleet_shard_renew_duration_seconds_count") == 1
    assert value(samples, "dlfleet_shard_ack_duration_seconds_count") == 2  # Report, streamed
    assert value(samples, "dlfleet_shard_lease_duration_seconds_count") == 3
    assert value(samples, "dlfleet_rpc_duration_seconds_count", method="Renew", code="OK") == 1
    assert value(samples, "dlfleet_rpc_duration_seconds_count", method="Report", code="OK") == 1


def test_worker_failures_and_the_restarts_they_cost_are_counted_by_reason(
    start_master: Callable[..., Running],
) -> None:
    running = start_master()
    client = running.client
    node = client.register_node(job_name="job", node_name="node-a", local_world_size=1)
    for signal, message, restarting in (
        ("SIGKILL", "Killed", True),
        ("", "hung: no training step for 31.0s (--step-timeout 30s)", True),
        ("", "ZeroDivisionError", False),  # its last: the node fails
    ):
        client.report_worker_failure(
            rendezvous_pb2.FailureReport(
                node_id=node.node_id, incarnation=node.incarnation, exit_code=1,
                signal=signal, message=message, restarting=restarting,
            )
        )  # fmt: skip
    samples = scrape(running)
    for reason in ("SIGKILL", "hang", "exit"):
        assert value(samples, "dlfleet_worker_failures_total", reason=reason) == 1
    assert value(samples, "dlfleet_worker_restarts_total", reason="SIGKILL") == 1
    assert value(samples, "dlfleet_worker_restarts_total", reason="hang") == 1
    assert value(samples, "dlfleet_worker_restarts_total", reason="exit") == 0


def test_a_nodes_heartbeat_metrics_are_labelled_by_node_and_go_when_it_leaves(
    start_master: Callable[..., Running],
) -> None:
    running = start_master()
    client = running.client
    node = client.register_node(job_name="job", node_name="node-a", local_world_size=1)
    session = client.agent_session(node.node_id, node.incarnation, 0.05)
    session.metrics = rendezvous_pb2.NodeMetrics(
        samples_per_second=128.0, step_time_ms=250, cpu_percent=150, rss_bytes=1 << 30, steps=9
    )
    try:
        deadline = time.monotonic() + 10
        while not value(scrape(running), "dlfleet_node_samples_per_second", node=node.node_id):
            assert time.monotonic() < deadline, "the heartbeat's metrics never showed"
            time.sleep(0.02)
        samples = scrape(running)
        assert value(samples, "dlfleet_node_samples_per_second", node=node.node_id) == 128
        assert value(samples, "dlfleet_node_step_time_seconds", node=node.node_id) == 0.25
        assert value(samples, "dlfleet_node_cpu_cores", node=node.node_id) == 1.5
        assert value(samples, "dlfleet_node_resident_memory_bytes", node=node.node_id) == 1 << 30
        # Dropped while its session still beats: its series go at once.
        client.deregister_node(node.node_id, node.incarnation)
        names = {name for name, labels in scrape(running) if ("node", node.node_id) in labels}
        assert names == set()
    finally:
        session.close()


def test_the_supervisors_totals_are_exported_as_it_last_reported_them(
    start_master: Callable[..., Running],
) -> None:
    running = start_master()
    client = running.client
    samples = scrape(running)
    assert value(samples, "dlfleet_master_restarts_total") == 0
    totals = job_pb2.SupervisorTotals(
        brain_plans=[
            job_pb2.PlanCount(action="scale", applied=True, count=2),
            job_pb2.PlanCount(action="none", applied=False, count=7),
        ],
        node_exits=[job_pb2.ReasonCount(reason="oom_killed", count=1)],
        node_relaunches=1,
        master_restarts=3,
    )
    client.master_status(totals)
    client.master_status(totals)  # totals: a repeat changes nothing
    client.master_status()  # a request without them (dlmaster status) neither
    samples = scrape(running)
    assert value(samples, "dlfleet_brain_plans_total", action="scale", applied="true") == 2
    assert value(samples, "dlfleet_brain_plans_total", action="none", applied="false") == 7
    assert value(samples, "dlfleet_node_exits_total", reason="oom_killed") == 1
    assert value(samples, "dlfleet_node_relaunches_total") == 1
    assert value(samples, "dlfleet_master_restarts_total") == 3
