"""A master killed with SIGKILL mid-epoch and started again on the same store
continues the job: nothing lost, nothing duplicated, live leases survive."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import MasterProcess

from dlfleet.api.client import MasterClient, RetryPolicy
from dlfleet.api.errors import Unavailable
from dlfleet.api.v1 import shards_pb2

pytestmark = pytest.mark.integration

PATIENT = RetryPolicy(attempts=200, initial_backoff_s=0.02, max_backoff_s=0.2, total_budget_s=60)


def consume(
    target: str,
    dataset: str,
    node: str,
    ledger: Counter[tuple[int, int]],
    lock: threading.Lock,
    errors: list[BaseException],
    stream: bool,
) -> None:
    """Lease, 'train', and ack (piggybacked on the next lease) until the end,
    over unary calls or a LeaseStream session."""
    try:
        with MasterClient(target, token="test-token", timeout_s=2, retry=PATIENT) as client:
            session = client.lease_session()
            lease = session.lease if stream else client.lease
            held: list[int] = []
            while True:
                resp = lease(dataset, node_id=node, rank=0, done=held)
                held = []
                kind = resp.WhichOneof("outcome")
                if kind == "end_of_dataset":
                    session.close()
                    return
                if kind == "wait":
                    time.sleep(resp.wait.retry_after_ms / 1000)
                    continue
                if kind == "end_of_epoch":
                    continue
                shard = resp.shard
                with lock:
                    for position in range(shard.start, shard.end):
                        ledger[(shard.epoch, position)] += 1
                time.sleep(0.001)
                held = [shard.lease_id]
    except BaseException as error:  # noqa: BLE001 - reported to the test thread
        errors.append(error)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_sigkilled_master_restarted_on_same_store_loses_and_duplicates_nothing(
    master_process: Callable[..., MasterProcess], store_url: str, stream: bool
) -> None:
    consumers = 4
    master = master_process(store_url)
    size, epochs = 1500, 2
    with MasterClient(master.address, token="test-token") as client:
        client.register_dataset(
            shards_pb2.DatasetSpec(
                name="data", size=size, batch_size=5, shard_size=10, epochs=epochs, seed=11
            )
        )
        # A lease held across the crash must still be ackable afterwards.
        survivor = client.lease("data", node_id="survivor", rank=0).shard

    ledger: Counter[tuple[int, int]] = Counter()
    lock = threading.Lock()
    errors: list[BaseException] = []
    threads = [
        threading.Thread(
            target=consume,
            args=(master.address, "data", f"n{i}", ledger, lock, errors, stream),
        )
        for i in range(consumers)
    ]
    for t in threads:
        t.start()
    while sum(ledger.values()) < size // 2:
        assert not errors, errors
        time.sleep(0.01)
    master.kill()
    downtime_started = time.monotonic()
    time.sleep(0.5)
    master = master_process(store_url, "--resume", port=master.port)
    assert time.monotonic() - downtime_started < 15

    with MasterClient(master.address, token="test-token", retry=PATIENT) as client:
        assert not client.report_done("data", survivor.lease_id).duplicate
        for position in range(survivor.start, survivor.end):
            ledger[(survivor.epoch, position)] += 1
    for t in threads:
        t.join(120)
    assert not errors, errors
    expected = {(e, p) for e in range(epochs) for p in range(size)}
    assert set(ledger) == expected, "records were lost"
    assert max(ledger.values()) == 1, "records were trained twice"
    with MasterClient(master.address, token="test-token") as client:
        status = client.dataset_status("data")
        assert status.finished and status.leases_active == 0


def test_a_hung_master_ends_in_a_clear_error_within_the_deadline_and_recovers(
    master_process: Callable[..., MasterProcess], tmp_path: Path
) -> None:
    master = master_process(f"sqlite:///{tmp_path / 'm.db'}")
    assert master.proc is not None
    policy = RetryPolicy(attempts=3, initial_backoff_s=0.05, max_backoff_s=0.1, total_budget_s=5)
    with MasterClient(master.address, token="test-token", timeout_s=0.5, retry=policy) as client:
        client.register_dataset(
            shards_pb2.DatasetSpec(name="d", size=100, batch_size=10, shard_size=20, epochs=1)
        )
        with client.lease_session() as session:
            first = session.lease("d", node_id="n", rank=0).shard
            os.kill(master.proc.pid, signal.SIGSTOP)  # hung, not dead: no connection error
            try:
                started = time.monotonic()
                with pytest.raises(Unavailable, match="DEADLINE_EXCEEDED"):
                    session.lease("d", node_id="n", rank=0, done=[first.lease_id])
                assert time.monotonic() - started < 4
                with pytest.raises(Unavailable, match="DEADLINE_EXCEEDED"):
                    client.dataset_status("d")
            finally:
                os.kill(master.proc.pid, signal.SIGCONT)
            # The same request again, after the master woke up: the DONE report
            # may or may not have landed the first time; either way it counts once.
            second = session.lease("d", node_id="n", rank=0, done=[first.lease_id]).shard
            assert second.start >= first.end
            assert client.dataset_status("d").records_done == first.end - first.start
