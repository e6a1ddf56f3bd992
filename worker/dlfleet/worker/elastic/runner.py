"""`dlfleet.elastic.run(train)`: restarts without a cold start.

A script opts in by putting its training in a function and calling
`run(train)` (the model may be built before: it survives a restart). Under
`dlworker` the process then does not die when the world changes or a peer
fails: the attempt is aborted, the process group destroyed, and `train` is
called again with the next round's ranks, in the same process, with torch
imported, the model built and CUDA up. Only dead or hung processes are
replaced, by spare processes the agent started ahead (interpreter up, the
script's imports done, waiting in `run`). Without dlworker (plain torchrun,
or no launcher), `run` initialises the process group from the environment
and calls `train` once: torchrun's contract.

The pipeline of one attempt, each step small and named (as in
nvidia-resiliency-ext's in-process restart):

    WaitOrder -> Initialize (store + process group) -> Train
              -> Finalize (finished: report, return)
              -> Abort    (the agent said so, or a collective failed and
                           the agent confirms the round is over): attempt's
                           resources closed, group destroyed, back to WaitOrder

An exception that is not an abort is the script's own failure: it propagates
and the process exits with it, as under torchrun (the agent then replaces the
process and counts a restart).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import gc
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar, cast

from dlfleet.api.env import AGENT_ENV, PEER_FAILURE_GRACE_ENV, ROUND_ENV, SPARE_ENV, TOKEN_ENV
from dlfleet.api.errors import DlfleetError, StaleError
from dlfleet.api.processes import RANK_NAME, SPARE_NAME, name_process
from dlfleet.api.v1 import checkpoint_pb2
from dlfleet.worker import progress
from dlfleet.worker.elastic.abort import CollectiveAbort
from dlfleet.worker.elastic.channel import STACKS_SIGNAL, Abort, AgentChannel, Exit, WorkState

_log = logging.getLogger("dlfleet.elastic")

T = TypeVar("T")
DEFAULT_PEER_FAILURE_GRACE_S = 30.0
EXIT_AGENT_GONE = 3
_ABORTED = object()  # what an aborted attempt returns
# What a collective says when a peer is gone or the group was aborted.
_COMMUNICATION_FAILURE = re.compile(
    r"Connection (closed|reset) by peer|Read error|Write error|Broken pipe|Timed out|"
    r"timed out|Socket Timeout|NCCL (error|communicator)|aborted|Connection refused|"
    r"ProcessGroup.*(shut|destroy)|connectFullMesh|DistNetworkError|DistBackendError"
)


class Interrupted(DlfleetError):
    """The agent ended this round: raised by `check()` between steps, so a
    rank that is not inside a collective leaves promptly too."""


@dataclass(frozen=True)
class Attempt:
    """One call of the training function: who this process is in which round."""

    round: int
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    group_rank: int
    group_world_size: int
    restart_count: int  # the node's restarts so far (TORCHELASTIC_RESTART_COUNT)
    index: int  # attempts of this process before this one
    in_process: bool  # under dlworker's in-process restarts


@dataclass
class _Current:
    attempt: Attempt | None = None
    channel: AgentChannel | None = None
    closers: list[Callable[[], None]] = field(default_factory=list)


# The attempt this process is in, like torch's default process group: one per
# process, set and cleared by `run` only.
_current = _Current()


def current() -> Attempt | None:
    """The attempt in progress, None outside `run`."""
    return _current.attempt


def check() -> None:
    """Raise `Interrupted` if the agent has ended the current round. The
    loader calls it for every batch, the checkpointer for every save."""
    attempt, channel = _current.attempt, _current.channel
    if attempt is not None and channel is not None and channel.aborted(attempt.round):
        raise Interrupted(f"round {attempt.round} was ended by the agent")


def on_attempt_end(close: Callable[[], None]) -> None:
    """Run `close` when the current attempt ends, however it ends (an
    attempt's loaders and helper threads must not outlive it). Outside
    `run`, nothing is registered."""
    if _current.attempt is not None:
        _current.closers.append(close)


def agent_channel() -> AgentChannel | None:
    """The line to this node's agent, while `run` holds one."""
    return _current.channel


def is_communication_failure(exc: BaseException) -> bool:
    if isinstance(exc, StaleError | Interrupted):
        return True
    return bool(_COMMUNICATION_FAILURE.search(f"{type(exc).__name__}: {exc}"))


def run(
    train: Callable[[Attempt], T],
    *,
    backend: str | None = None,
    timeout: timedelta = timedelta(seconds=60),
) -> T:
    """Run `train` with a process group up, again after every world change.

    `backend`: "nccl" when CUDA is available, else "gloo", unless given.
    `timeout`: of the process group's collectives (a silent hang; a dead
    peer or a world change is noticed at once).
    """
    address = os.environ.get(AGENT_ENV)
    if not address:
        return _run_once(train, backend, timeout)
    # The agent asks for every thread's stack (on stderr) before it kills a
    # process that is stuck: the log then says where.
    # (Chained to a handler the script set; never to the default: it ends
    # the process.)
    previous = signal.getsignal(STACKS_SIGNAL)
    chain = previous not in (signal.SIG_DFL, signal.SIG_IGN, None)
    faulthandler.register(STACKS_SIGNAL, all_threads=True, chain=chain)
    if os.environ.get(SPARE_ENV) == "1":
        name_process(SPARE_NAME)  # what `ps` shows until it takes over a rank
        # A spare's environment is a world of one: a group the script made
        # from it (Accelerate does) is no round's.
        retire_process_group()
        warm_up(backend)  # before attaching: a spare that attached is ready
    # Everything alive now (torch, the script's imports, its model) stays:
    # later collections, after each aborted attempt, skip it (~0.2 s -> ms).
    gc.collect()
    gc.freeze()
    return _InProcess(address, backend, timeout).run(train)


# --------------------------------------------------------------- torchrun


def _run_once(train: Callable[[Attempt], T], backend: str | None, timeout: timedelta) -> T:
    import torch.distributed as dist

    env = os.environ
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group(_backend(backend), timeout=timeout)
    attempt = Attempt(
        round=int(env.get(ROUND_ENV, "0")),
        rank=dist.get_rank(),
        local_rank=int(env.get("LOCAL_RANK", "0")),
        world_size=dist.get_world_size(),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
        group_rank=int(env.get("GROUP_RANK", "0")),
        group_world_size=int(env.get("GROUP_WORLD_SIZE", "1")),
        restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        index=0,
        in_process=False,
    )
    _current.attempt = attempt
    try:
        return train(attempt)
    finally:
        _end_attempt()
        if owned and dist.is_initialized():
            dist.destroy_process_group()


def _backend(backend: str | None) -> str:
    if backend:
        return backend
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def _end_attempt() -> None:
    closers, _current.closers = _current.closers, []
    for close in reversed(closers):
        try:
            close()
        except Exception as exc:  # noqa: BLE001 - one closer must not keep the others from running
            _log.warning("closing after the attempt failed: %s", exc)
    _current.attempt = None
    progress.idle()


# ------------------------------------------------------------- in-process


class _InProcess:
    def __init__(self, address: str, backend: str | None, timeout: timedelta) -> None:
        self.pid = os.getpid()
        self.backend = backend
        self.timeout = timeout
        self.grace_s = float(
            os.environ.get(PEER_FAILURE_GRACE_ENV, str(DEFAULT_PEER_FAILURE_GRACE_S))
        )
        self.abort = CollectiveAbort()
        self.channel = AgentChannel(
            address,
            token=os.environ.get(TOKEN_ENV, ""),
            pid=self.pid,
            spare=os.environ.get(SPARE_ENV) == "1",
        )
        self.channel.on_abort = self._on_abort
        self.round = 0
        # The round and store this process was launched for (see `_adoptable`).
        self.launched = (os.environ.get(ROUND_ENV, ""), os.environ.get("MASTER_PORT", ""))

    def _on_abort(self, round_: int) -> None:
        if round_ >= self.round > 0:
            self.abort.abort()

    def run(self, train: Callable[[Attempt], T]) -> T:
        _current.channel = self.channel
        index = 0
        try:
            while True:
                order = self._wait_order()
                attempt = self._initialize(order, index)
                if attempt is None:
                    continue
                index += 1
                outcome = self._train(train, attempt)
                if outcome is not _ABORTED:
                    return cast(T, outcome)
        finally:
            _current.channel = None
            self.channel.close()

    # ------------------------------------------------------------- steps

    def _wait_order(self) -> checkpoint_pb2.RunOrder:
        """WaitOrder: the next run order; exits on an exit order or when the
        agent is gone (its parent-death signal would end us anyway)."""
        while True:
            order = self.channel.next()
            if order is None:
                _log.error("the node agent is gone; exiting")
                raise SystemExit(EXIT_AGENT_GONE)
            if isinstance(order, Exit):
                raise SystemExit(order.code)
            if isinstance(order, Abort):  # nothing is running: already where it wants us
                self.channel.report(order.round, WorkState.ABORTED, pid=self.pid)
                continue
            return order.order

    def _initialize(self, order: checkpoint_pb2.RunOrder, index: int) -> Attempt | None:
        """Initialize: this round's environment, store and process group.
        None when the round ended before the group came up."""
        import torch.distributed as dist

        _apply_env(order.env)
        if os.environ.get(SPARE_ENV) == "1":
            name_process(RANK_NAME)
        self.round = order.round
        attempt = Attempt(
            round=order.round,
            rank=order.rank,
            local_rank=order.local_rank,
            world_size=order.world_size,
            local_world_size=order.local_world_size,
            group_rank=order.group_rank,
            group_world_size=order.group_world_size,
            restart_count=order.restart_count,
            index=index,
            in_process=True,
        )
        self.abort.before_init()
        if self.channel.aborted(order.round):
            self.channel.report(order.round, WorkState.ABORTED, pid=self.pid)
            return None
        adopted = self._adoptable(order, index)
        try:
            if not adopted:
                self._form_group(order)
        except Exception as exc:  # sorted below: an abort, or the script's failure
            if self.channel.aborted(order.round) or self.channel.wait_aborted(
                order.round, self.grace_s
            ):
                _log.info("round %d ended while its process group formed: %s", order.round, exc)
                self._destroy_group()
                self.channel.report(order.round, WorkState.ABORTED, pid=self.pid)
                return None
            raise
        if adopted:
            _log.info("round %d: the process group made before run() is this round's", order.round)
            self.abort.adopt(dist.group.WORLD)
        else:
            self.abort.arm(dist.group.WORLD)
        if self.channel.aborted(order.round):  # the abort came before arm()
            self.abort.abort()
        _current.attempt = attempt
        self.channel.report(order.round, WorkState.RUNNING, pid=self.pid)
        return attempt

    def _adoptable(self, order: checkpoint_pb2.RunOrder, index: int) -> bool:
        """Whether a process group already up is this round's own: made
        from the launch environment before `run` (Accelerate makes one when
        HF's TrainingArguments are made), in the round and on the store this
        process was launched for, with its rank and world. Any other group
        made before is not this round's: it is retired (its store's port is
        not this round's, so nothing waits for it to close)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return False
        if (
            index == 0
            and self.launched == (str(order.round), str(order.store_port))
            and dist.get_rank() == order.rank
            and dist.get_world_size() == order.world_size
        ):
            return True
        _log.info("a process group made before run() is not round %d's: retired", order.round)
        retire_process_group()
        return False

    def _form_group(self, order: checkpoint_pb2.RunOrder) -> None:
        """The round's store (hosted by rank 0) and process group."""
        import torch.distributed as dist

        if order.rank != 0:
            # A client that finds no server backs off for up to a second
            # before trying again: knock first, cheaply.
            _wait_for_listener(order.store_host, order.store_port, self.timeout, self.abort.aborted)
        store = dist.TCPStore(  # type: ignore[attr-defined]
            order.store_host,
            order.store_port,
            order.world_size,
            is_master=order.rank == 0,
            timeout=self.timeout,
        )
        dist.init_process_group(
            _backend(self.backend),
            # The keys `init_process_group("env://")` uses: a process started
            # for this round may have formed its group from the environment
            # before `run` (Accelerate does) on this same store.
            store=dist.PrefixStore("default_pg", store),  # type: ignore[attr-defined]
            rank=order.rank,
            world_size=order.world_size,
            timeout=self.timeout,
        )

    def _train(self, train: Callable[[Attempt], T], attempt: Attempt) -> object:
        """Train, then Finalize (its result) or Abort (`_ABORTED`)."""
        try:
            result = train(attempt)
        except (KeyboardInterrupt, SystemExit):
            self._finish_attempt()
            raise
        except BaseException as exc:
            if not self._is_abort(exc, attempt.round):
                self._finish_attempt()
                raise
            summary = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            # The traceback holds the attempt's frames (its model wrapper,
            # loaders, the process group): drop them before the next attempt.
            traceback.clear_frames(exc.__traceback__)
            del exc
            _log.warning(
                "round %d aborted (%s); waiting for the next round", attempt.round, summary
            )
            self._finish_attempt()
            self.channel.report(attempt.round, WorkState.ABORTED, summary, pid=self.pid)
            # While the next round forms: the old attempt's cycles (a model
            # wrapper's hooks, buckets) go now, not in the middle of a step.
            gc.collect()
            return _ABORTED
        self._finish_attempt()
        self.channel.report(attempt.round, WorkState.FINISHED, pid=self.pid)
        return result

    def _is_abort(self, exc: BaseException, round_: int) -> bool:
        if self.channel.aborted(round_):
            return True
        if not is_communication_failure(exc):
            return False
        _log.warning(
            "a collective failed (%s); waiting up to %.0fs for the agent", exc, self.grace_s
        )
        return self.channel.wait_aborted(round_, self.grace_s)

    def _finish_attempt(self) -> None:
        _end_attempt()
        self._destroy_group()

    def _destroy_group(self) -> None:
        self.abort.disarm()
        retire_process_group()


# A process group's objects outlive its destruction for RETIRED_KEEP_S, on
# purpose. gloo's destructor joins its worker threads while the caller holds
# the GIL, and a worker that is just releasing a finished collective's tensors
# needs the GIL (to drop their Python objects): a deadlock, seen as a spare
# that never became ready or a survivor that never left its aborted round
# (py-spy: the main thread in ~ProcessGroupGloo -> thread::join, a gloo thread
# in ~AsyncAllreduceWork -> gil_scoped_acquire). Kept a while, the group's
# threads are idle when its last reference goes.
# At exit, the groups still kept are leaked rather than destroyed: the
# interpreter's teardown would run their destructors in a dying process,
# whose joinable gloo threads can end it in std::terminate (SIGABRT after the
# work is done: tests/integration/worker/test_process_group_retire.py saw it
# once under load). The operating system frees them.
RETIRED_KEEP_S = 10.0
_retired: deque[tuple[float, object]] = deque()


@atexit.register
def _leak_retired() -> None:
    for _, group in _retired:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def retire_process_group() -> None:
    """`destroy_process_group()` of the default group, its objects kept
    alive for a while (see above); groups retired long enough go now."""
    import torch.distributed as dist

    if dist.is_initialized():
        _retired.append((time.monotonic(), dist.group.WORLD))
        with contextlib.suppress(RuntimeError, ValueError):
            dist.destroy_process_group()
    while _retired and time.monotonic() - _retired[0][0] > RETIRED_KEEP_S:
        _retired.popleft()


def warm_up(backend: str | None) -> None:
    """What a process does the first time it trains with a process group,
    done ahead by a spare: torch.distributed's lazy imports and set-up (the
    gloo device, DDP's reducer, autograd's engine threads) cost a fresh
    process ~1-2 s on its first attempt, and every rank would wait for it.
    A one-process group on an in-memory store; nothing leaves the process."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    started = time.monotonic()
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = DistributedDataParallel(torch.nn.Linear(4, 4))
        model(torch.ones(2, 4)).sum().backward()
        dist.all_reduce(torch.ones(1))
        import torch.distributed.checkpoint  # the checkpointer's planner
    finally:
        retire_process_group()  # not destroyed now: see retire_process_group
    del backend
    _log.info("spare warmed up in %.2fs", time.monotonic() - started)


def _wait_for_listener(host: str, port: int, timeout: timedelta, aborted: threading.Event) -> None:
    """Until something accepts connections on host:port, `timeout`, or an
    abort (raises Interrupted)."""
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        if aborted.is_set():
            raise Interrupted("the round ended before its store was up")
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.005)


def _apply_env(env: Mapping[str, str]) -> None:
    """The round's torchrun variables, for code that reads the environment
    (a loader, `init_process_group` elsewhere, logging)."""
    os.environ.update(env)
    sys.stdout.flush()
