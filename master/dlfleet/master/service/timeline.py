"""The job's timeline as this master saw it, for `/api/v1/events`: rounds that
formed and closed (and why), nodes that registered and were lost (and why),
worker failures the agents reported (with their diagnosis), node check
verdicts, and, from the job's supervisor, the brain's plans and the nodes it
retired as faulty.

Kept in memory, the newest `capacity` entries: it explains the recent past
to a person or a dashboard, it is not a journal (the store is). Each entry has
a sequence number that only grows, so a reader polls with `since` and misses
nothing that is still kept. A restarted master starts a new timeline.

Lives in the master service process; entries are added on its event loop.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any

DEFAULT_CAPACITY = 1_000


class EventKind(enum.Enum):
    ROUND_FORMED = "round_formed"
    ROUND_CLOSED = "round_closed"
    NODE_REGISTERED = "node_registered"
    NODE_LOST = "node_lost"
    WORKER_FAILED = "worker_failed"
    NODE_CHECKED = "node_checked"  # a pre-flight node check's verdict, with its numbers
    # Seen by the job's supervisor, recorded when its status view brings them.
    BRAIN_PLAN = "brain_plan"
    NODE_RETIRED = "node_retired"  # marked faulty: replaced, never relaunched


@dataclass(frozen=True)
class TimelineEntry:
    seq: int
    at_ms: int  # milliseconds since the Unix epoch
    kind: EventKind
    fields: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "at_ms": self.at_ms, "kind": self.kind.value, **self.fields}


class Timeline:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self._entries: deque[TimelineEntry] = deque(maxlen=capacity)
        self._seq = 0

    def record(self, kind: EventKind, at_ms: int, **fields: Any) -> TimelineEntry:
        self._seq += 1
        entry = TimelineEntry(self._seq, at_ms, kind, fields)
        self._entries.append(entry)
        return entry

    @property
    def last_seq(self) -> int:
        return self._seq

    def since(self, seq: int = 0, limit: int | None = None) -> list[TimelineEntry]:
        """The kept entries after `seq`, oldest first, at most `limit`."""
        newer = [entry for entry in self._entries if entry.seq > seq]
        return newer if limit is None else newer[:limit]
