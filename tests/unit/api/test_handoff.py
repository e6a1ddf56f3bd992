"""The hand-off of lease exchanges from caller threads to the client's shared
loop (`_Handoff`, `_Handed`): a real loop on a real thread, real coroutines."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator

import pytest

from dlfleet.api.client.leases import _request_ids
from dlfleet.api.client.loop import _Handoff


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


async def _answer(value: int, delay_s: float = 0.0) -> int:
    await asyncio.sleep(delay_s)
    return value


def test_a_result_comes_back_to_the_caller(loop: asyncio.AbstractEventLoop) -> None:
    handoff = _Handoff(loop)
    assert handoff.submit(_answer(7)).result(5) == 7


def test_an_exception_is_raised_in_the_caller(loop: asyncio.AbstractEventLoop) -> None:
    async def fail() -> int:
        raise KeyError("no such lease")

    with pytest.raises(KeyError, match="no such lease"):
        _Handoff(loop).submit(fail()).result(5)


def test_a_caller_that_gives_up_cancels_the_coroutine_on_the_loop(
    loop: asyncio.AbstractEventLoop,
) -> None:
    cancelled = threading.Event()

    async def slow() -> int:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 1

    started = time.monotonic()
    with pytest.raises(TimeoutError):
        _Handoff(loop).submit(slow()).result(0.2)
    assert time.monotonic() - started < 5
    assert cancelled.wait(5), "the coroutine kept running after its caller gave up"


def test_a_coroutine_whose_caller_gave_up_before_the_loop_took_it_never_runs() -> None:
    """The loop is not running yet: the caller gives up while the coroutine
    waits in the queue; when the loop starts, it is closed unstarted."""
    loop = asyncio.new_event_loop()
    ran = threading.Event()

    async def mark() -> int:
        ran.set()
        return 1

    handoff = _Handoff(loop)
    with pytest.raises(TimeoutError):
        handoff.submit(mark()).result(0.05)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        assert handoff.submit(_answer(2)).result(5) == 2  # the loop has run the queue
        assert not ran.is_set()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_many_threads_each_get_their_own_answer(loop: asyncio.AbstractEventLoop) -> None:
    """Hand-offs that ride on one wake-up of the loop still each get their own
    coroutine's result."""
    handoff = _Handoff(loop)
    wrong: list[tuple[int, int]] = []

    def caller(base: int) -> None:
        for i in range(200):
            got = handoff.submit(_answer(base + i)).result(5)
            if got != base + i:
                wrong.append((base + i, got))

    threads = [threading.Thread(target=caller, args=(k * 1000,)) for k in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert wrong == []


def test_request_ids_are_unique_and_change_prefix_in_a_forked_child() -> None:
    ids = {_request_ids.next() for _ in range(10_000)}
    assert len(ids) == 10_000
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report one id and leave at once
        os.write(write, _request_ids.next().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 100).decode()
    os.close(read)
    os.waitpid(pid, 0)
    mine = _request_ids.next()
    assert child[:16] != mine[:16], "a forked child reuses its parent's request-id prefix"
