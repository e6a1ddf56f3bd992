"""The client agents and loaders use to talk to the master.

Every call has a deadline. Transient failures (UNAVAILABLE, DEADLINE_EXCEEDED)
are retried with exponential backoff and jitter within a bounded budget of
attempts and time, each retry logged as one warning (the call, the master's
address, the attempt), then end in `Unavailable` saying what was tried. Every
other failure is raised at once as the domain error of its status code
(`dlfleet.api.status`). Retrying is safe: leases carry a request id (a retry
gets the same lease), reports of a lease already DONE are duplicates, restores
are idempotent.

The client is thread-safe (one channel, many threads).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import queue
import random
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import grpc

from dlfleet.api.env import TLS_CA_ENV
from dlfleet.api.errors import InvalidArgument, StaleError, Unavailable
from dlfleet.api.status import TOKEN_METADATA_KEY, error_from_code, error_from_status
from dlfleet.api.v1 import (
    checkpoint_pb2,
    checkpoint_pb2_grpc,
    job_pb2,
    job_pb2_grpc,
    nodecheck_pb2,
    nodecheck_pb2_grpc,
    nodes_pb2,
    nodes_pb2_grpc,
    rendezvous_pb2,
    rendezvous_pb2_grpc,
    shards_pb2,
    shards_pb2_grpc,
)

_log = logging.getLogger(__name__)

_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# A session stream also breaks with INTERNAL: a write on a call whose
# transport went down with the master fails inside the client ("Internal
# error from Core") before the read sees UNAVAILABLE. The master never closes
# a session with INTERNAL (it refuses one with the domain error's status).
_SESSION_BREAKS = _RETRYABLE | {grpc.StatusCode.INTERNAL}
MAX_DETAILS_LOGGED = 200  # characters of a failed call's details in a retry's log line

Resp = TypeVar("Resp")


class _RequestIds:
    """Lease request ids, unique across processes and restarts: a random
    prefix per process (a new one after fork) and a counter. A `uuid4` each
    costs a getrandom syscall per lease, a tenth of a client's CPU per pair at
    thousands of leases a second."""

    def __init__(self) -> None:
        self._renew()
        os.register_at_fork(after_in_child=self._renew)

    def _renew(self) -> None:
        self._prefix = uuid.uuid4().hex[:16]
        self._counter = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._counter):x}"


_request_ids = _RequestIds()


def rank_lease_request(
    dataset: str, node_id: str, rank: int, done: Iterable[int], request_id: str | None
) -> shards_pb2.LeaseRequest:
    """Async mode: a lease for one node-rank. The request id makes a retry
    return the same lease instead of a second one."""
    return shards_pb2.LeaseRequest(
        dataset=dataset,
        rank=shards_pb2.RankConsumer(node_id=node_id, rank=rank),
        request_id=request_id or _request_ids.next(),
        done=done,
    )


def round_lease_request(
    dataset: str, round: int, position: int, done: Iterable[int], count: int = 1
) -> shards_pb2.LeaseRequest:
    """Sync mode: position `position` of rendezvous round `round`, and with
    `count` > 1 the shards of up to `count - 1` positions after it
    (`LeaseResponse.more`)."""
    return shards_pb2.LeaseRequest(
        dataset=dataset,
        round=shards_pb2.RoundConsumer(round=round, position=position),
        done=done,
        count=count,
    )


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


def channel_credentials(tls_ca: bytes | None = None) -> grpc.ChannelCredentials | None:
    """TLS credentials for a channel to the master: from `tls_ca`, or the PEM
    file named by $DLFLEET_TLS_CA; None (plaintext) when neither is given."""
    if tls_ca is None:
        path = os.environ.get(TLS_CA_ENV)
        if not path:
            return None
        try:
            with open(path, "rb") as pem:
                tls_ca = pem.read()
        except OSError as exc:
            raise InvalidArgument(f"${TLS_CA_ENV}: cannot read {path}: {exc.strerror}") from None
    return grpc.ssl_channel_credentials(root_certificates=tls_ca)


@dataclass(frozen=True)
class RetryPolicy:
    """By default a call rides out a master that restarts (about 30 s of
    retries); callers that must answer quickly pass a shorter policy."""

    attempts: int = 40
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    total_budget_s: float = 30.0

    def backoff(self, attempt: int) -> float:
        """Full jitter over an exponential cap."""
        cap = min(self.max_backoff_s, self.initial_backoff_s * 2**attempt)
        return random.uniform(0, cap)


class MasterClient:
    def __init__(
        self,
        target: str,
        *,
        token: str,
        timeout_s: float = 10.0,
        retry: RetryPolicy | None = None,
        channel: grpc.Channel | None = None,
        tls_ca: bytes | None = None,
        own_connection: bool = False,
    ) -> None:
        """`tls_ca`: PEM root certificate(s) to verify a TLS master with; when
        None, the file named by $DLFLEET_TLS_CA if set, else plaintext.
        `own_connection`: this client gets a TCP connection of its own even
        beside other clients of the same process (gRPC shares one by default),
        as the one agent of a real node has: what the fleet simulator needs to
        look like a fleet."""
        self.target = target
        self._credentials = channel_credentials(tls_ca)
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self._metadata = ((TOKEN_METADATA_KEY, token),)
        self._options: list[tuple[str, Any]] = [
            ("grpc.enable_retries", 0),
            # Notice a dead master or a cut link on long-lived streams.
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            # A master that restarts is back in about a second: reconnect
            # within 0.1-1 s of it, not after gRPC's default 1-120 s back-off
            # (every call fails fast while the channel waits to reconnect).
            ("grpc.initial_reconnect_backoff_ms", 100),
            # gRPC also takes this as the least time a connection attempt
            # gets (its handshake up to the SETTINGS frame): 100 ms would fail
            # every attempt to a master busy with thousands of nodes joining.
            # A master that is down refuses at once, whatever this is.
            ("grpc.min_reconnect_backoff_ms", 5000),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        if own_connection:
            self._options.append(("grpc.use_local_subchannel_pool", 1))
        if channel is not None:
            self._channel = channel
        elif self._credentials is not None:
            self._channel = grpc.secure_channel(target, self._credentials, options=self._options)
        else:
            self._channel = grpc.insecure_channel(target, options=self._options)
        self._io_loop: _IoLoop | None = None
        self._io_lock = threading.Lock()
        self._shards = shards_pb2_grpc.ShardsStub(self._channel)
        self._nodes = nodes_pb2_grpc.NodesStub(self._channel)
        self._rendezvous = rendezvous_pb2_grpc.RendezvousStub(self._channel)
        self._job = job_pb2_grpc.JobStub(self._channel)
        self._master = job_pb2_grpc.MasterStub(self._channel)
        self._checkpoints = checkpoint_pb2_grpc.CheckpointsStub(self._channel)
        self._node_check = nodecheck_pb2_grpc.NodeCheckStub(self._channel)

    def sharing_channel(self, *, timeout_s: float, retry: RetryPolicy) -> MasterClient:
        """A client on this one's channel with another deadline and retry
        policy (for callers that must answer quickly). Closing it closes the
        shared channel: close only this one."""
        token = self._metadata[0][1]
        return MasterClient(
            self.target, token=token, timeout_s=timeout_s, retry=retry, channel=self._channel
        )

    def close(self) -> None:
        self._channel.close()
        with self._io_lock:
            io, self._io_loop = self._io_loop, None
        if io is not None:
            io.close()

    def _io(self) -> _IoLoop:
        with self._io_lock:
            if self._io_loop is None:
                self._io_loop = _IoLoop(self.target, self._options, self._credentials)
            return self._io_loop

    @property
    def io_loop(self) -> asyncio.AbstractEventLoop:
        """The loop this client's sessions and `*_async` calls run on (its
        asyncio channel is opened here: call it first from outside that loop)."""
        return self._io().loop

    def __enter__(self) -> MasterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ datasets

    def register_dataset(self, spec: shards_pb2.DatasetSpec) -> shards_pb2.RegisterDatasetResponse:
        request = shards_pb2.RegisterDatasetRequest(spec=spec)
        return self._call("RegisterDataset", self._shards.RegisterDataset, request)

    def lease(
        self,
        dataset: str,
        *,
        node_id: str,
        rank: int,
        done: Iterable[int] = (),
        request_id: str | None = None,
    ) -> shards_pb2.LeaseResponse:
        """Async mode: a lease for this node-rank alone, after reporting the
        leases in `done` as finished (in the same round trip)."""
        request = rank_lease_request(dataset, node_id, rank, done, request_id)
        return self._call("Lease", self._shards.Lease, request)

    def lease_for_round(
        self,
        dataset: str,
        *,
        round: int,
        position: int,
        done: Iterable[int] = (),
        count: int = 1,
    ) -> shards_pb2.LeaseResponse:
        """Sync mode: the shard at `position` of rendezvous round `round`; every
        rank of the round gets the same answer. `count`: see round_lease_request."""
        request = round_lease_request(dataset, round, position, done, count)
        return self._call("Lease", self._shards.Lease, request)

    def renew(
        self, dataset: str, lease_id: int, consumed: int, *, round: int = 0
    ) -> shards_pb2.RenewResponse:
        request = shards_pb2.RenewRequest(
            dataset=dataset, lease_id=lease_id, round=round, consumed=consumed
        )
        return self._call("Renew", self._shards.Renew, request)

    def report_done(
        self, dataset: str, lease_id: int, *, round: int = 0
    ) -> shards_pb2.ReportResponse:
        request = shards_pb2.ReportRequest(
            dataset=dataset, lease_id=lease_id, round=round, done=shards_pb2.ShardDone()
        )
        return self._call("Report", self._shards.Report, request)

    def report_failure(
        self, dataset: str, lease_id: int, *, reason: str, consumed: int = 0, round: int = 0
    ) -> shards_pb2.ReportResponse:
        request = shards_pb2.ReportRequest(
            dataset=dataset,
            lease_id=lease_id,
            round=round,
            failure=shards_pb2.ShardFailure(reason=reason, consumed=consumed),
        )
        return self._call("Report", self._shards.Report, request)

    def snapshot(
        self, dataset: str, *, round: int = 0, progress: Iterable[tuple[int, int]] = ()
    ) -> shards_pb2.DatasetSnapshot:
        request = shards_pb2.SnapshotRequest(
            dataset=dataset,
            round=round,
            progress=[shards_pb2.LeaseProgress(lease_id=i, consumed=c) for i, c in progress],
        )
        return self._call("Snapshot", self._shards.Snapshot, request)

    def restore(
        self, snapshot: shards_pb2.DatasetSnapshot, *, round: int = 0
    ) -> shards_pb2.RestoreResponse:
        request = shards_pb2.RestoreRequest(snapshot=snapshot, round=round)
        return self._call("Restore", self._shards.Restore, request)

    def dataset_status(self, dataset: str) -> shards_pb2.DatasetStatus:
        request = shards_pb2.DatasetStatusRequest(dataset=dataset)
        return self._call("GetDatasetStatus", self._shards.GetDatasetStatus, request)

    # ---------------------------------------------------------- rendezvous

    def join_rendezvous(
        self,
        *,
        node_id: str,
        incarnation: int,
        local_world_size: int,
        host: str,
        bootstrap_port: int,
        timeout_s: float = 900.0,
        keeper_address: str = "",
    ) -> rendezvous_pb2.JoinResponse:
        """Blocks until this node is a member of a formed round. Retried across
        a master restart (joining again is idempotent). `keeper_address`: this
        node's checkpoint Keeper (host:port), told to the round's members."""
        request = join_request(
            node_id, incarnation, local_world_size, host, bootstrap_port, keeper_address
        )

        def once() -> rendezvous_pb2.JoinResponse:
            return self._rendezvous.Join(request, timeout=timeout_s, metadata=self._metadata)

        return self._with_retries("Join", once)

    def leave_rendezvous(self, node_id: str, incarnation: int, reason: str) -> None:
        request = rendezvous_pb2.LeaveRequest(
            node_id=node_id, incarnation=incarnation, reason=reason
        )
        self._call("Leave", self._rendezvous.Leave, request)

    def report_worker_failure(self, report: rendezvous_pb2.FailureReport) -> None:
        self._call("ReportFailure", self._rendezvous.ReportFailure, report)

    def rendezvous_state(
        self, waiting_only: bool = False
    ) -> rendezvous_pb2.RendezvousStateResponse:
        """The rendezvous now; `waiting_only`: just why nodes wait (no members)."""
        request = rendezvous_pb2.RendezvousStateRequest(waiting_only=waiting_only)
        return self._call("GetState", self._rendezvous.GetState, request)

    def agent_session(
        self, node_id: str, incarnation: int, heartbeat_interval_s: float
    ) -> AgentSession:
        """Open the node's session: heartbeats go up every interval, pushes
        (re-rendezvous) come down into `AgentSession.events`."""
        return AgentSession(self, node_id, incarnation, heartbeat_interval_s)

    def lease_session(self) -> LeaseSession:
        """A LeaseStream session for one consumer thread: the cheapest way to
        lease shard after shard (one message each way per shard)."""
        return LeaseSession(self)

    # --------------------------------------------------------- checkpoints

    def report_checkpoint(
        self, report: checkpoint_pb2.CheckpointReport
    ) -> checkpoint_pb2.CheckpointReportResponse:
        """The copies of one step this node holds now. Retrying is safe: a
        repeated report changes nothing."""
        return self._call("Report", self._checkpoints.Report, report)

    def latest_checkpoint(self, before_step: int = 0) -> checkpoint_pb2.CheckpointRecord:
        """The newest restorable step (below `before_step` when > 0);
        `found` is false when there is none."""
        request = checkpoint_pb2.LatestCheckpointRequest(before_step=before_step)
        return self._call("Latest", self._checkpoints.Latest, request)

    def report_persisted(self, report: checkpoint_pb2.PersistedReport) -> None:
        self._call("Persisted", self._checkpoints.Persisted, report)

    def checkpoint_status(self) -> checkpoint_pb2.CheckpointStatus:
        request = checkpoint_pb2.CheckpointStatusRequest()
        return self._call("Status", self._checkpoints.Status, request)

    # ---------------------------------------------------------- node check

    def node_check_begin(
        self, node_id: str, incarnation: int, host: str
    ) -> nodecheck_pb2.NodeCheckBeginResponse:
        """This node starts its pre-flight check (its agent, before the check
        process is up)."""
        request = nodecheck_pb2.NodeCheckBeginRequest(
            node_id=node_id, incarnation=incarnation, host=host
        )
        return self._call("Begin", self._node_check.Begin, request)

    def node_check_next(
        self, report: nodecheck_pb2.NodeCheckReport, timeout_s: float = 30.0
    ) -> nodecheck_pb2.NodeCheckOrder:
        """Report what the check process measured (or poll) and wait, a few
        seconds at most, for its next order. Retrying is safe: a repeated
        report changes nothing."""

        def once() -> nodecheck_pb2.NodeCheckOrder:
            return self._node_check.Next(report, timeout=timeout_s, metadata=self._metadata)

        return self._with_retries("Next", once)

    # ----------------------------------------------------------------- job

    def job_status(self) -> job_pb2.JobStatus:
        return self._call("GetStatus", self._job.GetStatus, job_pb2.JobStatusRequest())

    def master_status(
        self,
        supervisor: job_pb2.SupervisorTotals | None = None,
        job: job_pb2.JobStatus | None = None,
    ) -> job_pb2.MasterStatus:
        """The master's view of the job; the job's supervisor sends its
        running totals along (`supervisor`), for the master's /metrics, and
        its own status of the job (`job`), for the master's /api/v1/status."""
        request = job_pb2.MasterStatusRequest(supervisor=supervisor, job=job)
        return self._call("GetStatus", self._master.GetStatus, request)

    def scale(self, nodes: int) -> job_pb2.ScaleResponse:
        """Ask the job's platform for `nodes` nodes (within the job's min..max)."""
        return self._call("Scale", self._job.Scale, job_pb2.ScaleRequest(nodes=nodes))

    # --------------------------------------------------------------- nodes

    def register_node(
        self,
        *,
        job_name: str,
        node_name: str,
        local_world_size: int,
        host: str = "",
        nnodes: tuple[int, int] | None = None,
    ) -> nodes_pb2.RegisterNodeResponse:
        """`nnodes`: the (MIN, MAX) the node was started with, if it was given
        one: the master answers a range other than its own with
        `nnodes_warning`, and refuses one that cannot overlap it."""
        request = nodes_pb2.RegisterNodeRequest(
            job_name=job_name, node_name=node_name, local_world_size=local_world_size, host=host
        )
        if nnodes is not None:
            request.min_nodes, request.max_nodes = nnodes
        return self._call("Register", self._nodes.Register, request)

    # ------------------------------------------------- on the client's loop
    # The same requests as above, awaited on `io_loop` instead of blocking a
    # thread: one process can then drive thousands of nodes (the fleet
    # simulator). Register and Join are retried like their blocking twins
    # (under `retry`); a heartbeat is one attempt (the next beat is the retry).

    async def register_node_async(
        self, *, job_name: str, node_name: str, local_world_size: int, host: str = ""
    ) -> nodes_pb2.RegisterNodeResponse:
        request = nodes_pb2.RegisterNodeRequest(
            job_name=job_name, node_name=node_name, local_world_size=local_world_size, host=host
        )
        stub = nodes_pb2_grpc.NodesStub(self._io().channel)
        return await self._await_with_retries(
            "Register",
            lambda: stub.Register(request, timeout=self.timeout_s, metadata=self._metadata),
        )

    async def join_rendezvous_async(
        self,
        *,
        node_id: str,
        incarnation: int,
        local_world_size: int,
        host: str,
        bootstrap_port: int,
        timeout_s: float = 900.0,
        keeper_address: str = "",
    ) -> rendezvous_pb2.JoinResponse:
        request = join_request(
            node_id, incarnation, local_world_size, host, bootstrap_port, keeper_address
        )
        stub = self._io().rendezvous
        return await self._await_with_retries(
            "Join", lambda: stub.Join(request, timeout=timeout_s, metadata=self._metadata)
        )

    async def heartbeat_async(self, node_id: str, incarnation: int) -> nodes_pb2.HeartbeatResponse:
        request = nodes_pb2.HeartbeatRequest(node_id=node_id, incarnation=incarnation)
        stub = nodes_pb2_grpc.NodesStub(self._io().channel)
        try:
            return await stub.Heartbeat(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as error:
            raise error_from_status(error.code(), error.details() or "") from None

    async def _await_with_retries(
        self, name: str, attempt_once: Callable[[], Awaitable[Resp]]
    ) -> Resp:
        """`_with_retries` for a call awaited on the loop."""
        attempts = _Attempts(name, self.target, self.retry)
        while True:
            try:
                return await attempt_once()
            except grpc.RpcError as error:
                pause = attempts.failed(error)
            await asyncio.sleep(pause)

    def heartbeat(self, node_id: str, incarnation: int) -> nodes_pb2.HeartbeatResponse:
        request = nodes_pb2.HeartbeatRequest(node_id=node_id, incarnation=incarnation)
        return self._call("Heartbeat", self._nodes.Heartbeat, request)

    def deregister_node(self, node_id: str, incarnation: int) -> None:
        request = nodes_pb2.DeregisterNodeRequest(node_id=node_id, incarnation=incarnation)
        self._call("Deregister", self._nodes.Deregister, request)

    # ----------------------------------------------------------- transport

    def _call(self, name: str, method: Callable[..., Resp], request: Any) -> Resp:
        def once() -> Resp:
            return method(request, timeout=self.timeout_s, metadata=self._metadata)

        return self._with_retries(name, once)

    def _with_retries(self, name: str, attempt_once: Callable[[], Resp]) -> Resp:
        """Run `attempt_once` until it succeeds, a non-transient error ends it,
        or the retry budget is spent (then `Unavailable`, naming the cause)."""
        attempts = _Attempts(name, self.target, self.retry)
        while True:
            try:
                return attempt_once()
            except grpc.RpcError as error:
                pause = attempts.failed(error)
            time.sleep(pause)


class _Attempts:
    """One call's attempts under a `RetryPolicy`: after each failure, how long
    to wait before the next, or the error that ends the call."""

    def __init__(self, name: str, target: str, policy: RetryPolicy) -> None:
        self._name = name
        self._target = target
        self._policy = policy
        self._started = time.monotonic()
        self._done = 0

    def failed(self, error: grpc.RpcError) -> float:
        code = error.code()
        if code not in _RETRYABLE:
            raise error_from_status(code, error.details() or "") from None
        policy = self._policy
        pause = policy.backoff(self._done)
        self._done += 1
        elapsed = time.monotonic() - self._started
        if self._done >= policy.attempts or elapsed + pause > policy.total_budget_s:
            raise Unavailable(
                f"{self._name} to master {self._target} failed after {self._done} attempts "
                f"over {elapsed:.1f}s: {code.name}: {error.details()}"
            ) from None
        # One line per retry, so that a master that is down or unreachable is
        # seen at once and by its address, not only when the budget is spent.
        _log.warning(
            "%s to master %s: attempt %d of %d failed (%s: %s); retrying in %.2fs",
            self._name, self._target, self._done, policy.attempts, code.name,
            _one_line(error.details()), pause,
        )  # fmt: skip
        return pause


def _one_line(details: str | None, limit: int = MAX_DETAILS_LOGGED) -> str:
    text = " ".join((details or "").split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _SharedLoop:
    """One asyncio loop on a daemon thread per process, started on first use,
    for every client's lease streams: a message on a grpc.aio stream costs
    less CPU than on the sync API's streams (which hand every request to a
    thread of their own), and one loop serves any number of sessions. A
    forked child starts its own."""

    _lock = threading.Lock()
    _current: tuple[int, asyncio.AbstractEventLoop, _Handoff] | None = None

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        return cls._started()[1]

    @classmethod
    def handoff(cls) -> _Handoff:
        return cls._started()[2]

    @classmethod
    def _started(cls) -> tuple[int, asyncio.AbstractEventLoop, _Handoff]:
        with cls._lock:
            if cls._current is None or cls._current[0] != os.getpid():
                loop = asyncio.new_event_loop()
                threading.Thread(
                    target=loop.run_forever, name="dlfleet-client-io", daemon=True
                ).start()
                cls._current = (os.getpid(), loop, _Handoff(loop))
            return cls._current


class _Handoff:
    """Coroutines handed to a loop from other threads, like
    `asyncio.run_coroutine_threadsafe`, with one wake-up of the loop per
    burst: a coroutine handed over while an earlier one still waits for the
    loop rides on that one's wake-up. Each wake-up is a write to the loop's
    self-pipe by the caller and a turn of the loop thread; with dozens of
    sessions in one process those turns, and the GIL hand-offs around them,
    were most of what a lease waited for.

    The way back is batched too: the callers whose answers came in one turn
    of the loop are woken together at its end, when the loop is about to
    sleep and let go of the GIL, not one by one while it still holds it (a
    caller woken then only wakes to wait again, for the GIL)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._queue: list[_Handed[Any]] = []
        self._scheduled = False
        self._to_wake: list[threading.Lock] = []

    def submit(self, coro: Coroutine[Any, Any, Resp]) -> _Handed[Resp]:
        handed = _Handed(self, coro)
        with self._lock:
            self._queue.append(handed)
            if self._scheduled:
                return handed
            self._scheduled = True
        self.loop.call_soon_threadsafe(self._start)
        return handed

    def _start(self) -> None:
        with self._lock:
            batch, self._queue = self._queue, []
            self._scheduled = False
        for handed in batch:
            handed.start()

    def wake(self, ready: threading.Lock) -> None:
        """On the loop: release `ready` once this turn's callbacks have run."""
        if not self._to_wake:
            self.loop.call_soon(self._wake_all)
        self._to_wake.append(ready)

    def _wake_all(self) -> None:
        ready, self._to_wake = self._to_wake, []
        for lock in ready:
            lock.release()


class _Handed(Generic[Resp]):
    """A coroutine handed to the loop, and its outcome for the one thread
    that waits for it. Lighter than a `concurrent.futures.Future`: the waiter
    sleeps on a lock the loop releases as its last step, so it never wakes
    only to wait again for a lock the loop still holds."""

    __slots__ = (
        "_coro",
        "_done",
        "_given_up",
        "_handoff",
        "_lock",
        "_outcome",
        "_ready",
        "_task",
    )

    def __init__(self, handoff: _Handoff, coro: Coroutine[Any, Any, Resp]) -> None:
        self._handoff = handoff
        self._coro: Coroutine[Any, Any, Resp] | None = coro
        self._lock = threading.Lock()  # guards _task, _given_up, _done
        self._ready = threading.Lock()
        self._ready.acquire()
        self._task: asyncio.Task[Resp] | None = None
        self._given_up = False
        self._done = False
        self._outcome: Resp | BaseException | None = None

    def start(self) -> None:
        """On the loop: run the coroutine, unless its caller gave up already."""
        coro, self._coro = self._coro, None
        assert coro is not None, "started twice"
        with self._lock:
            if self._given_up:
                coro.close()
                return
            task = self._task = self._handoff.loop.create_task(coro)
        task.add_done_callback(self._finish)

    def _finish(self, task: asyncio.Task[Resp]) -> None:
        if task.cancelled():
            outcome: Resp | BaseException = concurrent.futures.CancelledError()
        else:
            error = task.exception()
            outcome = error if error is not None else task.result()
        with self._lock:
            self._outcome = outcome
            self._done = True
        self._handoff.wake(self._ready)

    def result(self, timeout_s: float) -> Resp:
        """The coroutine's result (or its exception, raised here) within
        `timeout_s`; else it is cancelled on the loop (or never started) and
        this raises `TimeoutError`."""
        if not self._ready.acquire(timeout=timeout_s):
            with self._lock:
                done = self._done
                if not done:
                    self._given_up = True
                    task = self._task
            if not done:
                if task is not None:
                    with contextlib.suppress(RuntimeError):  # the loop is closed
                        self._handoff.loop.call_soon_threadsafe(task.cancel)
                raise TimeoutError(f"no outcome within {timeout_s} s")
        outcome = self._outcome
        if isinstance(outcome, BaseException):
            raise outcome
        return cast(Resp, outcome)


class _IoLoop:
    """A client's grpc.aio channel to the master, on the shared loop."""

    def __init__(
        self,
        target: str,
        options: list[tuple[str, Any]],
        credentials: grpc.ChannelCredentials | None,
    ) -> None:
        self.loop = _SharedLoop.get()
        self.handoff = _SharedLoop.handoff()

        async def connect() -> shards_pb2_grpc.ShardsAsyncStub:
            if credentials is not None:
                self._channel = grpc.aio.secure_channel(target, credentials, options=options)
            else:
                self._channel = grpc.aio.insecure_channel(target, options=options)
            return shards_pb2_grpc.ShardsStub(self._channel)

        self.stub = self.run(connect())
        self.channel = self._channel
        self.rendezvous: rendezvous_pb2_grpc.RendezvousAsyncStub = (
            rendezvous_pb2_grpc.RendezvousStub(self._channel)
        )

    def run(self, coro: Coroutine[Any, Any, Resp]) -> Resp:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.run(self._channel.close())


class LeaseSession:
    """One consumer's long-lived LeaseStream: each request gets one response,
    in order. Not thread-safe: one session per consumer thread.

    A broken stream (master restart, network) is reopened and the request in
    flight is sent again under the client's retry budget; that is safe because
    the request is idempotent (its request id, round position, and DONE
    reports). A dead connection is noticed by gRPC keepalive.
    """

    def __init__(self, client: MasterClient) -> None:
        self._client = client
        self._call: (
            grpc.aio.StreamStreamCall[shards_pb2.LeaseRequest, shards_pb2.LeaseResponse] | None
        ) = None

    def lease(
        self,
        dataset: str,
        *,
        node_id: str,
        rank: int,
        done: Iterable[int] = (),
        request_id: str | None = None,
    ) -> shards_pb2.LeaseResponse:
        return self.request(rank_lease_request(dataset, node_id, rank, done, request_id))

    def lease_for_round(
        self,
        dataset: str,
        *,
        round: int,
        position: int,
        done: Iterable[int] = (),
        count: int = 1,
    ) -> shards_pb2.LeaseResponse:
        return self.request(round_lease_request(dataset, round, position, done, count))

    def request(self, request: shards_pb2.LeaseRequest) -> shards_pb2.LeaseResponse:
        io = self._client._io()
        response = self._client._with_retries(
            "LeaseStream", lambda: self._exchange_within_deadline(io, request)
        )
        if response.WhichOneof("outcome") == "error":
            raise error_from_code(response.error.code, response.error.message)
        return response

    def _exchange_within_deadline(
        self, io: _IoLoop, request: shards_pb2.LeaseRequest
    ) -> shards_pb2.LeaseResponse:
        """Every message has the client's deadline, like a unary call: a stream
        that does not answer in time is dropped and the request retried.

        The calling thread keeps the deadline while it waits, rather than an
        `asyncio.wait_for` on the loop, which costs the loop that every session
        of the process shares a task and a timer per message."""
        exchange = io.handoff.submit(self._exchange(io, request))
        try:
            return exchange.result(self._client.timeout_s)
        except TimeoutError:
            # Cancelled on the loop, the exchange drops its stream.
            raise _StreamTimeout(self._client.timeout_s) from None

    async def _exchange(
        self, io: _IoLoop, request: shards_pb2.LeaseRequest
    ) -> shards_pb2.LeaseResponse:
        if self._call is None:
            self._call = io.stub.LeaseStream(metadata=self._client._metadata)
        call = self._call
        try:
            await call.write(request)
            response = await call.read()
        except asyncio.InvalidStateError:
            # The stream had ended under us (the master went away between two
            # requests): open a new one.
            self._call = None
            raise _StreamEnded() from None
        except grpc.RpcError as error:
            self._call = None
            call.cancel()
            if error.code() is grpc.StatusCode.INTERNAL:
                # gRPC's core reports a transport that broke mid-stream as
                # INTERNAL; our server never answers a lease with it.
                raise _StreamEnded() from error
            raise
        except asyncio.CancelledError:
            # A timed-out stream is never reused: its answers could be out of
            # step with the requests. (The caller may have moved on already;
            # a stream it opened since is not this one's to drop.)
            if self._call is call:
                self._call = None
            call.cancel()
            raise
        if not isinstance(response, shards_pb2.LeaseResponse):  # grpc.aio.EOF
            self._call = None
            raise _StreamEnded()
        return response

    def close(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            self._client._io().loop.call_soon_threadsafe(call.cancel)

    def __enter__(self) -> LeaseSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


class AgentSession:
    """A node's session with the master, on the shared I/O loop.

    Heartbeats go up every `heartbeat_interval_s` and tell the master the
    agent is alive and not hung; events pushed by the master arrive on
    `events`, but pairs to run for another node's check on `check_pairs`.
    If the stream breaks (master restart, network), it is reopened with
    backoff; `broken` is set while it is down, and `closed_by_master` when
    the master refused the session (this incarnation is no longer
    registered).
    """

    def __init__(
        self, client: MasterClient, node_id: str, incarnation: int, heartbeat_interval_s: float
    ) -> None:
        self._client = client
        self.node_id = node_id
        self.incarnation = incarnation
        self.round = 0
        self.events: queue.Queue[rendezvous_pb2.SessionEvent] = queue.Queue()
        # Pairs for late nodes' checks this node runs, whatever phase it is in.
        self.check_pairs: queue.Queue[nodecheck_pb2.PairOrder] = queue.Queue()
        self.broken = threading.Event()
        self.closed_by_master = threading.Event()
        self.interval = heartbeat_interval_s
        # What the next heartbeat tells about the node's training (set by the
        # agent; None until it has measured something).
        self.metrics: rendezvous_pb2.NodeMetrics | None = None
        # Set by the agent once its workers run `dlfleet.elastic.run`.
        self.restarts_in_place = False
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
                    else:
                        if event.HasField("re_rendezvous"):
                            self._master_joined(event.re_rendezvous, call)
                        self.events.put(event)
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
        if self.metrics is not None:
            message.metrics.CopyFrom(self.metrics)
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


class _StreamTimeout(grpc.RpcError):
    """No answer on the lease stream within the client's deadline."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__()
        self._timeout_s = timeout_s

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return f"no answer on the lease stream within {self._timeout_s:g}s"


class _StreamEnded(grpc.RpcError):
    """The server closed the stream without an error (it is shutting down)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the master closed the lease stream"
