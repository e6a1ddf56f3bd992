"""The client's one asyncio loop per process and the hand-off of coroutines
to it from other threads: what its lease streams, sessions and `*_async`
calls run on.

Invariant: one loop per process (a forked child starts its own); a
coroutine handed over from a thread wakes the loop at most once per burst,
and its caller is woken once the loop's turn ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Coroutine
from typing import Any, Generic, TypeVar, cast

import grpc

from dlfleet.api.v1 import rendezvous_pb2_grpc, shards_pb2_grpc

Resp = TypeVar("Resp")


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
