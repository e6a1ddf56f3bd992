"""A master decision is one journal append, and nobody hears of it before
that append is durable: a node's loss (the node forgotten, its leases
released, its checkpoint images lost, its round closed) and a registration
that replaces a live incarnation, on a real store. A node dropped for its
silence is a loss like any other: counted, and on the timeline."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from harness import Running, StartMaster

from dlfleet.api.v1 import rendezvous_pb2
from dlfleet.master.core.checkpoint_events import ImageCopy
from dlfleet.master.core.checkpoints import CheckpointReport
from dlfleet.master.core.datasets import DatasetConfig
from dlfleet.master.core.liveness import LivenessSettings
from dlfleet.master.core.rendezvous import RendezvousSettings
from dlfleet.master.core.shards import RankConsumer
from dlfleet.master.service.executor import Decision, Executor
from dlfleet.master.service.journal import (
    CHECKPOINTS_STREAM,
    DATASET_PREFIX,
    NODES_STREAM,
    RENDEZVOUS_STREAM,
    JournalEvent,
)
from dlfleet.master.service.membership import Membership
from dlfleet.master.service.metrics import MasterMetrics
from dlfleet.master.service.rpc import Durable, system_clock
from dlfleet.master.service.state import MasterSettings, MasterState
from dlfleet.master.service.timeline import EventKind, Timeline
from dlfleet.master.store.base import StateStore, StreamState
from dlfleet.master.store.sql import open_store

pytestmark = pytest.mark.integration

SETTINGS = MasterSettings(rendezvous=RendezvousSettings(min_nodes=2, max_nodes=2))
Session = asyncio.Queue[rendezvous_pb2.SessionEvent | None]


class GatedStore(StateStore):
    """A real store whose appends wait while the gate is shut."""

    def __init__(self, inner: StateStore) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.gate.set()

    def append(self, entries: Sequence[tuple[str, str]]) -> int:
        self.gate.wait(30)
        return self.inner.append(entries)

    def load(self) -> dict[str, StreamState]:
        return self.inner.load()

    def checkpoint(self, stream: str, payload: str, upto_seq: int) -> None:
        self.inner.checkpoint(stream, payload, upto_seq)

    def close(self) -> None:
        self.inner.close()


class Master:
    """The master's cores, journal, executor and membership on this loop,
    without gRPC: nodes a and b in round 1, a holding a lease and the only
    copy of step 1's image, each with an open session."""

    def __init__(self, store: GatedStore) -> None:
        self.store = store
        self.state = MasterState(store, SETTINGS)
        self.executor = Executor(self.state.journal, Durable(asyncio.get_running_loop()))
        self.timeline = Timeline()
        self.membership = Membership(
            self.state, system_clock, self.executor, MasterMetrics(), self.timeline
        )
        self.sessions: dict[str, Session] = {}

    async def form_round(self) -> tuple[str, str]:
        state, now = self.state, system_clock()
        ids = []
        for name in ("a", "b"):
            record, registered = state.nodes.register(name, 1, "127.0.0.1", now)
            await self.executor.carry_out(Decision([*registered]))
            self.sessions[record.node_id] = self.membership.sessions[record.node_id] = (
                asyncio.Queue()
            )
            ids.append(record.node_id)
        for port, node_id in enumerate(ids):
            joined = state.rendezvous.join(node_id, 1, "127.0.0.1", 29500 + port, now)
            await self.membership.apply(joined)
        assert state.rendezvous.state.active is not None
        a, b = ids
        config = DatasetConfig.create(name="d", size=100, batch_size=5, shard_size=10)
        events: list[JournalEvent] = [*state.book.register(config)[1]]
        events += state.book.lease("d", RankConsumer(a, 0), now)[1]
        copy = ImageCopy(0, a, "127.0.0.1:1", False, 10)
        events += state.checkpoints.report(CheckpointReport(a, 1, 1, 1, (copy,)))[1]
        await self.executor.commit(events)
        return a, b

    def written_after(self, seq: int) -> list[tuple[str, str]]:
        """(stream, t) of every entry the store holds after `seq`, in order."""
        entries = [entry for stream in self.store.load().values() for entry in stream.entries]
        return [
            (entry.stream, json.loads(entry.payload)["t"])
            for entry in sorted(entries, key=lambda entry: entry.seq)
            if entry.seq > seq
        ]


