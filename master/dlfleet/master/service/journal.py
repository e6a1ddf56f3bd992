"""The master's journal: every event any core decides, written in one place.

A core's decision is a list of events (shard `Event`s, `RendezvousEvent`s,
`CheckpointEvent`s, `NodeEvent`s), already applied to that core's state when
they get here. `Journal.append` routes each to its stream and queues them all
as ONE group-committer submission, so that what one decision changed becomes
durable together or not at all, and after everything queued before it (the
committer keeps the order of submissions). Streams:

- "dataset/<name>": the shard events of one dataset, and every
  `compact_every` of them a full checkpoint of the dataset (the store then
  drops the entries before it);
- "nodes": registrations and forgotten nodes (`core.node_events`);
- "rendezvous": joins and rounds;
- "checkpoints": the checkpoint table's events, and every
  `checkpoints_compact_every` of them a snapshot of the whole table, so the
  stream stays short however long the job runs;
- "restart_loop": the restart-loop breaker's decisions
  (`core.restart_loop`), and every `RESTART_LOOP_COMPACT_EVERY` of them a
  snapshot of the breaker, so a master restart keeps its ceiling and a
  broken job stays broken;
- "goodput": the job's goodput ledger (`core.goodput`), the whole of it,
  written every few seconds by the master (`record_goodput`); each write is
  also the stream's checkpoint, so the stream holds one entry;
- "job": the job's identity (`core.job_identity`), written once.

A checkpoint is its own submission queued right after the one that made it
due, so that its seq is known when it is durable: the store is then told to
move it out of the journal and drop what it replaces (`StateStore.checkpoint`).

Three ways to learn that an append is durable, as the callers need: a Future
(`append`), a sink told once per committed batch (`append_to`, the shard RPCs'
path: no Future and no per-request wake-up of the loop), or none at all
(`append_detached`, for joins: nothing is told until their round forms, and
the round's append comes after theirs).

Lives in the master service process.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, cast

from dlfleet.master.core.checkpoint_events import CheckpointEvent
from dlfleet.master.core.checkpoints import CheckpointTable
from dlfleet.master.core.codec import dump_dataset
from dlfleet.master.core.events import Event
from dlfleet.master.core.job_identity import JobIdentity
from dlfleet.master.core.node_events import NodeEvent
from dlfleet.master.core.rendezvous import RendezvousEvent
from dlfleet.master.core.restart_loop import BreakerEvent, RestartLoopBreaker
from dlfleet.master.core.shards import ShardBook
from dlfleet.master.store.base import StateStore, StoreError
from dlfleet.master.store.groupcommit import CommitSink, GroupCommitter

_log = logging.getLogger(__name__)

JOB_STREAM = "job"
NODES_STREAM = "nodes"
RENDEZVOUS_STREAM = "rendezvous"
DATASET_PREFIX = "dataset/"
CHECKPOINT = "DatasetCheckpoint"  # a full checkpoint of one dataset
CHECKPOINTS_STREAM = "checkpoints"
CHECKPOINT_TABLE = "CheckpointTable"  # a full snapshot of the checkpoint table
RESTART_LOOP_STREAM = "restart_loop"
BREAKER = "RestartLoopBreaker"  # a full snapshot of the restart-loop breaker
RESTART_LOOP_COMPACT_EVERY = 256
GOODPUT_STREAM = "goodput"
GOODPUT = "GoodputLedger"  # the whole goodput ledger

# What any core decides, as the journal takes it.
JournalEvent = Event | RendezvousEvent | CheckpointEvent | NodeEvent | BreakerEvent


class Journal:
    """Not thread-safe, like the cores whose events it takes: one owner (the
    master's event loop) appends. The writing happens on the committer's
    thread."""

    def __init__(
        self,
        store: StateStore,
        book: ShardBook,
        checkpoints: CheckpointTable,
        *,
        compact_every: int,
        checkpoints_compact_every: int,
    ) -> None:
        """`compact_every`, `checkpoints_compact_every`: the entries a dataset's
        stream, and the checkpoints stream, hold before they are checkpointed."""
        self._store = store
        self._compact_every = compact_every
        self._checkpoints_compact_every = checkpoints_compact_every
        # What a checkpoint is taken of (read when one is due).
        self._book = book
        self._checkpoints = checkpoints
        # The restart-loop breaker its stream's snapshots are taken of (the
        # master's own, set by `MasterState`).
        self.breaker = RestartLoopBreaker()
        self._committer = GroupCommitter(store)
        # Entries per stream since its last checkpoint.
        self._since: Counter[str] = Counter()
        # Streams that are due a checkpoint after the append being routed.
        self._due: list[str] = []
        # Shown every shard event as it is appended (the metrics count them).
        self.on_events: Callable[[Sequence[Event]], None] | None = None

    @property
    def committer(self) -> GroupCommitter:
        return self._committer

    # --------------------------------------------------------------- append

    def append(self, events: Sequence[JournalEvent]) -> Future[int]:
        """Queue `events` as one durable write; the Future gives its last seq.
        An empty list still waits for everything queued before it: an answer
        read from state that is not yet durable must not leave before that
        state is."""
        future = self._committer.submit(self._route(events))
        self._checkpoint_due()
        return future

    def append_to(self, events: Sequence[JournalEvent], sink: CommitSink, token: object) -> None:
        """`append`, with the outcome told to `sink` with `token`
        (`GroupCommitter.submit_to`) instead of a Future."""
        self._committer.submit_to(self._route(events), sink, token)
        if self._due:
            self._checkpoint_due()

    def append_detached(self, events: Sequence[JournalEvent]) -> None:
        """`append` for events nobody waits for: the next append's wait covers
        them."""
        self._committer.submit_detached(self._route(events))
        self._checkpoint_due()

    def record_identity(self, identity: JobIdentity) -> Future[int]:
        """The job this store holds from now on."""
        return self._committer.submit([(JOB_STREAM, identity.to_json())])

    def record_goodput(self, ledger: dict[str, Any]) -> None:
        """The goodput ledger as it stands (`GoodputLedger.to_dict`), for a
        restarted master to go on from. Nobody waits for it; once durable it
        replaces the stream's previous write."""
        payload = json.dumps({"t": GOODPUT, "state": ledger}, separators=(",", ":"))
        self._committer.submit([(GOODPUT_STREAM, payload)]).add_done_callback(
            self._compactor(GOODPUT_STREAM, payload)
        )

    def replayed(self, stream: str, entries: int) -> None:
        """Recovery found `entries` entries after `stream`'s checkpoint."""
        self._since[stream] = entries

    def close(self) -> None:
        """Write what is queued, then stop the writer."""
        self._committer.close()

    # -------------------------------------------------------------- routing

    def _route(self, events: Sequence[JournalEvent]) -> list[tuple[str, str]]:
        """(stream, payload) per event, counting toward each stream's next
        checkpoint. Shard events come first in the test: they are nearly all
        of them (every lease and ack)."""
        entries: list[tuple[str, str]] = []
        since = self._since
        shards_only = True
        for event in events:
            if isinstance(event, Event):
                stream = DATASET_PREFIX + event.dataset
                count = since[stream] = since[stream] + 1
                if count >= self._compact_every:
                    self._note_due(stream)
            else:
                shards_only = False
                stream = _stream_of(event)
                every = _COMPACTED.get(stream)
                if every is not None:
                    count = since[stream] = since[stream] + 1
                    if count >= every(self):
                        self._note_due(stream)
            entries.append((stream, event.to_json()))
        if self.on_events is not None:
            if shards_only:  # the loop saw that every event is a shard event
                self.on_events(cast(Sequence[Event], events))
            else:
                self.on_events([e for e in events if isinstance(e, Event)])
        return entries

    def _note_due(self, stream: str) -> None:
        if stream not in self._due:
            self._due.append(stream)

    # ----------------------------------------------------------- compaction

    def _checkpoint_due(self) -> None:
        for stream in self._due:
            self._since[stream] = 0
            payload = self._snapshot(stream)
            # Its own submission, so that the future's seq is the checkpoint's.
            self._committer.submit([(stream, payload)]).add_done_callback(
                self._compactor(stream, payload)
            )
        self._due.clear()

    def _snapshot(self, stream: str) -> str:
        if stream == CHECKPOINTS_STREAM:
            data = {"t": CHECKPOINT_TABLE, "state": self._checkpoints.to_dict()}
        elif stream == RESTART_LOOP_STREAM:
            data = {"t": BREAKER, "state": self.breaker.to_dict()}
        else:
            dataset = self._book.datasets[stream.removeprefix(DATASET_PREFIX)]
            data = {"t": CHECKPOINT, "state": dump_dataset(dataset)}
        return json.dumps(data, separators=(",", ":"))

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


# The streams of whole-state snapshots other than the datasets': how many
# entries each holds before its next snapshot.
_COMPACTED: dict[str, Callable[[Journal], int]] = {
    CHECKPOINTS_STREAM: lambda journal: journal._checkpoints_compact_every,
    RESTART_LOOP_STREAM: lambda journal: RESTART_LOOP_COMPACT_EVERY,
}


def _stream_of(event: RendezvousEvent | CheckpointEvent | NodeEvent | BreakerEvent) -> str:
    if isinstance(event, RendezvousEvent):
        return RENDEZVOUS_STREAM
    if isinstance(event, CheckpointEvent):
        return CHECKPOINTS_STREAM
    if isinstance(event, NodeEvent):
        return NODES_STREAM
    if isinstance(event, BreakerEvent):
        return RESTART_LOOP_STREAM
    raise TypeError(f"no journal stream takes {event!r}")
