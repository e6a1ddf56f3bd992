"""Plumbing shared by the master's gRPC services: the clock and the bridge
from the group committer's futures to the event loop. Domain errors become
status codes in `dlfleet.api.serving.answers` (`rpc`), shared with the job
supervisor's control service.

Lives in the master service process.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from typing import Protocol


class Clock(Protocol):
    def __call__(self) -> int:
        """Milliseconds since the Unix epoch."""


def system_clock() -> int:
    return time.time_ns() // 1_000_000


class Durable:
    """Turns the group committer's outcomes into asyncio futures, with one
    loop wake-up per committed batch rather than one per request: for a thread
    future (`wait`), or as the committer's sink (`waiter`, then
    `GroupCommitter.submit_to(..., durable, waiter)`), which spares the
    future."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._ready: list[tuple[object, int | BaseException]] = []
        self._scheduled = False

    def wait(self, future: Future[int]) -> asyncio.Future[int]:
        waiter: asyncio.Future[int] = self._loop.create_future()
        future.add_done_callback(lambda done: self._push(waiter, done))
        return waiter

    def waiter(self) -> asyncio.Future[int]:
        """A future for `committed` to settle: pass it as the token."""
        return self._loop.create_future()

    def committed(self, outcomes: list[tuple[object, int | BaseException]]) -> None:
        """`CommitSink`: on the writer thread, once per batch."""
        with self._lock:
            self._ready.extend(outcomes)
            if self._scheduled:
                return
            self._scheduled = True
        self._loop.call_soon_threadsafe(self._drain)

    def _push(self, waiter: asyncio.Future[int], done: Future[int]) -> None:
        error = done.exception()
        self.committed([(waiter, error if error is not None else done.result())])

    def _drain(self) -> None:
        with self._lock:
            ready, self._ready = self._ready, []
            self._scheduled = False
        for waiter, outcome in ready:
            assert isinstance(waiter, asyncio.Future)
            if waiter.cancelled():
                continue
            if isinstance(outcome, BaseException):
                waiter.set_exception(outcome)
            else:
                waiter.set_result(outcome)
