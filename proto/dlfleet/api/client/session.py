"""A node's session with the master: heartbeats up, pushes down, and joins
on the same stream, on the client's shared loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from dlfleet.api.client.answers import ReRendezvous, pushed
from dlfleet.api.client.channel import _SESSION_BREAKS, Connection, _log
from dlfleet.api.errors import StaleError, Unavailable
from dlfleet.api.status import error_from_code, error_from_status
from dlfleet.api.v1 import nodecheck_pb2, rendezvous_pb2


def join_request(
    node_id: str,
    incarnation: int,
    local_world_size: int,
    host: str,
    bootstrap_port: int,
    keeper_address: str = "",
    next_bootstrap_port: int = 0,
) -> rendezvous_pb2.JoinRequest:
    """`next_bootstrap_port`: a second free port, for a join on the session:
    with it the master joins the node into the next round itself when a round
    closes (see `AgentSession.join_async`)."""
    return rendezvous_pb2.JoinRequest(
        node_id=node_id,
        incarnation=incarnation,
        local_world_size=local_world_size,
        host=host,
        bootstrap_port=bootstrap_port,
        keeper_address=keeper_address,
        next_bootstrap_port=next_bootstrap_port,
    )


@dataclass
class _PendingJoin:
    """A join sent on the session, waiting for its answer."""

    join_id: int
    # None: a join the master made for this node (ReRendezvous.join_id),
    # until the agent's own join takes its answer.
    request: rendezvous_pb2.JoinRequest | None
    answer: asyncio.Future[rendezvous_pb2.JoinResponse]
    # The stream it went out on (it goes out once per stream).
    sent_on: object = None


def age_metrics(metrics: rendezvous_pb2.NodeMetrics, elapsed_s: float) -> None:
    """Age `metrics`, measured `elapsed_s` ago, to now: the agent measures
    once per heartbeat interval and a beat goes out on its own timer, up to an
    interval later, while the master takes each age as of the beat's arrival
    (how old the counts were when written, when their run of steps began, when
    the run before it ended)."""
    if elapsed_s <= 0:
        return
    if metrics.steps_age_s > 0:
        metrics.steps_age_s += elapsed_s
    if metrics.stepping_age_s > 0:
        metrics.stepping_age_s += elapsed_s
    if metrics.run_ended_age_s > 0:
        metrics.run_ended_age_s += elapsed_s


class AgentSession:
    """A node's session with the master, on the shared I/O loop.

    Heartbeats go up every `heartbeat_interval_s` and tell the master the
    agent is alive and not hung; the master's pushes arrive on `events` as
    `ReRendezvous` values, pairs to run for another node's check on
    `check_pairs`.
    If the stream breaks (master restart, network), it is reopened with
    backoff; `broken` is set while it is down, and `closed_by_master` when
    the master refused the session (this incarnation is no longer
    registered).
    """

    def __init__(
        self, client: Connection, node_id: str, incarnation: int, heartbeat_interval_s: float
    ) -> None:
        self._client = client
        self.node_id = node_id
        self.incarnation = incarnation
        self.round = 0
        self.events: queue.Queue[ReRendezvous] = queue.Queue()
        # Pairs for late nodes' checks this node runs, whatever phase it is in.
        self.check_pairs: queue.Queue[nodecheck_pb2.PairOrder] = queue.Queue()
        self.broken = threading.Event()
        self.closed_by_master = threading.Event()
        self.interval = heartbeat_interval_s
        # What the next heartbeat tells about the node's training (set by the
        # agent; None until it has measured something), and when it was set.
        self._metrics: rendezvous_pb2.NodeMetrics | None = None
        self._metrics_at = 0.0
        # Set by the agent once its workers run `dlfleet.elastic.run`.
        self.restarts_in_place = False
        # Told the newest (committed, replicated) steps of the node's round
        # and the step to copy to its peer next when another node's report
        # moved them (called on the I/O loop).
        self.on_checkpoint_progress: Callable[[int, int, int], None] | None = None
        # When the last heartbeat went out (time.monotonic()), 0 before the first.
        self.last_beat_s = 0.0
        self._silent = False
        self._leaving = False
        self._beats: asyncio.Future[None] | None = None
        # The open stream, one write at a time on it (beats and joins), and
        # the join waiting for its answer.
        self._call: grpc.aio.StreamStreamCall[rendezvous_pb2.SessionMessage, Any] | None = None
        self._writing = asyncio.Lock()
        self._join: _PendingJoin | None = None
        self._joins = 0
        # The newest round a join on this session was answered with.
        self._answered_round = 0
        # The spare port of the node's last join, told with every message.
        self._spare_port = 0
        self._io = client._io()
        self._task = asyncio.run_coroutine_threadsafe(self._run(), self._io.loop)

    @property
    def metrics(self) -> rendezvous_pb2.NodeMetrics | None:
        return self._metrics

    @metrics.setter
    def metrics(self, metrics: rendezvous_pb2.NodeMetrics | None) -> None:
        """Set as they were measured, just now: a heartbeat that carries them
        later adds the time since to the ages they tell."""
        self._metrics, self._metrics_at = metrics, time.monotonic()

    def _checkpoint_progress(self, progress: rendezvous_pb2.CheckpointProgress) -> None:
        """Only about this node's current round: an earlier round's steps
        may be ones a restore abandoned."""
        tell = self.on_checkpoint_progress
        if tell is not None and progress.round == self.round:
            tell(progress.committed_step, progress.replicated_step, progress.replica_step)

    async def _run(self) -> None:
        try:
            await self._stream()
        finally:
            self._fail_join(Unavailable(f"the session of {self.node_id} ended"))

    async def _stream(self) -> None:
        attempt = 0
        while True:
            call = self._call = self._io.rendezvous.Session(metadata=self._client._metadata)
            beats = self._beats = asyncio.ensure_future(self._beat(call))
            try:
                async for event in call:
                    attempt = 0
                    self.broken.clear()
                    if event.HasField("node_check_pair"):
                        self.check_pairs.put(event.node_check_pair)
                    elif event.HasField("joined"):
                        self._answered(event.joined)
                    elif event.HasField("checkpoint"):
                        self._checkpoint_progress(event.checkpoint)
                    elif event.HasField("re_rendezvous"):
                        self._master_joined(event.re_rendezvous, call)
                        self.events.put(pushed(event.re_rendezvous))
                # Ended without an error: the master stopped reading because a
                # heartbeat was stale (this incarnation was dropped, say while
                # its link was down), or it is going down. Reopen: a master
                # that no longer knows this incarnation refuses the new session
                # (closed_by_master below); a master restart is a break.
                self.broken.set()
            except grpc.RpcError as error:
                if error.code() in _SESSION_BREAKS:
                    self.broken.set()
                else:
                    self.closed_by_master.set()
                    # Expected once the agent left: the master forgot the node.
                    say = _log.debug if self._leaving else _log.error
                    say("the master refused the session of %s: %s (%s)", self.node_id,
                        error.details() or "no details", error.code().name)  # fmt: skip
                    self._fail_join(error_from_status(error.code(), error.details() or ""))
                    return
            finally:
                beats.cancel()
                call.cancel()
                self._call = None
            await asyncio.sleep(self._client.retry.backoff(attempt))
            attempt += 1

    def _message(self) -> rendezvous_pb2.SessionMessage:
        message = rendezvous_pb2.SessionMessage(
            node_id=self.node_id,
            incarnation=self.incarnation,
            round=self.round,
            restarts_in_place=self.restarts_in_place,
            next_bootstrap_port=self._spare_port,
        )
        if self._metrics is not None:
            message.metrics.CopyFrom(self._metrics)
            age_metrics(message.metrics, time.monotonic() - self._metrics_at)
        return message

    async def _write(
        self,
        call: grpc.aio.StreamStreamCall[rendezvous_pb2.SessionMessage, Any],
        message: rendezvous_pb2.SessionMessage,
    ) -> None:
        async with self._writing:
            await call.write(message)
        self.last_beat_s = time.monotonic()

    async def _beat(
        self, call: grpc.aio.StreamStreamCall[rendezvous_pb2.SessionMessage, Any]
    ) -> None:
        if self._join is not None:
            # A join sent on a stream that broke goes again on this one
            # (joining again is idempotent).
            await self._send_join(call, self._join)
        while True:
            message = self._message()
            if self._silent:
                return
            await self._write(call, message)
            await asyncio.sleep(self.interval)

    async def join_async(
        self, request: rendezvous_pb2.JoinRequest, timeout_s: float = 900.0
    ) -> rendezvous_pb2.JoinResponse:
        """Join the rendezvous on this session (call it on `io_loop`): what
        `MasterClient.join_rendezvous` returns, at a fraction of the master's
        cost. A join in flight when the stream breaks is sent again on the
        next one, so it rides out a master restart; it fails when the master
        refuses the session, when the session is closed, or after `timeout_s`."""
        if self.closed_by_master.is_set():
            raise StaleError(f"the master closed the session of {self.node_id}")
        if self._task.done():
            raise Unavailable(f"the session of {self.node_id} is closed")
        self._spare_port = request.next_bootstrap_port
        pending = self._join
        if pending is not None and pending.request is None:
            # The master joined this node when it closed the round: its
            # answer is this join's (sent only if that stream broke).
            pending.request = request
        else:
            self._fail_join(StaleError("a newer join on the same session replaced it"))
            self._joins += 1
            pending = self._join = _PendingJoin(
                self._joins, request, asyncio.get_running_loop().create_future()
            )
        if self._call is not None:
            await self._send_join(self._call, pending)
        try:
            return await asyncio.wait_for(asyncio.shield(pending.answer), timeout_s)
        except TimeoutError:
            raise error_from_status(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"join of {self.node_id} on its session: no round within {timeout_s:g}s",
            ) from None
        finally:
            if self._join is pending:
                self._join = None

    def join(
        self, request: rendezvous_pb2.JoinRequest, timeout_s: float = 900.0
    ) -> rendezvous_pb2.JoinResponse:
        """`join_async` from another thread (the agent's)."""
        return self.join_future(request, timeout_s).result()

    def join_future(
        self, request: rendezvous_pb2.JoinRequest, timeout_s: float = 900.0
    ) -> concurrent.futures.Future[rendezvous_pb2.JoinResponse]:
        """`join_async` from another thread, for a caller that does more while
        it waits (says why, leaves when told); cancelling it gives the join up."""
        return asyncio.run_coroutine_threadsafe(self.join_async(request, timeout_s), self._io.loop)

    async def _send_join(
        self,
        call: grpc.aio.StreamStreamCall[rendezvous_pb2.SessionMessage, Any],
        pending: _PendingJoin,
    ) -> None:
        """`pending` on `call`, once per stream."""
        if pending.sent_on is call or pending.answer.done() or pending.request is None:
            return
        pending.sent_on = call
        message = self._message()
        message.join.CopyFrom(pending.request)
        message.join.answered_round = self._answered_round
        message.join_id = pending.join_id
        # A write that fails means the stream broke: the next one sends it.
        with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError):
            await self._write(call, message)

    def _master_joined(
        self,
        push: rendezvous_pb2.ReRendezvous,
        call: grpc.aio.StreamStreamCall[rendezvous_pb2.SessionMessage, Any],
    ) -> None:
        """A push: the round closed. With a join id, the master has joined
        this node into the next round (and, if it formed already, the push
        carries the answer); the agent's next join takes that answer."""
        pending = self._join
        if pending is not None and pending.request is not None and not pending.answer.done():
            return  # the agent's own join is on its way: its answer counts
        if push.closed_round < self._answered_round:
            # The agent's own join, sent as this round closed, was answered
            # first with a newer round: the master's join for it is the same
            # round, and the agent's next join must not take it again.
            return
        # A join the master made earlier that the agent never took is stale.
        self._join = None
        if push.join_id:
            future: asyncio.Future[rendezvous_pb2.JoinResponse]
            future = asyncio.get_running_loop().create_future()
            if push.HasField("answer"):
                self._answered_round = max(self._answered_round, push.answer.round)
                future.set_result(push.answer)
            self._join = _PendingJoin(push.join_id, None, future, sent_on=call)

    def _answered(self, joined: rendezvous_pb2.SessionJoined) -> None:
        pending = self._join
        if pending is None or pending.join_id != joined.join_id or pending.answer.done():
            return  # an answer to a join given up on
        if joined.HasField("error"):
            pending.answer.set_exception(error_from_code(joined.error.code, joined.error.message))
        else:
            self._answered_round = max(self._answered_round, joined.answer.round)
            pending.answer.set_result(joined.answer)

    def _fail_join(self, error: Exception) -> None:
        pending = self._join
        if pending is not None and not pending.answer.done():
            pending.answer.set_exception(error)
            # Retrieved by its waiter, if it still waits; else it is no news.
            pending.answer.exception()

    # -------------------------------------------------------------- pushes

    def next_push(self, timeout_s: float) -> ReRendezvous | None:
        """The next push, waiting up to `timeout_s` for it; None when none came."""
        try:
            return self.events.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def waiting_pushes(self) -> list[ReRendezvous]:
        """The pushes not taken yet, oldest first (they stay)."""
        return list(self.events.queue)

    def drop_pushes(self) -> None:
        """Forget the pushes not taken yet (about rounds before the next)."""
        while True:
            try:
                self.events.get_nowait()
            except queue.Empty:
                return

    def beat_now(self, timeout_s: float = 1.0) -> bool:
        """Send a heartbeat now, with `metrics` as they are, from another
        thread (the agent's last word on workers it just stopped: the master
        counts their final steps). False when the stream is down or the
        write took longer than `timeout_s`; the next beat then tells."""
        future = asyncio.run_coroutine_threadsafe(self._beat_once(), self._io.loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return False

    async def _beat_once(self) -> bool:
        call = self._call
        if call is None or self._silent:
            return False
        try:
            await self._write(call, self._message())
        except (grpc.RpcError, asyncio.InvalidStateError):
            return False  # the stream broke: reopened with the next beat
        return True

    def leaving(self) -> None:
        """The agent is about to leave the rendezvous: the master will refuse
        this session from then on, which is no news."""
        self._leaving = True

    def silence(self) -> None:
        """Stop heartbeating but keep the stream open: what the master sees of
        an agent that hangs, or of a link that drops its packets (the fleet
        simulator's partition). Call it on `io_loop`."""
        self._silent = True
        if self._beats is not None:
            self._beats.cancel()

    def close(self) -> None:
        """End the session (the master then treats the node as gone unless it
        left first)."""
        self._io.loop.call_soon_threadsafe(self._task.cancel)
