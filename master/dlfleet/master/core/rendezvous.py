"""The master's rendezvous: which nodes form round r, with which ranks.

Rules (SPEC section 3):
- A round forms when `max_nodes` have joined, or when at least `min_nodes` have
  joined and `last_call_timeout` has passed since the last join; its size is
  rounded down to a multiple of `node_unit`. After a round closed, it forms as
  soon as every surviving member (and every node that was waiting) has joined
  again: nobody else is expected, so there is no last call to wait out.
- Exclusivity: a node that joins while a round is active waits for the next
  one. If the active round could grow with it, the round is closed at once (the
  members are told to re-rendezvous); if the round is full, the node is a spare.
- A member that dies or leaves closes the round; the survivors re-join. A
  member whose workers finished leaves without closing it (the others may be
  in their last steps); once every member has finished, the round ends.
- Group ranks are 0..W-1; members of the previous round keep their relative
  order first (so a surviving node's rank is stable where it can be), then new
  nodes in join order. Global ranks follow torchrun: prefix sums of local world
  sizes by group rank.
- A node waiting longer than `join_timeout` for a round that cannot form is
  dropped with a clear reason.
- After a master restart, a node is counted only once it joins again (alive);
  one the node table no longer holds leaves the rendezvous (`restarted`).

Every operation validates, then applies events (see `RendezvousEvent`); the
same `apply` replays the journal after a master restart. Time is `now_ms`.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from dlfleet.api.errors import TRAINING_DONE_REFUSAL, InvalidArgument, StaleError, TrainingDone
from dlfleet.master.settings import STANDALONE, check_node_unit, check_nodes

MAX_KEEPER_ADDRESS = 1024

# Every join is journaled: `dataclasses.asdict` (a deep copy through
# `fields()` at every level) was a tenth of the master's CPU per join.
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode
_FIELD_NAMES: dict[type[Any], tuple[str, ...]] = {}


def _plain(value: Any) -> Any:
    """`value` as `dataclasses.asdict` would give it, for JSON."""
    kind = type(value)
    if kind is str or kind is int or kind is bool:
        return value
    if kind is tuple or kind is list:
        return [_plain(item) for item in value]
    names = _FIELD_NAMES.get(kind)
    if names is None:
        if not dataclasses.is_dataclass(value):
            return value
        names = _FIELD_NAMES[kind] = tuple(f.name for f in dataclasses.fields(kind))
    return {name: _plain(getattr(value, name)) for name in names}


@dataclass(frozen=True)
class RendezvousSettings:
    min_nodes: int = STANDALONE.min_nodes
    max_nodes: int = STANDALONE.world_max
    node_unit: int = STANDALONE.node_unit
    last_call_timeout_ms: int = STANDALONE.last_call_timeout_ms
    join_timeout_ms: int = STANDALONE.join_timeout_ms

    def __post_init__(self) -> None:
        check_nodes(self.min_nodes, self.max_nodes)
        check_node_unit(self.node_unit, self.min_nodes, self.max_nodes)
        if self.last_call_timeout_ms < 0 or self.join_timeout_ms < 1:
            raise InvalidArgument("last_call_timeout must be >= 0 and join_timeout > 0")


@dataclass(frozen=True)
class Member:
    node_id: str
    group_rank: int
    local_world_size: int
    host: str
    # host:port of the node's checkpoint Keeper ("" if none). Defaults keep
    # journal entries written before it existed replayable.
    keeper_address: str = ""


@dataclass(frozen=True)
class Round:
    round: int
    members: tuple[Member, ...]  # by group rank
    bootstrap_host: str
    bootstrap_port: int
    formed_ms: int
    # node id -> member: every joiner of a 10,000-node round looks itself up.
    _by_node: dict[str, Member] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_node", {m.node_id: m for m in self.members})

    @property
    def world_size(self) -> int:
        return len(self.members)

    def member(self, node_id: str) -> Member | None:
        return self._by_node.get(node_id)

    def local_world_sizes(self) -> tuple[int, ...]:
        return tuple(m.local_world_size for m in self.members)

    @cached_property
    def world_processes(self) -> int:
        """The processes in the round: the sum of the local world sizes."""
        return sum(m.local_world_size for m in self.members)

    def rank_offset(self, member: Member) -> int:
        """The global rank of `member`'s local rank 0 (torchrun's rule:
        prefix sums of local world sizes by group rank)."""
        return self._offsets[member.group_rank]

    def keeper_peer(self, member: Member) -> str:
        """Where `member` copies its checkpoint images: the Keeper of the next
        member by group rank (cyclically) that has one; "" if no other has."""
        return self._peers[member.group_rank]

    @cached_property
    def hosts(self) -> dict[str, str]:
        """node id -> host of every member (once per round, not per failure)."""
        return {m.node_id: m.host for m in self.members}

    @cached_property
    def size_runs(self) -> tuple[tuple[int, int], ...]:
        """The local world sizes by group rank as (size, count) runs."""
        return tuple(
            (size, len(list(run)))
            for size, run in itertools.groupby(m.local_world_size for m in self.members)
        )

    # Both O(N) once per round, so that each of N members' answers is O(1).
    @cached_property
    def _offsets(self) -> list[int]:
        return list(itertools.accumulate((m.local_world_size for m in self.members), initial=0))

    @cached_property
    def _peers(self) -> list[str]:
        addresses = [m.keeper_address for m in self.members]
        n = len(addresses)
        peers = [""] * n
        # Over the ranks twice, backwards: `nearest` is the first position
        # after i (in the doubled list) with a Keeper; i + n is i itself.
        nearest: int | None = None
        for i in range(2 * n - 1, -1, -1):
            if i < n and nearest is not None and nearest < i + n:
                peers[i] = addresses[nearest % n]
            if addresses[i % n]:
                nearest = i
        return peers


@dataclass(frozen=True)
class Participant:
    node_id: str
    local_world_size: int
    host: str
    port: int
    joined_ms: int
    keeper_address: str = ""  # see Member


# ------------------------------------------------------------------ events


@dataclass(frozen=True)
class RendezvousEvent:
    def to_json(self) -> str:
        data = _plain(self)
        return _ENCODE({"t": type(self).__name__, **data})

    @staticmethod
    def from_json(text: str) -> RendezvousEvent:
        data = json.loads(text)
        kind = RENDEZVOUS_EVENTS[data.pop("t")]
        if kind is RoundFormed:
            data["members"] = tuple(Member(**m) for m in data["members"])
        if kind is NodeJoined:
            data["participant"] = Participant(**data["participant"])
        if kind is RoundClosed:
            data["expected"] = tuple(data["expected"])
            data["gone_ranks"] = tuple(data.get("gone_ranks", ()))
        return kind(**data)


@dataclass(frozen=True)
class NodeJoined(RendezvousEvent):
    participant: Participant

    def to_json(self) -> str:
        # One per join, thousands when a fleet forms: its fields written out
        # (what the generic walk gives, at about half the cost).
        p = self.participant
        return _ENCODE(
            {
                "t": "NodeJoined",
                "participant": {
                    "node_id": p.node_id,
                    "local_world_size": p.local_world_size,
                    "host": p.host,
                    "port": p.port,
                    "joined_ms": p.joined_ms,
                    "keeper_address": p.keeper_address,
                },
            }
        )


@dataclass(frozen=True)
class NodeDropped(RendezvousEvent):
    """Left the waiting list: died, left, or timed out waiting."""

    node_id: str
    reason: str


@dataclass(frozen=True)
class JoinsForgotten(RendezvousEvent):
    """A master restarted: these nodes wait for a round no longer until they
    join again (see `Rendezvous.restarted`). They stay expected if they were."""

    node_ids: tuple[str, ...]


@dataclass(frozen=True)
class Waiting:
    """No round yet (not an event: nothing changes): why, in one line for the
    waiting nodes' logs, and when that answer runs out unless a node joins or
    leaves (ms: the last call's end, or the join timeout)."""

    reason: str
    until_ms: int


@dataclass(frozen=True)
class RoundClosed(RendezvousEvent):
    round: int
    reason: str
    expected: tuple[str, ...]  # who should re-join: the surviving members
    # Every member's workers finished: the job's training is done, and no
    # round forms after this one.
    complete: bool = False
    # The round's ranks whose node died (not left): their workers are gone,
    # so a survivor persisting on its way out waits for no part of theirs.
    gone_ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class MemberFinished(RendezvousEvent):
    """A member of the active round left with its work done."""

    round: int
    node_id: str


@dataclass(frozen=True)
class RoundFormed(RendezvousEvent):
    round: int
    members: tuple[Member, ...]
    bootstrap_host: str
    bootstrap_port: int
    formed_ms: int


RENDEZVOUS_EVENTS: dict[str, type[RendezvousEvent]] = {
    kind.__name__: kind
    for kind in (NodeJoined, NodeDropped, RoundClosed, RoundFormed, MemberFinished, JoinsForgotten)
}


# ------------------------------------------------------------------- state


@dataclass
class RendezvousState:
    last_round: int = 0
    active: Round | None = None
    waiting: dict[str, Participant] = field(default_factory=dict)  # in join order
    expected: set[str] = field(default_factory=set)
    previous_ranks: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)  # node -> why, until it joins again
    closed_reason: str = ""
    finished: set[str] = field(default_factory=set)  # members of the active round
    done_reason: str = ""  # set once a round closed complete: joins are refused
    # How many of `expected` are in `waiting`, and the join times of `waiting`
    # as heaps (earliest; latest, negated) whose stale entries are skipped
    # when they surface: so that a join costs O(log N), not a scan of the
    # thousands already waiting.
    # (The heaps are an index, not state: no fields, so a replayed state
    # compares equal whatever stale entries either one holds.)
    expected_waiting: int = 0

    def __post_init__(self) -> None:
        self._earliest: list[tuple[int, str]] = [(p.joined_ms, n) for n, p in self.waiting.items()]
        self._latest: list[tuple[int, str]] = [(-p.joined_ms, n) for n, p in self.waiting.items()]
        heapq.heapify(self._earliest)
        heapq.heapify(self._latest)

    def add_waiting(self, participant: Participant) -> None:
        node_id = participant.node_id
        if node_id not in self.waiting and node_id in self.expected:
            self.expected_waiting += 1
        self.waiting.pop(node_id, None)
        self.waiting[node_id] = participant
        heapq.heappush(self._earliest, (participant.joined_ms, node_id))
        heapq.heappush(self._latest, (-participant.joined_ms, node_id))

    def remove_waiting(self, node_id: str) -> None:
        if self.waiting.pop(node_id, None) is not None and node_id in self.expected:
            self.expected_waiting -= 1
        if not self.waiting:
            self._earliest.clear()
            self._latest.clear()
        elif len(self._earliest) > 4 * len(self.waiting) + 64:
            # Mostly stale entries: rebuild (amortised O(1) per removal).
            self._earliest = [(p.joined_ms, n) for n, p in self.waiting.items()]
            self._latest = [(-p.joined_ms, n) for n, p in self.waiting.items()]
            heapq.heapify(self._earliest)
            heapq.heapify(self._latest)

    def set_expected(self, expected: set[str]) -> None:
        self.expected = expected
        self.expected_waiting = sum(1 for n in expected if n in self.waiting)

    def first_join_ms(self) -> int:
        """The earliest join time of the waiting nodes (some must wait)."""
        return self._top(self._earliest, 1)

    def last_join_ms(self) -> int:
        """The latest join time of the waiting nodes (some must wait)."""
        return -self._top(self._latest, -1)

    def _top(self, heap: list[tuple[int, str]], sign: int) -> int:
        while True:
            key, node_id = heap[0]
            participant = self.waiting.get(node_id)
            if participant is not None and participant.joined_ms * sign == key:
                return key
            heapq.heappop(heap)

    def everyone_back(self) -> bool:
        """Every node expected after a closed round is waiting again."""
        return bool(self.expected) and self.expected_waiting == len(self.expected)


