"""The loader's lease thread (fetcher.py) against a real in-process master:
when it asks for more shards."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from harness import TOKEN, Running

from dlfleet.api.v1 import shards_pb2
from dlfleet.worker.loader.environment import LoaderEnvironment, LoaderMode
from dlfleet.worker.loader.fetcher import LeasedShard, LeaseFetcher
from dlfleet.worker.loader.ledger import LeaseLedger

pytestmark = pytest.mark.integration

NAME = "fetched"


def leases_active_reach(running: Running, count: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if running.client.dataset_status(NAME).leases_active >= count:
            return True
        time.sleep(0.02)
    return False


def test_the_next_request_goes_out_once_half_of_the_last_answer_is_taken(
    start_master: Callable[..., Running],
) -> None:
    running = start_master()
    # 20 shards of 5 positions; 4 shards a request, so the next request is
    # due when fewer than 2 answers wait.
    spec = shards_pb2.DatasetSpec(name=NAME, size=100, batch_size=5, shard_size=5, epochs=1)
    running.client.register_dataset(spec)
    env = LoaderEnvironment(running.address, TOKEN, round=1, node_id="n0", rank=0, world_size=1)
    fetcher = LeaseFetcher(
        running.client, LeaseLedger(), NAME, env, LoaderMode.SYNC, shards_per_request=4
    )
    fetcher.start()
    try:
        taken = [fetcher.next_outcome(), fetcher.next_outcome()]
        assert leases_active_reach(running, 4)
        time.sleep(0.3)  # two answers still wait: no request may go out
        assert running.client.dataset_status(NAME).leases_active == 4
        taken.append(fetcher.next_outcome())  # one left: lease the next four now
        assert leases_active_reach(running, 8)
        taken += [fetcher.next_outcome() for _ in range(5)]
    finally:
        fetcher.stop()
    assert all(isinstance(t, LeasedShard) for t in taken)
    starts = [t.start for t in taken if isinstance(t, LeasedShard)]
    assert starts == list(range(0, 40, 5))  # in order, none skipped or repeated
