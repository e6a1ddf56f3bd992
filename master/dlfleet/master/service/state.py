"""The master's state: the pure cores, the journal that keeps them, and their
recovery.

`MasterState` owns the shard book, the node table, the rendezvous, the
checkpoint table and the restart-loop breaker, and the `Journal` every
decision of theirs is written to (`service/journal.py`: its streams,
compaction, and the ways to wait for a write). What reaches the journal from
the RPCs goes through the `Executor` (`service/executor.py`); this module
rebuilds the cores from the store when a master starts again.

The "job" stream holds the job's identity (`core.job_identity`): a master
continues the job a store holds only when told to resume it, and only the
job of its own name; a new job writes its identity first.

Recovery = per stream: latest checkpoint, then every later entry, applied in
order with the same `apply` the live master used. Afterwards every live lease
and node gets a fresh timeout, so the master's own downtime expires nothing,
and checkpoint copies on nodes the node table no longer holds are dropped (a
node forgotten just before a crash, before its copies' loss was written).
But no node is counted in a round before it is heard from: the nodes that
were waiting for a round must join again, and nodes the node table no longer
holds leave the rendezvous (`Rendezvous.restarted`). What that changes is one
journal append, written before the master serves anyone.

Lives in the master service process.
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

from dlfleet.master.core.checkpoint_events import CheckpointEvent
from dlfleet.master.core.checkpoints import CheckpointSettings, CheckpointTable
from dlfleet.master.core.codec import load_dataset
from dlfleet.master.core.events import EVENT_TYPES, Event
from dlfleet.master.core.goodput import GoodputLedger
from dlfleet.master.core.job_identity import JobId, JobIdentity, claim_store
from dlfleet.master.core.liveness import LivenessSettings, NodeTable
from dlfleet.master.core.node_check import NodeCheckBoard, NodeCheckSettings
from dlfleet.master.core.node_events import NODE_EVENTS, NodeEvent
from dlfleet.master.core.rendezvous import Rendezvous, RendezvousEvent, RendezvousSettings
from dlfleet.master.core.restart_loop import BreakerEvent, BreakerSettings, RestartLoopBreaker
from dlfleet.master.core.shards import ShardBook, ShardSettings
from dlfleet.master.core.suspicion import SUSPECT_AFTER_ROUNDS, NetworkSuspicion
from dlfleet.master.service.journal import (
    BREAKER,
    CHECKPOINT,
    CHECKPOINT_TABLE,
    CHECKPOINTS_STREAM,
    GOODPUT,
    GOODPUT_STREAM,
    JOB_STREAM,
    NODES_STREAM,
    RENDEZVOUS_STREAM,
    RESTART_LOOP_STREAM,
    Journal,
    JournalEvent,
)
from dlfleet.master.store.base import StateStore, StoreError, StreamState
from dlfleet.master.store.groupcommit import GroupCommitter

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MasterSettings:
    job_name: str = "job"
    shard: ShardSettings = field(default_factory=ShardSettings)
    liveness: LivenessSettings = field(default_factory=LivenessSettings)
    rendezvous: RendezvousSettings = field(default_factory=RendezvousSettings)
    # The entries a dataset's journal stream holds before it is checkpointed.
    compact_every: int = 20_000
    checkpoints: CheckpointSettings = field(default_factory=CheckpointSettings)
    # A checkpoint report event holds a node's copies of one step (a few
    # hundred bytes); a snapshot holds `keep_steps` steps of every rank.
    checkpoints_compact_every: int = 2_000
    node_check: NodeCheckSettings = field(default_factory=NodeCheckSettings)
    # Closed rounds whose network failures must blame a node before it is a
    # suspect (dlfleet.master.core.suspicion).
    network_suspect_rounds: int = SUSPECT_AFTER_ROUNDS
    # When failing again at the same step after every restore steps the job
    # down to an older step (dlfleet.master.core.restart_loop).
    restart_loop: BreakerSettings = field(default_factory=BreakerSettings)


class MasterState:
    def __init__(self, store: StateStore, settings: MasterSettings) -> None:
        self.settings = settings
        self.book = ShardBook(settings.shard)
        self.nodes = NodeTable(settings.liveness)
        self.rendezvous = Rendezvous(settings.rendezvous)
        self.checkpoints = CheckpointTable(settings.checkpoints)
        self.breaker = RestartLoopBreaker(settings.restart_loop)
        # The job's workers restart in place (a node's heartbeat said so); told to
        # nodes as they register, so they start their workers warm. Not
        # journaled: after a master restart the next heartbeat says it again.
        self.restarts_in_place = False
        # node id -> the IP its connection came from (Register, Session):
        # which machine it is on. Not journaled: each session tells it again.
        self.seen_from: dict[str, str] = {}
        # The pre-flight node check: in memory only, a fresh board (and id) per
        # master process; nodes mid-check when the master restarts start over.
        self.node_checks = NodeCheckBoard(settings.node_check, check_id=secrets.token_hex(6))
        # Which node the network failures point at: in memory only (after a
        # master restart, the counting starts over).
        self.suspicion = NetworkSuspicion(settings.network_suspect_rounds)
        # The job's goodput ledger: written whole to the journal every few
        # seconds (`Journal.record_goodput`), so a restarted master goes on
        # from the last write instead of opening a new window.
        self.goodput = GoodputLedger()
        self._store = store
        # The job the store holds, once `recover` took it.
        self.identity: JobIdentity | None = None
        self.journal = Journal(
            store,
            self.book,
            self.checkpoints,
            compact_every=settings.compact_every,
            checkpoints_compact_every=settings.checkpoints_compact_every,
        )
        self.journal.breaker = self.breaker

    # ------------------------------------------------------------ recovery

    @classmethod
    def recover(
        cls, store: StateStore, settings: MasterSettings, now_ms: int, *, resume: bool = True
    ) -> MasterState:
        """The master's state from `store`. A store that holds a job's state is
        continued only with `resume` (`dlmaster --resume`), and only if that
        job is `settings.job_name`: else StoreHoldsAJob or StoreHoldsAnotherJob
        (`core.job_identity`), with nothing written."""
        state = cls(store, settings)
        try:
            streams = store.load()
            identity = state._claim(streams, now_ms, resume)
        except BaseException:
            state.close()
            raise
        for record in state.nodes.nodes.values():
            record.last_seen_ms = now_ms
        live = [record.node_id for record in state.nodes.nodes.values()]
        restart: list[JournalEvent] = []
        restart += state.book.rearm(now_ms)
        restart += state.checkpoints.nodes_gone_except(live)
        restart += state.rendezvous.restarted(live, now_ms)
        if restart:
            state.journal.append(restart).result()
        state.identity = identity
        return state

    def _claim(self, streams: dict[str, StreamState], now_ms: int, resume: bool) -> JobIdentity:
        """Replay `streams` and take the store for this master's job (writing
        its identity when it is new), or refuse it before anything is written."""
        identities = streams.pop(JOB_STREAM, None)  # the last one written holds
        held = JobIdentity.from_json(identities.entries[-1].payload) if identities else None
        for stream, stored in sorted(streams.items()):
            payloads = [stored.checkpoint.payload] if stored.checkpoint else []
            payloads += [entry.payload for entry in stored.entries]
            for payload in payloads:
                self._replay(stream, json.loads(payload))
            self.journal.replayed(stream, len(stored.entries))
        contents = self._contents() if streams else ""
        claim = claim_store(
            held,
            contents,
            store=self._store.url,
            job_name=self.settings.job_name,
            resume=resume,
            new_id=JobId(secrets.token_hex(8)),
            now_ms=now_ms,
        )
        if claim.write:
            self.journal.record_identity(claim.identity).result()
        if claim.resumed:
            _log.info("resuming %s from %s", claim.identity.describe(contents), self._store.url)
        else:
            _log.info("%s starts in %s", claim.identity.describe(), self._store.url)
        return claim.identity

    def _contents(self) -> str:
        """What the recovered state holds, in words, for the logs and for a
        master that may not take the store."""
        last_round = self.rendezvous.state.last_round
        datasets, nodes = len(self.book.datasets), len(self.nodes.nodes)
        return (
            (f"round {last_round}" if last_round else "no round formed yet")
            + f", {datasets} dataset{'' if datasets == 1 else 's'}"
            + f", {nodes} node{'' if nodes == 1 else 's'} registered"
        )

    def _replay(self, stream: str, data: dict[str, Any]) -> None:
        kind = data.get("t")
        if stream == RENDEZVOUS_STREAM:
            self.rendezvous.apply(RendezvousEvent.from_json(json.dumps(data)))
            return
        if stream == CHECKPOINTS_STREAM:
            if kind == CHECKPOINT_TABLE:
                self.checkpoints.install(data["state"])
            else:
                self.checkpoints.apply(CheckpointEvent.from_json(json.dumps(data)))
            return
        if stream == RESTART_LOOP_STREAM:
            if kind == BREAKER:
                self.breaker.install(data["state"])
            else:
                self.breaker.apply(BreakerEvent.from_json(json.dumps(data)))
            return
        if stream == GOODPUT_STREAM:
            if kind != GOODPUT:
                raise StoreError(f"unknown journal entry {kind!r} in stream {stream!r}")
            try:
                self.goodput = GoodputLedger.from_dict(data["state"])
            except (KeyError, TypeError, ValueError) as exc:
                raise StoreError(f"the goodput ledger in the journal is unreadable: {exc}") from exc
            return
        if stream == NODES_STREAM:
            if kind not in NODE_EVENTS:
                raise StoreError(f"unknown journal entry {kind!r} in stream {stream!r}")
            self.nodes.apply(NodeEvent.from_json(json.dumps(data)))
            return
        if kind == CHECKPOINT:
            self.book.install(load_dataset(data["state"]))
        elif kind in EVENT_TYPES:
            self.book.apply(Event.from_json(json.dumps(data)))
        else:
            raise StoreError(f"unknown journal entry {kind!r} in stream {stream!r}")

    @property
    def committer(self) -> GroupCommitter:
        return self.journal.committer

    def close(self) -> None:
        self.journal.close()
        self._store.close()