def test_a_node_loss_is_one_append_of_every_core_it_touches(tmp_path: Path) -> None:
    async def scenario() -> None:
        master = Master(GatedStore(open_store(f"sqlite:///{tmp_path / 'master.db'}")))
        try:
            a, b = await master.form_round()
            before_seq = await master.executor.commit([])
            before = master.state.committer.submissions
            await master.membership.node_lost(a, "left")
            assert master.state.committer.submissions == before + 1
            assert master.written_after(before_seq) == [
                (NODES_STREAM, "node_gone"),
                (DATASET_PREFIX + "d", "LeaseReleased"),
                (CHECKPOINTS_STREAM, "NodeGone"),
                (RENDEZVOUS_STREAM, "RoundClosed"),
            ]
            push = master.sessions[b].get_nowait()
            assert push is not None and push.re_rendezvous.closed_round == 1
            lost = [e for e in master.timeline.since() if e.kind is EventKind.NODE_LOST]
            assert [(e.fields["node_id"], e.fields["reason"]) for e in lost] == [(a, "left")]
        finally:
            master.state.close()

    asyncio.run(scenario())


def test_nobody_hears_of_a_loss_before_it_is_durable(tmp_path: Path) -> None:
    async def scenario() -> None:
        master = Master(GatedStore(open_store(f"sqlite:///{tmp_path / 'master.db'}")))
        try:
            a, b = await master.form_round()
            master.store.gate.clear()
            heard: list[str] = []

            async def listener(node_id: str) -> None:
                heard.append(node_id)

            master.membership.lost_listeners.append(listener)
            loss = asyncio.create_task(master.membership.node_lost(a, "missed its heartbeats"))
            await asyncio.sleep(0.3)
            # Decided and applied at once (the next decision reads it) ...
            assert master.state.rendezvous.state.active is None
            assert "a" not in master.state.nodes.nodes
            # ... but told to no one while the append waits.
            assert not loss.done()
            assert master.sessions[b].empty() and heard == []
            assert not any(e.kind is EventKind.NODE_LOST for e in master.timeline.since())
            master.store.gate.set()
            await asyncio.wait_for(loss, 10)
            assert not master.sessions[b].empty() and heard == [a]
        finally:
            master.store.gate.set()
            master.state.close()

    asyncio.run(scenario())


def test_a_replaced_incarnation_is_lost_in_the_registrations_append(
    start_master: StartMaster,
) -> None:
    running: Running = start_master(MasterSettings(job_name="job"))
    first = running.client.register_node(job_name="job", node_name="n", local_world_size=1)
    before = running.state.committer.submissions
    second = running.client.register_node(job_name="job", node_name="n", local_world_size=1)
    assert running.state.committer.submissions == before + 1
    assert second.incarnation == first.incarnation + 1
    kinds = [(e.kind, e.fields.get("node_id")) for e in running.server.timeline.since()]
    assert kinds[-2:] == [
        (EventKind.NODE_REGISTERED, second.node_id),
        (EventKind.NODE_LOST, first.node_id),
    ]


def test_a_node_that_missed_its_heartbeats_is_counted_and_said_when_it_is_dropped(
    start_master: StartMaster,
) -> None:
    liveness = LivenessSettings(heartbeat_interval_ms=50, heartbeat_timeout_ms=200)
    running: Running = start_master(MasterSettings(job_name="job", liveness=liveness))
    node = running.client.register_node(job_name="job", node_name="n", local_world_size=1)
    metrics = running.server.metrics.registry
    deadline = time.monotonic() + 10
    while metrics.get_sample_value("dlfleet_heartbeats_missed_total") != 1:
        assert time.monotonic() < deadline, "the silent node was never counted"
        time.sleep(0.05)
    reason = {"reason": "heartbeat_missed"}
    assert metrics.get_sample_value("dlfleet_node_failures_total", reason) == 1
    lost = [e for e in running.server.timeline.since() if e.kind is EventKind.NODE_LOST]
    assert [(e.fields["node_id"], e.fields["reason"]) for e in lost] == [
        (node.node_id, "missed its heartbeats")
    ]