class Rendezvous:
    """Not thread-safe: one owner (the master's event loop) drives it."""

    def __init__(self, settings: RendezvousSettings | None = None) -> None:
        self.settings = settings or RendezvousSettings()
        self.state = RendezvousState()

    # ------------------------------------------------------------ operations

    def join(
        self,
        node_id: str,
        local_world_size: int,
        host: str,
        port: int,
        now_ms: int,
        keeper_address: str = "",
        answered_round: int | None = None,
    ) -> list[RendezvousEvent]:
        """`answered_round`: for a join that knows the newest round it was
        answered with (a session's; a retried call cannot tell). If the node is
        a member of a newer active round, that round's answer was lost on the
        way (a master restart, a broken stream), and this join is asking for
        it again: nothing changes. Otherwise a member joining again closes its
        round."""
        if not node_id:
            raise InvalidArgument("join needs a node id")
        if not 1 <= local_world_size <= 1024:
            raise InvalidArgument(f"local_world_size must be in 1..1024, got {local_world_size}")
        if not 0 <= port <= 65535:
            raise InvalidArgument(f"bootstrap port must be in 0..65535, got {port}")
        if len(keeper_address) > MAX_KEEPER_ADDRESS or not keeper_address.isprintable():
            raise InvalidArgument(
                f"keeper_address must be at most {MAX_KEEPER_ADDRESS} printable characters, "
                f"got {keeper_address[:100]!r}"
            )
        state = self.state
        if state.done_reason:
            raise TrainingDone(self._refusal())
        events: list[RendezvousEvent] = []
        active = state.active
        if active is not None and active.member(node_id) is not None:
            if answered_round is not None and active.round > answered_round:
                return events
            # A member joining again means its round is over for it: close it.
            survivors = tuple(m.node_id for m in active.members)
            self._emit(events, RoundClosed(active.round, f"{node_id} re-joined", survivors))
        previous = state.waiting.get(node_id)
        joined_ms = previous.joined_ms if previous is not None else now_ms
        participant = Participant(node_id, local_world_size, host, port, joined_ms, keeper_address)
        self._emit(events, NodeJoined(participant))
        active = state.active
        if active is not None and self._could_grow(active):
            members = tuple(m.node_id for m in active.members)
            self._emit(events, RoundClosed(active.round, f"{node_id} is waiting to join", members))
        events += self.tick(now_ms)
        return events

    def remove(
        self,
        node_id: str,
        reason: str,
        now_ms: int,
        close_round: bool = True,
        *,
        died: bool = False,
    ) -> list[RendezvousEvent]:
        """The node died or left: drop it, and close its round if it had one
        (`died`: its ranks in it are gone, see `RoundClosed.gone_ranks`).
        A node whose workers finished leaves with `close_round=False`: the
        others may still be finishing their last steps."""
        state = self.state
        events: list[RendezvousEvent] = []
        active = state.active
        if active is not None and active.member(node_id) is not None:
            if close_round:
                survivors = tuple(m.node_id for m in active.members if m.node_id != node_id)
                gone = tuple(global_ranks(active, node_id)) if died else ()
                closed = RoundClosed(
                    active.round, f"{node_id} {reason}", survivors, gone_ranks=gone
                )
                self._emit(events, closed)
            else:
                self._emit(events, MemberFinished(active.round, node_id))
                if len(state.finished) == active.world_size:
                    closed = RoundClosed(active.round, "every member finished", (), complete=True)
                    self._emit(events, closed)
                    for waiting in list(state.waiting):
                        self._emit(events, NodeDropped(waiting, self._refusal()))
        if node_id in state.waiting or node_id in state.expected:
            self._emit(events, NodeDropped(node_id, reason))
        events += self.tick(now_ms)
        return events

    def restarted(self, registered: Collection[str], now_ms: int) -> list[RendezvousEvent]:
        """After a master restart, before anyone is served: count only nodes
        that are alive. The nodes that were waiting wait no longer until they
        join again, for a join (on its session with this master) is what says
        a node is alive: an earlier run's node, killed with its master, would
        otherwise be formed into a round with the live ones, who then wait in
        a process group it never joins. Live agents send their joins again as
        their sessions reconnect. Nodes the node table no longer holds (not in
        `registered`: lost just before the restart, before the rendezvous
        heard of it) leave the rendezvous: a round they are members of closes
        (its survivors re-join), and nobody waits for them to come back."""
        state = self.state
        events: list[RendezvousEvent] = []
        if state.waiting:
            self._emit(events, JoinsForgotten(tuple(state.waiting)))
        why = "is not registered with the restarted master"
        active = state.active
        if active is not None:
            lost = [m.node_id for m in active.members if m.node_id not in state.finished]
            for node_id in sorted(set(lost).difference(registered)):
                events += self.remove(node_id, why, now_ms)
        # Also the finished members of a round that closed just now.
        for node_id in sorted(state.expected.difference(registered)):
            events += self.remove(node_id, why, now_ms)
        return events

    def tick(self, now_ms: int) -> list[RendezvousEvent]:
        """Form the next round if it is due; drop joiners that waited too long."""
        events: list[RendezvousEvent] = []
        state = self.state
        if state.active is not None:
            return events
        formed = self._decide_round(now_ms) if state.waiting else None
        if isinstance(formed, RoundFormed):
            self._emit(events, formed)
            return events
        timeout = self.settings.join_timeout_ms
        if not state.waiting or now_ms - state.first_join_ms() < timeout:
            return events
        for participant in list(state.waiting.values()):
            if now_ms - participant.joined_ms >= timeout:
                why = (
                    f"no round formed within join_timeout ({timeout / 1000:g}s): "
                    f"{len(state.waiting)} node(s) joined, min_nodes is {self.settings.min_nodes}"
                )
                self._emit(events, NodeDropped(participant.node_id, why))
        return events

    def next_deadline(self) -> int | None:
        """When `tick` may next change something (a last call or a join
        timeout), for a precise timer instead of polling."""
        state = self.state
        if state.active is not None or not state.waiting:
            return None
        join_timeout = state.first_join_ms() + self.settings.join_timeout_ms
        settings = self.settings
        size = (
            min(len(state.waiting), settings.max_nodes) // settings.node_unit * settings.node_unit
        )
        if size < settings.min_nodes:
            # No last call can end in a round yet: a deadline already past
            # would have the timer spin until the next join.
            return join_timeout
        return min(state.last_join_ms() + settings.last_call_timeout_ms, join_timeout)

    # --------------------------------------------------------------- queries

    def _refusal(self) -> str:
        """Why a join is refused once the training is done."""
        return f"{TRAINING_DONE_REFUSAL} {self.state.done_reason}; no round forms any more"

    def assignment(self, node_id: str) -> Round | None:
        active = self.state.active
        if active is not None and active.member(node_id) is not None:
            return active
        return None

    def check_member(self, node_id: str, round_: int) -> Round:
        """Fencing: `round_` must be the active round and `node_id` a member."""
        active = self.state.active
        if active is None or active.round != round_:
            current = active.round if active else "none (forming)"
            raise StaleError(f"round {round_} is stale: the current round is {current}")
        if active.member(node_id) is None:
            raise StaleError(f"node {node_id} is not a member of round {round_}")
        return active

    def num_nodes_waiting(self) -> int:
        return len(self.state.waiting)

    def why_waiting(self, now_ms: int, shown: int = 5) -> str:
        """Why the waiting nodes are not in a round yet: who joined, how many
        a round needs, and until when they wait. One line, for the nodes'
        logs ("" when nobody waits)."""
        state, settings = self.state, self.settings
        count = len(state.waiting)
        if not count:
            return ""
        names = sorted(state.waiting)[:shown]
        joined = f"{count} node(s) waiting ({', '.join(names)}{', ...' if count > shown else ''})"
        active = state.active
        if active is not None:
            return (
                f"{joined}; round {active.round} runs with {active.world_size} node(s), "
                f"max_nodes {settings.max_nodes}: they join when it re-forms (a node leaves or "
                "fails)"
            )
        decision = self._decide_round(now_ms)
        reason = decision.reason if isinstance(decision, Waiting) else "a round forms now"
        return f"{joined}; {reason}"

    # ----------------------------------------------------------------- apply

    def apply(self, event: RendezvousEvent) -> None:
        state = self.state
        if isinstance(event, NodeJoined):
            participant = event.participant
            state.add_waiting(participant)
            state.dropped.pop(participant.node_id, None)
        elif isinstance(event, NodeDropped):
            state.remove_waiting(event.node_id)
            state.expected.discard(event.node_id)
            state.dropped[event.node_id] = event.reason
        elif isinstance(event, RoundClosed):
            assert state.active is not None and state.active.round == event.round
            state.previous_ranks = {m.node_id: m.group_rank for m in state.active.members}
            state.set_expected(set(event.expected) | set(state.waiting))
            state.active = None
            state.closed_reason = event.reason
            if event.complete:
                state.done_reason = f"round {event.round} ended with {event.reason}"
            state.finished = set()
        elif isinstance(event, MemberFinished):
            assert state.active is not None and state.active.round == event.round
            state.finished.add(event.node_id)
        elif isinstance(event, JoinsForgotten):
            for node_id in event.node_ids:
                state.remove_waiting(node_id)
        elif isinstance(event, RoundFormed):
            state.active = Round(
                event.round, event.members, event.bootstrap_host, event.bootstrap_port,
                event.formed_ms,
            )  # fmt: skip
            state.last_round = event.round
            state.finished = set()
            state.set_expected(set())
            for member in event.members:
                state.remove_waiting(member.node_id)
        else:
            raise AssertionError(f"unknown rendezvous event {event!r}")

    def _emit(self, events: list[RendezvousEvent], event: RendezvousEvent) -> None:
        """Apply `event` as soon as it is decided, and keep it for the
        journal: a join closes a round, then waits, then may form the next
        one, each step reading what the one before changed. `apply` is still
        the only way state changes, and the events the whole of it (one
        journal append; replay applies them with the same `apply`)."""
        self.apply(event)
        events.append(event)

    # --------------------------------------------------------------- helpers

    def _could_grow(self, active: Round) -> bool:
        unit = self.settings.node_unit
        possible = min(self.settings.max_nodes, active.world_size + len(self.state.waiting))
        return possible // unit * unit > active.world_size

    def _decide_round(self, now_ms: int) -> RoundFormed | Waiting:
        """The round the waiting nodes form now, or why they wait (some must)."""
        state, settings = self.state, self.settings
        count = len(state.waiting)
        size = min(count, settings.max_nodes) // settings.node_unit * settings.node_unit
        if size < settings.min_nodes:
            gives_up_ms = state.first_join_ms() + settings.join_timeout_ms
            unit = f" in multiples of {settings.node_unit}" if settings.node_unit > 1 else ""
            return Waiting(
                f"a round needs min_nodes {settings.min_nodes}{unit}: waiting for "
                f"{settings.min_nodes - size} more, at most "
                f"{max(gives_up_ms - now_ms, 0) / 1000:.0f}s more (join_timeout)",
                gives_up_ms,
            )
        everyone_back = state.everyone_back()
        last_call_ms = state.last_join_ms() + settings.last_call_timeout_ms
        if count < settings.max_nodes and not everyone_back and now_ms < last_call_ms:
            return Waiting(
                f"a round of {size} forms in {(last_call_ms - now_ms) / 1000:.1f}s (last call) "
                f"unless more join, at once with max_nodes {settings.max_nodes}",
                last_call_ms,
            )
        joined = list(state.waiting.values())
        # Previous members first, keeping their order; then newcomers by join time.
        ranked = sorted(
            joined,
            key=lambda p: (
                state.previous_ranks.get(p.node_id, len(state.previous_ranks)),
                p.joined_ms,
            ),
        )[:size]
        members = tuple(
            Member(p.node_id, rank, p.local_world_size, p.host, p.keeper_address)
            for rank, p in enumerate(ranked)
        )
        leader = ranked[0]
        return RoundFormed(state.last_round + 1, members, leader.host, leader.port, now_ms)


def global_ranks(round_: Round, node_id: str) -> range:
    """The global ranks of `node_id`'s local processes (torchrun's rule)."""
    member = round_.member(node_id)
    if member is None:
        raise StaleError(f"node {node_id} is not a member of round {round_.round}")
    start = round_.rank_offset(member)
    return range(start, start + member.local_world_size)


def describe(round_: Round) -> dict[str, Any]:
    return {
        "round": round_.round,
        "world": [(m.node_id, m.local_world_size) for m in round_.members],
        "bootstrap": f"{round_.bootstrap_host}:{round_.bootstrap_port}",
    }
