"""The agent's side of in-process restarts: which worker processes are
attached, and the orders sent to them.

A worker process that calls `dlfleet.elastic.run` attaches (a stream that
lasts its life) and waits for orders; its reports say where it stands.
Everything here is bookkeeping behind a lock: the gRPC handlers
(`Keeper.Attach` / `Keeper.Report`) feed it, the agent's loop reads it and
sends orders.

Invariants:
- One line per pid; a line ends when its stream ends (the process died, or
  was told to exit), and a dead process is never sent an order.
- Orders to one process leave in the order they were sent.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from dlfleet.api.v1 import checkpoint_pb2
from dlfleet.worker.elastic.channel import Order, Run, WorkState, order_to_wire

_log = logging.getLogger(__name__)
_STATES = {state.value: state for state in WorkState}


@dataclass
class WorkerLine:
    pid: int
    spare: bool
    orders: queue.Queue[Order | None] = field(default_factory=queue.Queue)
    state: WorkState = WorkState.ATTACHED
    round: int = 0
    detail: str = ""


class WorkerOrders:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._lines: dict[int, WorkerLine] = {}
        # Run orders for processes that have not attached yet (just started).
        self._expected: dict[int, Order] = {}

    # ------------------------------------------------------ from the workers

    def open_line(self, pid: int, spare: bool) -> WorkerLine:
        """Process `pid` attached: its line (a newer one replaces an older)."""
        line = WorkerLine(pid, spare)
        with self._changed:
            previous = self._lines.get(pid)
            if previous is not None:
                previous.orders.put(None)
            self._lines[pid] = line
            waiting = self._expected.pop(pid, None)
            if waiting is not None:
                self._deliver(line, waiting)
            self._changed.notify_all()
        return line

    def close_line(self, line: WorkerLine) -> None:
        """Its stream ended: forget the line (if it is still the current one)."""
        line.orders.put(None)
        with self._changed:
            if self._lines.get(line.pid) is line:
                del self._lines[line.pid]
            self._changed.notify_all()

    @staticmethod
    def orders_of(line: WorkerLine) -> Iterator[checkpoint_pb2.WorkerOrder]:
        """`line`'s orders as they go out on its stream."""
        while True:
            order = line.orders.get()
            if order is None:
                return
            yield order_to_wire(order)

    def report(self, pid: int, round_: int, state: str, detail: str) -> None:
        """Process `pid` says where it stands (`state`: a WorkState's wire
        value; one this agent does not know is logged and dropped)."""
        known = _STATES.get(state)
        if known is None:
            _log.warning("process %d reported an unknown state %r", pid, state)
            return
        with self._changed:
            line = self._lines.get(pid)
            if line is None:
                return
            line.state, line.round, line.detail = known, round_, detail
            self._changed.notify_all()

    # ------------------------------------------------------- from the agent

    def attached(self, pid: int) -> bool:
        with self._lock:
            return pid in self._lines

    def spares(self) -> list[int]:
        """Attached spare processes, oldest first."""
        with self._lock:
            return [line.pid for line in self._lines.values() if line.spare]

    def send(self, pid: int, order: Order) -> bool:
        with self._changed:
            line = self._lines.get(pid)
            if line is None:
                return False
            self._deliver(line, order)
            return True

    def expect(self, pid: int, order: Order) -> None:
        """Send `order` to `pid` now if it is attached, else when it attaches."""
        with self._changed:
            line = self._lines.get(pid)
            if line is None:
                self._expected[pid] = order
            else:
                self._deliver(line, order)

    def forget(self, pid: int) -> None:
        """`pid` is gone: drop what waited for it."""
        with self._changed:
            self._expected.pop(pid, None)

    @staticmethod
    def _deliver(line: WorkerLine, order: Order) -> None:
        if isinstance(order, Run):
            line.spare = False
            line.state, line.round = WorkState.ORDERED, order.order.round
        line.orders.put(order)

    def detach(self, pid: int) -> None:
        """End `pid`'s stream (it exits, or it is gone)."""
        with self._changed:
            line = self._lines.pop(pid, None)
            if line is not None:
                line.orders.put(None)
            self._changed.notify_all()

    def state(self, pid: int) -> tuple[WorkState, int] | None:
        with self._lock:
            line = self._lines.get(pid)
            return None if line is None else (line.state, line.round)

    def wait_attached(self, pids: Iterable[int], timeout_s: float) -> bool:
        wanted = set(pids)
        with self._changed:
            return self._changed.wait_for(lambda: wanted <= set(self._lines), timeout_s)

    def wait_left(self, pids: Iterable[int], round_: int, timeout_s: float) -> set[int]:
        """Wait until each of `pids` has left `round_` (aborted or finished it,
        or never entered it) or is gone; the pids that still have not, after
        `timeout_s`."""
        wanted = set(pids)
        deadline = time.monotonic() + timeout_s

        def stuck() -> set[int]:
            out = set()
            for pid in wanted:
                line = self._lines.get(pid)
                if line is None:
                    continue
                entered = (
                    line.state in (WorkState.ORDERED, WorkState.RUNNING) and line.round <= round_
                )
                if entered:
                    out.add(pid)
            return out

        with self._changed:
            while True:
                left = stuck()
                remaining = deadline - time.monotonic()
                if not left or remaining <= 0:
                    return left
                self._changed.wait(remaining)

    def close(self) -> None:
        with self._changed:
            for line in self._lines.values():
                line.orders.put(None)
            self._lines.clear()
            self._expected.clear()
            self._changed.notify_all()
