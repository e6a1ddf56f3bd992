"""A worker process's line to its node agent (the agent's `Keeper` service).

The agent serves it on a Unix socket named by `$DLFLEET_AGENT`. A worker
attaches once (`Attach`: a stream of orders that lasts as long as the
process) and then follows the orders in sequence: run in a round, abort the
round, exit. An abort is acted on the moment it arrives, on the listening
thread (`on_abort`), because the training thread may be stuck in a
collective; everything else is taken by the training thread from `next()`.
"""

from __future__ import annotations

import enum
import logging
import queue
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from dlfleet.api.status import TOKEN_METADATA_KEY
from dlfleet.api.v1 import checkpoint_pb2, checkpoint_pb2_grpc

_log = logging.getLogger(__name__)

# A worker under dlworker writes its threads' stacks to stderr on this signal.
STACKS_SIGNAL = signal.SIGUSR1
CALL_TIMEOUT_S = 10.0


class WorkState(enum.Enum):
    """Where a worker process stands, as its line says: it reports RUNNING,
    ABORTED, FINISHED or FAILED for a round; ATTACHED is a line before any
    order, ORDERED one the agent sent a Run order and that has not answered."""

    ATTACHED = "attached"
    ORDERED = "ordered"
    RUNNING = "running"
    ABORTED = "aborted"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Run:
    """Enter round `order.round` with the rank, store and environment it names."""

    order: checkpoint_pb2.RunOrder


@dataclass(frozen=True, slots=True)
class Abort:
    """Leave round `round` (a peer is gone, or the round closed)."""

    round: int
    reason: str


@dataclass(frozen=True, slots=True)
class Exit:
    """Exit with `code`."""

    code: int


# What the agent orders a worker process to do, as the two sides mean it; the
# wire's `WorkerOrder` oneof is written and read only by the two functions
# below.
Order = Run | Abort | Exit


def order_to_wire(order: Order) -> checkpoint_pb2.WorkerOrder:
    if isinstance(order, Run):
        return checkpoint_pb2.WorkerOrder(run=order.order)
    if isinstance(order, Abort):
        abort = checkpoint_pb2.AbortOrder(round=order.round, reason=order.reason)
        return checkpoint_pb2.WorkerOrder(abort=abort)
    return checkpoint_pb2.WorkerOrder(exit=checkpoint_pb2.ExitOrder(code=order.code))


def order_from_wire(order: checkpoint_pb2.WorkerOrder) -> Order | None:
    """None for an order of a kind this worker does not know."""
    kind = order.WhichOneof("order")
    if kind == "run":
        return Run(order.run)
    if kind == "abort":
        return Abort(order.abort.round, order.abort.reason)
    if kind == "exit":
        return Exit(order.exit.code)
    return None


class AgentChannel:
    def __init__(self, address: str, *, token: str, pid: int, spare: bool) -> None:
        self.address = address
        self._metadata = ((TOKEN_METADATA_KEY, token),)
        self._channel = grpc.insecure_channel(address)
        self._stub = checkpoint_pb2_grpc.KeeperStub(self._channel)
        self._orders: queue.Queue[Order | None] = queue.Queue()
        self._lock = threading.Lock()
        self._aborted_round = -1  # the newest round an abort order named
        self._abort_seen = threading.Condition(self._lock)
        self.on_abort: Callable[[int], None] | None = None
        self._stream = self._stub.Attach(
            checkpoint_pb2.AttachRequest(pid=pid, spare=spare), metadata=self._metadata
        )
        self._thread = threading.Thread(target=self._listen, name="dlfleet-agent", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- orders

    def next(self, timeout_s: float | None = None) -> Order | None:
        """The next order; None when the agent is gone. Raises queue.Empty
        after `timeout_s`."""
        return self._orders.get(timeout=timeout_s)

    def aborted(self, round_: int) -> bool:
        """Whether the agent has told this process to leave `round_`."""
        with self._lock:
            return self._aborted_round >= round_

    def wait_aborted(self, round_: int, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for an abort of `round_` (after a failed
        collective: a peer is gone, and the agent will say so soon)."""
        with self._abort_seen:
            return self._abort_seen.wait_for(lambda: self._aborted_round >= round_, timeout_s)

    def _listen(self) -> None:
        try:
            for received in self._stream:
                order = order_from_wire(received)
                if order is None:
                    _log.warning("ignoring an order of an unknown kind from the agent")
                    continue
                if isinstance(order, Abort):
                    self._note_abort(order.round)
                self._orders.put(order)
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.CANCELLED:
                _log.warning("the agent's order stream ended: %s", exc.code().name)
        self._orders.put(None)

    def _note_abort(self, round_: int) -> None:
        with self._abort_seen:
            self._aborted_round = max(self._aborted_round, round_)
            self._abort_seen.notify_all()
        callback = self.on_abort
        if callback is not None:
            callback(round_)

    # ------------------------------------------------------------------ calls

    def report(self, round_: int, state: WorkState, detail: str = "", *, pid: int) -> None:
        request = checkpoint_pb2.WorkerState(
            pid=pid, round=round_, state=state.value, detail=detail
        )
        try:
            self._stub.Report(request, timeout=CALL_TIMEOUT_S, metadata=self._metadata)
        except grpc.RpcError as exc:
            _log.warning("could not tell the agent %s: %s", state.value, exc.code().name)

    def saved(self, notice: checkpoint_pb2.SavedNotice) -> checkpoint_pb2.SavedAck:
        response: checkpoint_pb2.SavedAck = self._stub.Saved(
            notice, timeout=CALL_TIMEOUT_S, metadata=self._metadata
        )
        return response

    def close(self) -> None:
        self._stream.cancel()
        self._channel.close()
