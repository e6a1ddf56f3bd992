"""The master's state: the pure cores plus their durable journal.

`MasterState` owns the shard book and the node table, persists the events every
operation returns through a group committer, and rebuilds both from the store
when a master starts again. Journal streams: "dataset/<name>" holds shard
events and, every `compact_every` events, a full checkpoint of the dataset (the
store then drops the entries before it); "nodes" holds registrations;
"rendezvous" holds joins and rounds; "checkpoints" holds the in-memory
checkpoint table's events and, every `checkpoints_compact_every` events, a full
snapshot of that table (so the stream stays short however long the job runs).

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
holds leave the rendezvous (`Rendezvous.restarted`).

Lives in the master service process.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from dlfleet.master.core.checkpoint_events import CheckpointEvent
from dlfleet.master.core.checkpoints import CheckpointSettings, CheckpointTable
from dlfleet.master.core.codec import dump_dataset, load_dataset
from dlfleet.master.core.events import EVENT_TYPES, Event
from dlfleet.master.core.job_identity import JobId, JobIdentity, claim_store
from dlfleet.master.core.liveness import LivenessSettings, NodeRecord, NodeTable
from dlfleet.master.core.node_check import NodeCheckBoard, NodeCheckSettings
from dlfleet.master.core.rendezvous import Rendezvous, RendezvousEvent, RendezvousSettings
from dlfleet.master.core.shards import ShardBook, ShardSettings
from dlfleet.master.core.suspicion import SUSPECT_AFTER_ROUNDS, NetworkSuspicion
from dlfleet.master.store.base import StateStore, StoreError, StreamState
from dlfleet.master.store.groupcommit import CommitSink, GroupCommitter

_log = logging.getLogger(__name__)

JOB_STREAM = "job"
NODES_STREAM = "nodes"
RENDEZVOUS_STREAM = "rendezvous"
DATASET_PREFIX = "dataset/"
CHECKPOINT = "DatasetCheckpoint"
CHECKPOINTS_STREAM = "checkpoints"
CHECKPOINT_TABLE = "CheckpointTable"  # a full snapshot of the checkpoint table


@dataclass(frozen=True)
class MasterSettings:
    job_name: str = "job"
    shard: ShardSettings = field(default_factory=ShardSettings)
    liveness: LivenessSettings = field(default_factory=LivenessSettings)
    rendezvous: RendezvousSettings = field(default_factory=RendezvousSettings)
    compact_every: int = 20_000
    checkpoints: CheckpointSettings = field(default_factory=CheckpointSettings)
    # A checkpoint report event holds a node's copies of one step (a few
    # hundred bytes); a snapshot holds `keep_steps` steps of every rank.
    checkpoints_compact_every: int = 2_000
    node_check: NodeCheckSettings = field(default_factory=NodeCheckSettings)
    # Closed rounds whose network failures must blame a node before it is a
    # suspect (dlfleet.master.core.suspicion).
    network_suspect_rounds: int = SUSPECT_AFTER_ROUNDS


class MasterState:
    def __init__(self, store: StateStore, settings: MasterSettings) -> None:
        self.settings = settings
        self.book = ShardBook(settings.shard)
        self.nodes = NodeTable(settings.liveness)
        self.rendezvous = Rendezvous(settings.rendezvous)
        self.checkpoints = CheckpointTable(settings.checkpoints)
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
        self._store = store
        # The job the store holds, once `recover` took it.
        self.identity: JobIdentity | None = None
        self._committer = GroupCommitter(store)
        self._since_checkpoint: Counter[str] = Counter()
        # Shown every shard event as it is persisted (the metrics count them).
        self.on_events: Callable[[Sequence[Event]], None] | None = None

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
        rearmed = state.book.rearm(now_ms)
        if rearmed:
            state.persist(rearmed).result()
        live = [record.node_id for record in state.nodes.nodes.values()]
        lost = state.checkpoints.nodes_gone_except(live)
        if lost:
            state.persist_checkpoints(lost).result()
        restarted = state.rendezvous.restarted(live, now_ms)
        if restarted:
            state.persist_rendezvous(restarted).result()
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
            self._since_checkpoint[stream] = len(stored.entries)
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
            self._committer.submit([(JOB_STREAM, claim.identity.to_json())]).result()
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
        if stream == NODES_STREAM:
            if kind == "node":
                self.nodes.restore(
                    data["name"], data["incarnation"], data["local_world_size"], data["host"], 0
                )
            elif kind == "node_gone":
                record = self.nodes.nodes.get(data["name"])
                if record is not None and record.incarnation == data["incarnation"]:
                    self.nodes.forget(data["name"])
            return
        if kind == CHECKPOINT:
            self.book.install(load_dataset(data["state"]))
        elif kind in EVENT_TYPES:
            self.book.apply(Event.from_json(json.dumps(data)))
        else:
            raise StoreError(f"unknown journal entry {kind!r} in stream {stream!r}")

    # ------------------------------------------------------------ persistence

    def persist(self, events: Sequence[Event]) -> Future[int]:
        """Queue `events` (already applied) for a durable write. An empty list
        still waits for everything queued before it: an answer read from state
        that is not yet durable must not leave before that state is."""
        entries = self._journal_entries(events)
        future = self._committer.submit(entries)
        self._checkpoint_due(entries)
        return future

    def persist_to(self, events: Sequence[Event], sink: CommitSink, token: object) -> None:
        """`persist`, with the outcome told to `sink` (`GroupCommitter.submit_to`)."""
        entries = self._journal_entries(events)
        self._committer.submit_to(entries, sink, token)
        self._checkpoint_due(entries)

    def _journal_entries(self, events: Sequence[Event]) -> list[tuple[str, str]]:
        if self.on_events is not None:
            self.on_events(events)
        entries: list[tuple[str, str]] = []
        for event in events:
            stream = DATASET_PREFIX + event.dataset
            entries.append((stream, event.to_json()))
            self._since_checkpoint[stream] += 1
        return entries

    def _checkpoint_due(self, entries: list[tuple[str, str]]) -> None:
        for stream, payload in self._due_checkpoints(entries):
            # Its own submission, so that the future's seq is the checkpoint's.
            self._committer.submit([(stream, payload)]).add_done_callback(
                self._compactor(stream, payload)
            )

    def persist_rendezvous(
        self, events: Sequence[RendezvousEvent], shard_events: Sequence[Event] = ()
    ) -> Future[int]:
        """Rendezvous events and the shard events they caused, in one write."""
        if self.on_events is not None:
            self.on_events(shard_events)
        entries = [(RENDEZVOUS_STREAM, e.to_json()) for e in events]
        for event in shard_events:
            stream = DATASET_PREFIX + event.dataset
            entries.append((stream, event.to_json()))
            self._since_checkpoint[stream] += 1
        return self._committer.submit(entries)

    def persist_joins(self, events: Sequence[RendezvousEvent]) -> None:
        """Rendezvous events nobody waits for (joins: see `Membership.apply`)."""
        self._committer.submit_detached([(RENDEZVOUS_STREAM, e.to_json()) for e in events])

    def persist_checkpoints(self, events: Sequence[CheckpointEvent]) -> Future[int]:
        """Like `persist`, for the checkpoint table's events (already applied):
        an empty list still waits for everything queued before it."""
        stream = CHECKPOINTS_STREAM
        future = self._committer.submit([(stream, event.to_json()) for event in events])
        self._since_checkpoint[stream] += len(events)
        if self._since_checkpoint[stream] >= self.settings.checkpoints_compact_every:
            self._since_checkpoint[stream] = 0
            payload = json.dumps(
                {"t": CHECKPOINT_TABLE, "state": self.checkpoints.to_dict()},
                separators=(",", ":"),
            )
            self._committer.submit([(stream, payload)]).add_done_callback(
                self._compactor(stream, payload)
            )
        return future

    def persist_node(self, record: NodeRecord, gone: bool = False) -> Future[int]:
        data = {
            "t": "node_gone" if gone else "node",
            "name": record.name,
            "incarnation": record.incarnation,
            "local_world_size": record.local_world_size,
            "host": record.host,
        }
        return self._committer.submit([(NODES_STREAM, json.dumps(data))])

    def _due_checkpoints(self, entries: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """A full checkpoint entry for each stream of `entries` that is due one."""
        due: list[tuple[str, str]] = []
        for stream in {stream for stream, _ in entries}:
            if self._since_checkpoint[stream] < self.settings.compact_every:
                continue
            name = stream.removeprefix(DATASET_PREFIX)
            payload = json.dumps(
                {"t": CHECKPOINT, "state": dump_dataset(self.book.datasets[name])},
                separators=(",", ":"),
            )
            due.append((stream, payload))
            self._since_checkpoint[stream] = 0
        return due

    def _compactor(self, stream: str, payload: str) -> Callable[[Future[int]], None]:
        """Runs on the writer thread once the checkpoint entry is durable (the
        last entry of its submission): move it to the checkpoint table and drop
        the stream's older entries."""

        def compact(future: Future[int]) -> None:
            if future.exception() is not None:
                return
            try:
                self._store.checkpoint(stream, payload, future.result())
            except StoreError as exc:
                # Harmless: the checkpoint entry stays in the journal and the
                # next compaction tries again.
                _log.warning("compacting %s failed: %s", stream, exc)

        return compact

    @property
    def committer(self) -> GroupCommitter:
        return self._committer

    def close(self) -> None:
        self._committer.close()
        self._store.close()
