"""What this process knows about its leases: how much of each has been trained.

A lease is *consumed* up to the records of it that completed steps trained
(global batches are consumed as a unit, in order, so this is always a prefix of
the lease). A fully consumed lease is *ready* to ack; it stays in the ledger
until the master has confirmed the ack, so a snapshot taken while the ack is in
flight still counts it (the master skips leases it already holds DONE).

It also keeps where each lease lies (epoch, first position) and a log of the
leases the master confirmed DONE: from the last snapshot the master gave and
these, a sync-mode loader computes the snapshot the master would give when
the master does not answer (see snapshot.py).

Shared by the loader's thread (which completes batches) and the fetcher thread
(which sends acks): every method takes the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from dlfleet.worker.loader.slicing import GlobalBatch


@dataclass
class HeldLease:
    lease_id: int
    length: int
    epoch: int = 0
    start: int = 0  # its first position in the epoch
    consumed: int = 0
    sending: bool = False  # its ack is on the wire

    @property
    def complete(self) -> bool:
        return self.consumed >= self.length


Span = tuple[int, int, int]  # (epoch, start, end): positions trained


class LeaseLedger:
    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._leases: dict[int, HeldLease] = {}
        self._acked: list[tuple[int, Span]] = []  # (sequence number, span) confirmed DONE
        self._acks = 0  # confirmations so far

    def add(self, lease_id: int, length: int, epoch: int = 0, start: int = 0) -> None:
        with self._lock:
            self._leases.setdefault(lease_id, HeldLease(lease_id, length, epoch, start))

    def consume(self, batch: GlobalBatch) -> bool:
        """A step that trained `batch` completed. True if that completed a
        lease (made it ready to ack)."""
        completed = False
        with self._lock:
            for lease_id, count in batch.lease_counts():
                lease = self._leases.get(lease_id)
                if lease is not None and lease.consumed < lease.length:
                    lease.consumed += count
                    if lease.consumed >= lease.length:
                        lease.consumed = lease.length
                        completed = True
            # No notify: the only waiter (wait_acked) waits for acks to be
            # confirmed, which consuming cannot bring about; this runs every step.
        return completed

    def take_ready(self) -> list[int]:
        """The fully consumed leases whose ack is not on the wire yet; they are
        marked as sending until `confirm` or `retry`."""
        with self._lock:
            ready = [x.lease_id for x in self._leases.values() if x.complete and not x.sending]
            for lease_id in ready:
                self._leases[lease_id].sending = True
            return ready

    def confirm(self, lease_ids: Iterable[int]) -> None:
        with self._lock:
            for lease_id in lease_ids:
                lease = self._leases.pop(lease_id, None)
                if lease is not None:
                    self._acks += 1
                    span = (lease.epoch, lease.start, lease.start + lease.length)
                    self._acked.append((self._acks, span))
            self._lock.notify_all()

    def ack_mark(self) -> int:
        """A mark in the log of confirmations: those before it reached the
        master before anything asked of it after this call."""
        with self._lock:
            return self._acks

    def forget_acked(self, mark: int) -> None:
        """A snapshot asked after `mark` counts the confirmations before it."""
        with self._lock:
            self._acked = [(seq, span) for seq, span in self._acked if seq > mark]

    def trained_since(self, mark: int) -> list[Span]:
        """What was trained and is not in a snapshot asked after `mark`: the
        leases confirmed DONE since, and the consumed prefix of every held one."""
        with self._lock:
            spans = [span for seq, span in self._acked if seq > mark]
            for x in self._leases.values():
                if x.consumed:
                    spans.append((x.epoch, x.start, x.start + x.consumed))
            return spans

    def retry(self, lease_ids: Iterable[int]) -> None:
        """The acks did not arrive: send them again with the next request."""
        with self._lock:
            for lease_id in lease_ids:
                if lease_id in self._leases:
                    self._leases[lease_id].sending = False

    def all_complete(self) -> bool:
        with self._lock:
            return all(x.complete for x in self._leases.values())

    def wait_acked(self, timeout_s: float) -> bool:
        """Block until no fully consumed lease is left unconfirmed."""
        with self._lock:
            return self._lock.wait_for(
                lambda: not any(x.complete for x in self._leases.values()), timeout_s
            )

    def progress(self) -> list[tuple[int, int]]:
        """(lease id, records consumed) of every lease not confirmed DONE."""
        with self._lock:
            return [(x.lease_id, x.consumed) for x in self._leases.values() if x.consumed]

    def held(self) -> list[tuple[int, int]]:
        """(lease id, records consumed) of every lease, for renewals."""
        with self._lock:
            return [(x.lease_id, x.consumed) for x in self._leases.values()]

    def clear(self) -> None:
        with self._lock:
            self._leases.clear()
            self._acked.clear()
            self._lock.notify_all()
