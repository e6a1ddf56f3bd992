"""The restart-loop breaker through a real master: rounds that restore a step
and fail again lower the ceiling `Latest` obeys, step by step down the held
steps; with none left, joins are refused with the diagnosis, which is the
job's last failure, and a master restarted on the store still refuses them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from harness import LoopThread, Running, stop_in_process

from dlfleet.api.client import MasterClient
from dlfleet.api.errors import StaleError
from dlfleet.api.v1 import checkpoint_pb2, rendezvous_pb2
from dlfleet.master.core.rendezvous import RendezvousSettings
from dlfleet.master.core.restart_loop import BreakerSettings
from dlfleet.master.service.journal import RESTART_LOOP_COMPACT_EVERY, RESTART_LOOP_STREAM
from dlfleet.master.service.state import MasterSettings, MasterState
from dlfleet.master.store.sql import open_store

pytestmark = pytest.mark.integration

SETTINGS = MasterSettings(
    job_name="job",
    rendezvous=RendezvousSettings(min_nodes=1, max_nodes=1, last_call_timeout_ms=0),
    restart_loop=BreakerSettings(failures=2, window=1),
)
Node = tuple[str, int]


def join(client: MasterClient, node: Node) -> int:
    return client.join_rendezvous(
        node_id=node[0],
        incarnation=node[1],
        local_world_size=1,
        host="127.0.0.1",
        bootstrap_port=29500,
        timeout_s=10,
    ).round


def save(client: MasterClient, node: Node, step: int, round_: int) -> None:
    copy = checkpoint_pb2.ImageCopy(rank=0, node_id=node[0], address="a:1", bytes=8)
    client.report_checkpoint(
        checkpoint_pb2.CheckpointReport(
            node_id=node[0],
            incarnation=node[1],
            step=step,
            round=round_,
            world_size=1,
            copies=[copy],
        )
    )


def fail(client: MasterClient, node: Node, round_: int, message: str) -> None:
    client.report_worker_failure(
        rendezvous_pb2.FailureReport(
            node_id=node[0], incarnation=node[1], round=round_, exit_code=1, message=message
        )
    )


def test_rounds_failing_after_each_restore_step_down_then_joins_are_refused(
    start_master: Callable[..., Running], loop_thread: LoopThread, store_url: str
) -> None:
    master = start_master(SETTINGS)
    client = master.client
    reply = client.register_node(job_name="job", node_name="a", local_world_size=1)
    node = (reply.node_id, reply.incarnation)
    round_ = join(client, node)
    for step in (10, 20, 30):
        save(client, node, step, round_)

    restored: list[tuple[int, int]] = []
    refused: StaleError | None = None
    for attempt in range(10):
        latest = client.latest_checkpoint()
        restored.append((latest.step if latest.found else -1, latest.below_step))
        fail(client, node, round_, f"Traceback ...\nValueError: loss is NaN ({attempt})")
        try:
            round_ = join(client, node)
        except StaleError as error:
            refused = error
            break

    # Two rounds per step, each step below the last; the ceiling is told.
    assert restored == [(30, 0), (30, 0), (20, 30), (20, 30), (10, 20), (10, 20)]
    assert refused is not None
    assert "restart loop" in str(refused) and "after restoring step 10" in str(refused)
    assert "loss is NaN (5)" in str(refused)
    # A step asked for below the ceiling is still answered below it.
    assert client.latest_checkpoint(before_step=25).step == 10

    last = client.master_status().failures[-1]
    assert (last.rule, last.category, last.action) == ("restart-loop", "user_error", "fail_job")
    assert "after restoring step 10" in last.message

    stop_in_process(loop_thread, master)
    recovered = MasterState.recover(open_store(store_url), SETTINGS, now_ms=0)
    try:
        assert recovered.breaker.broken is not None
        assert recovered.breaker.broken.step == 10
        assert recovered.breaker.ceiling == 20
    finally:
        recovered.close()


def test_the_breaker_stream_is_compacted_and_recovers_the_same_breaker(store_url: str) -> None:
    live = MasterState(open_store(store_url), SETTINGS)
    breaker = live.breaker
    for round_ in range(1, RESTART_LOOP_COMPACT_EVERY + 40):
        events = breaker.restored(round_, 30 if round_ < 200 else 20)
        events += breaker.failed(round_, -1, f"error {round_}", [], lambda step: step > 10)
        live.journal.append(events).result()
    live.journal.append([]).result()
    expected = breaker.to_dict()
    assert breaker.ceiling == 20
    live.close()

    store = open_store(store_url)
    stream = store.load()[RESTART_LOOP_STREAM]
    assert stream.checkpoint is not None, "no compaction happened"
    assert len(stream.entries) < RESTART_LOOP_COMPACT_EVERY
    recovered = MasterState.recover(store, SETTINGS, now_ms=0)
    try:
        assert recovered.breaker.to_dict() == expected
    finally:
        recovered.close()
