"""The state store interface: a journal of events and per-stream checkpoints.

The master's cores are deterministic: state = checkpoint + the events after it.
So the store only has to keep opaque text payloads in order. A stream is one
independently recoverable piece of state ("dataset/<name>", "nodes").

Invariants every implementation keeps (tests/integration/store checks them):
- `append` is atomic and durable when it returns: all entries or none.
- Sequence numbers are strictly increasing across all streams, in append order,
  and continue after a reopen.
- `load` returns, per stream, the latest checkpoint and exactly the entries of
  that stream appended after it, in sequence order.
- `checkpoint(stream, payload, upto_seq)` atomically replaces the stream's
  checkpoint and drops that stream's entries with seq <= upto_seq: `load` never
  returns them again. An implementation may delete their rows later (in bounded
  pieces, so that no single write stalls the appends behind it).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field

from dlfleet.api.errors import DlfleetError


class StoreError(DlfleetError):
    """The store could not read or write; the state in it is unchanged."""


@dataclass(frozen=True)
class JournalEntry:
    seq: int
    stream: str
    payload: str


@dataclass(frozen=True)
class Checkpoint:
    stream: str
    upto_seq: int
    payload: str


@dataclass(frozen=True)
class StreamState:
    """What `load` gives back for one stream."""

    checkpoint: Checkpoint | None
    entries: tuple[JournalEntry, ...] = field(default_factory=tuple)


class StateStore(abc.ABC):
    @property
    def url(self) -> str:
        """Where the store is, for messages (never with a password)."""
        return type(self).__name__

    @abc.abstractmethod
    def append(self, entries: Sequence[tuple[str, str]]) -> int:
        """Durably append (stream, payload) pairs in one transaction.

        Returns the sequence number of the last entry (or the current last
        sequence number when `entries` is empty)."""

    @abc.abstractmethod
    def load(self) -> dict[str, StreamState]:
        """Every stream's checkpoint and the entries after it."""

    @abc.abstractmethod
    def checkpoint(self, stream: str, payload: str, upto_seq: int) -> None:
        """Replace `stream`'s checkpoint and drop its entries up to `upto_seq`."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections. Idempotent."""
