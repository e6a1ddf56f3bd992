"""The one path from a master decision to its effects: decide, one journal
append, apply, deliver.

1. Decide. A core reads its state, validates, and returns the events of its
   decision, or raises with nothing changed. A decision may span cores: a
   node's loss is the node forgotten, its leases released, its checkpoint
   images lost and its rendezvous place removed (`Membership.loss`).
2. One journal append. Every event of the decision, whichever core decided
   it, goes into ONE group-commit submission (`Journal`): the decision is
   durable as a whole or not at all, and only after everything decided
   before it.
3. Apply. Each core applies its events through its one `apply` (the same that
   replays the journal after a restart) as it decides them, on the event loop
   and before anything awaits: so no other request sees a half-made decision,
   and the next decision reads what this one changed, although neither is
   durable yet.
4. Deliver, once the append is durable and not before: the answer to the RPC,
   the joiners woken, the pushes down the sessions, the timeline and the
   metrics, the listeners. A master that crashes before then told no one of
   what it had not written.

`Decision` carries the events and the effects that deliver them;
`Executor.carry_out` does 2 and 4 for it. The shard RPCs, the master's hot
path (a lease and an ack per shard), skip the `Decision`: `commit` hands their
events to the journal with the loop's `Durable` as the sink and returns the
future to await, one per request, as before there was an executor. Joins are
the one write nobody waits for (`record`): a join tells no one anything until
its round forms, and the round's append comes after the join's.

Lives in the master service process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from dlfleet.master.service.journal import Journal, JournalEvent
from dlfleet.master.service.rpc import Durable

# What a decision does once it is durable.
Effect = Callable[[], Awaitable[None]]


@dataclass
class Decision:
    """The events a decision made (applied already) and the effects that
    deliver it, in order."""

    events: list[JournalEvent] = field(default_factory=list)
    effects: list[Effect] = field(default_factory=list)

    def then(self, other: Decision) -> Decision:
        """This decision and `other` as one: one append, then this one's
        effects, then `other`'s."""
        return Decision(self.events + other.events, self.effects + other.effects)


class Executor:
    """Owns the way from the cores' events to the journal and back to the
    loop: one per master server, on its event loop."""

    def __init__(self, journal: Journal, durable: Durable) -> None:
        self._journal = journal
        self._durable = durable

    def commit(self, events: Sequence[JournalEvent]) -> asyncio.Future[int]:
        """Append `events` as one write; the future is done once they (and
        everything appended before them) are durable. Empty `events` still
        wait: an answer read from state must not leave before that state is
        durable."""
        waiter = self._durable.waiter()
        self._journal.append_to(events, self._durable, waiter)
        return waiter

    def record(self, events: Sequence[JournalEvent]) -> None:
        """Append `events` with nobody waiting: the next commit covers them."""
        self._journal.append_detached(events)

    async def carry_out(self, decision: Decision) -> None:
        """One append of the decision's events; once durable, its effects."""
        await self.commit(decision.events)
        for effect in decision.effects:
            await effect()
