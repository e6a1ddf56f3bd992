"""Events of the shard core: the only way its state changes.

Every operation first *decides* (reads the state, validates, and returns a list
of events, or raises without touching anything), then *applies* those events.
The same `apply` replays the journal after a restart, so a master started again
on the same store rebuilds exactly the state it had. Events are plain values
with a stable JSON form; nothing here reads a clock.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

# The master encodes every event of every lease and ack on its event loop
# (a seventh of its samples at 64 clients); `dataclasses.fields()` and a fresh
# encoder per `json.dumps(..., separators=...)` call cost a sixth of that.
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode
_FIELD_NAMES: dict[type[Any], tuple[str, ...]] = {}


def _field_names(kind: type[Any]) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(kind)
    if names is None:
        names = _FIELD_NAMES[kind] = tuple(f.name for f in dataclasses.fields(kind))
    return names


@dataclass(frozen=True, slots=True)
class Event:
    dataset: str

    def to_json(self) -> str:
        kind = type(self)
        data: dict[str, Any] = {"t": kind.__name__}
        for name in _field_names(kind):
            data[name] = getattr(self, name)
        return _ENCODE(data)

    @staticmethod
    def from_json(text: str) -> Event:
        data = json.loads(text)
        kind = EVENT_TYPES[data.pop("t")]
        return kind(**data)


@dataclass(frozen=True, slots=True)
class DatasetRegistered(Event):
    config: dict[str, Any]


@dataclass(frozen=True, slots=True)
class RoundAdvanced(Event):
    """The dataset now serves `round`; older rounds are stale."""

    round: int


@dataclass(frozen=True, slots=True)
class LeaseGranted(Event):
    lease_id: int
    shard: int
    start: int
    end: int
    deadline_ms: int
    consumer: str
    node_id: str
    round: int
    position: int  # -1 for a rank consumer
    request_id: str


@dataclass(frozen=True, slots=True)
class LeaseRenewed(Event):
    lease_id: int
    consumed: int
    deadline_ms: int


@dataclass(frozen=True, slots=True)
class LeaseDone(Event):
    lease_id: int


@dataclass(frozen=True, slots=True)
class LeaseReleased(Event):
    """Expiry, holder death, a closed round: the consumed part is done, the
    remainder goes back to the head of TODO, and nothing counts against it."""

    lease_id: int
    consumed: int
    reason: str


@dataclass(frozen=True, slots=True)
class ShardFailed(Event):
    """An explicit failure: counts against the shard."""

    lease_id: int
    consumed: int
    reason: str


@dataclass(frozen=True, slots=True)
class ConsumerAnswered(Event):
    """A consumer was told the end of an epoch or of the dataset; rounds record
    the answer at `position` so every rank hears the same."""

    consumer: str
    position: int
    answer: str  # "end_of_epoch" | "end_of_dataset"
    epoch: int
    cursor: int  # the consumer's epoch from now on


@dataclass(frozen=True, slots=True)
class EpochCompleted(Event):
    epoch: int


@dataclass(frozen=True, slots=True)
class Restored(Event):
    snapshot: dict[str, Any]
    restore_key: str


EVENT_TYPES: dict[str, type[Event]] = {
    kind.__name__: kind
    for kind in (
        DatasetRegistered,
        RoundAdvanced,
        LeaseGranted,
        LeaseRenewed,
        LeaseDone,
        LeaseReleased,
        ShardFailed,
        ConsumerAnswered,
        EpochCompleted,
        Restored,
    )
}
