"""Node membership and liveness: who is registered, and who stopped beating.

A node is known by a stable name; every registration is a new incarnation, so
heartbeats and reports of an older incarnation are stale. A node whose last
heartbeat is older than the timeout is dead: `expire` reports it once, and the
owner releases what it held. Time is an argument; nothing here reads a clock.

The table changes only through its events (`node_events.py`), like the other
cores: `register`, `forget` and `expire` first decide (read the table,
validate, and build the events, or raise with nothing changed), then hand each
event to `apply`, the same `apply` that replays the "nodes" stream after a
master restart, and return the events for the journal. A heartbeat is not an
event: it only moves a deadline that recovery renews for every node anyway.

Nodes are kept in the order of their last heartbeat, so `expire` looks only at
the silent ones (O(expired), not O(nodes): the master runs it several times a
second at ten thousand nodes). The order holds while time does not go back; if
it does, a node can be found up to that much late.

A node is not blamed for the master's own lag. Time in which the master could
not have heard anyone (its loop was stalled: a long callback, the process
stopped, a host paused) is credited to every node (`credit_stall`): a node's
silence is the time since its last beat less the credit given since. The
owner credits at most the time that passed, so the heartbeat order is also
the order of silence. Nor for the time before the master answered its
registration (`register` ... `answered`), nor for the time before the
master took its session: between its answer and its first beat a node's
silence counts only from the latest first beat of a node answered after it
(the master took that one's session, so it would have taken this one's).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from dlfleet.api.errors import InvalidArgument, StaleError
from dlfleet.master.core.node_events import NodeEvent, NodeForgotten, NodeRegistered
from dlfleet.master.settings import STANDALONE

MAX_NODE_NAME = 200


@dataclass(frozen=True)
class LivenessSettings:
    heartbeat_interval_ms: int = STANDALONE.heartbeat_interval_ms
    heartbeat_timeout_ms: int = STANDALONE.heartbeat_timeout_ms


@dataclass
class NodeRecord:
    node_id: str
    name: str
    incarnation: int
    local_world_size: int
    host: str
    last_seen_ms: int
    # The table's stall credit (`NodeTable.stalled_ms`) at its last beat.
    credit_ms: int = 0
    # False from `register` until the node has its answer (`answered`): it
    # cannot beat before, and is not expired (a busy master's durable commit
    # of the registration can take longer than a heartbeat timeout).
    answered: bool = True


class NodeTable:
    def __init__(self, settings: LivenessSettings | None = None) -> None:
        self.settings = settings or LivenessSettings()
        self.nodes: dict[str, NodeRecord] = {}  # by name: the live incarnation
        self._incarnations: dict[str, int] = {}
        # The names of `nodes`, the longest silent first.
        self._by_beat: OrderedDict[str, None] = OrderedDict()
        # The master's own lag, credited to every node (see `credit_stall`).
        self.stalled_ms = 0
        # Answered registrations not yet followed by a beat, in answer order.
        self._awaiting: OrderedDict[str, None] = OrderedDict()

    # ------------------------------------------------------------ operations

    def register(
        self, name: str, local_world_size: int, host: str, now_ms: int, *, pending: bool = False
    ) -> tuple[NodeRecord, list[NodeEvent]]:
        """A new incarnation of `name`: its record, and the events (the live
        incarnation it replaces forgotten, if there is one, then the new one
        registered; the caller releases what the replaced one held). With
        `pending`, the node is not expired until `answered`."""
        if not name or len(name) > MAX_NODE_NAME or not name.isprintable() or "#" in name:
            raise InvalidArgument(
                f"node name must be 1..{MAX_NODE_NAME} printable characters without '#', "
                f"got {name!r}"
            )
        if not 1 <= local_world_size <= 1024:
            raise InvalidArgument(f"local_world_size must be in 1..1024, got {local_world_size}")
        events: list[NodeEvent] = []
        previous = self.nodes.get(name)
        if previous is not None:
            events.append(_forgotten(previous))
        incarnation = self._incarnations.get(name, 0) + 1
        events.append(NodeRegistered(name, incarnation, local_world_size, host, now_ms))
        for event in events:
            self.apply(event)
        record = self.nodes[name]
        record.answered = not pending
        return record, events

    def answered(self, node_id: str, incarnation: int, now_ms: int) -> None:
        """The registration of `node_id` was answered (or failed) at `now_ms`:
        its silence counts from now. Nothing if it is no longer live."""
        record = self.nodes.get(node_id.rpartition("#")[0])
        if record is None or record.node_id != node_id or record.incarnation != incarnation:
            return
        record.answered = True
        self._beat(record, now_ms)
        self._awaiting[record.name] = None

    def forget(self, node_id: str) -> list[NodeEvent]:
        """The live incarnation `node_id` goes (it died, left or finished);
        nothing if the table does not hold it (any more)."""
        record = self.nodes.get(node_id.rpartition("#")[0])
        if record is None or record.node_id != node_id:
            return []
        event = _forgotten(record)
        self.apply(event)
        return [event]

    def expire(self, now_ms: int) -> list[NodeEvent]:
        """Nodes silent for longer than the timeout: they are forgotten."""
        timeout = self.settings.heartbeat_timeout_ms
        events: list[NodeEvent] = []
        for name in self._by_beat:
            record = self.nodes[name]
            if not record.answered:
                continue  # not told its id yet: it cannot have beaten
            if self.silence_ms(record, now_ms) <= timeout:
                break
            events.append(_forgotten(record))
        for event in events:
            self.apply(event)
        return events

    def heartbeat(self, node_id: str, incarnation: int, now_ms: int) -> None:
        record = self.live(node_id, incarnation)
        if record.name in self._awaiting:
            # Its first beat: the master took its session, so it would have
            # taken those of the nodes answered before it; their silence
            # counts from now.
            while self._awaiting:
                name, _ = self._awaiting.popitem(last=False)
                if name == record.name:
                    break
                self._beat(self.nodes[name], now_ms)
        self._beat(record, now_ms)

    def _beat(self, record: NodeRecord, now_ms: int) -> None:
        record.last_seen_ms = max(record.last_seen_ms, now_ms)
        record.credit_ms = self.stalled_ms
        self._by_beat.move_to_end(record.name)

    def credit_stall(self, stalled_ms: int) -> None:
        """The master could not hear anyone for `stalled_ms` (its loop was
        stalled): no node's silence counts that time. At most the time that
        passed since the last credit (the heartbeat order stays the order of
        silence)."""
        if stalled_ms < 0:
            raise InvalidArgument(f"a stall is not negative, got {stalled_ms} ms")
        self.stalled_ms += stalled_ms

    # --------------------------------------------------------------- queries

    def silence_ms(self, record: NodeRecord, now_ms: int) -> int:
        """How long `record` has been silent at `now_ms`, the master's own
        stalls since its last beat not counted."""
        return now_ms - record.last_seen_ms - (self.stalled_ms - record.credit_ms)

    def live(self, node_id: str, incarnation: int) -> NodeRecord:
        name = node_id.rpartition("#")[0]
        record = self.nodes.get(name)
        if record is None or record.incarnation != incarnation or record.node_id != node_id:
            raise StaleError(f"node {node_id!r} incarnation {incarnation} is not registered")
        return record

    # ----------------------------------------------------------------- apply

    def apply(self, event: NodeEvent) -> None:
        """The one way the table changes, live and in replay. A registration
        replaces the name's record (a restored node is live from the time its
        event says: recovery then gives it a full timeout); forgetting an
        incarnation the table no longer holds changes nothing."""
        name = event.name
        if isinstance(event, NodeRegistered):
            self._incarnations[name] = max(self._incarnations.get(name, 0), event.incarnation)
            self.nodes[name] = NodeRecord(
                event.node_id,
                name,
                event.incarnation,
                event.local_world_size,
                event.host,
                event.registered_ms,
                self.stalled_ms,
            )
            self._by_beat[name] = None
            self._by_beat.move_to_end(name)
            self._awaiting.pop(name, None)
        elif isinstance(event, NodeForgotten):
            record = self.nodes.get(name)
            if record is not None and record.incarnation == event.incarnation:
                del self.nodes[name]
                self._by_beat.pop(name, None)
                self._awaiting.pop(name, None)
        else:
            raise AssertionError(f"unknown node event {event!r}")


def _forgotten(record: NodeRecord) -> NodeForgotten:
    return NodeForgotten(record.name, record.incarnation, record.local_world_size, record.host)
