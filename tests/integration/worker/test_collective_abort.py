"""Leaving a round: `CollectiveAbort` against real torch.distributed on gloo,
in this process, and how the agent tells a process that cannot leave (stopped).

An abort must wake a group that is still forming (rank 0 waiting in the
store for a rank that never comes) at once, not at the group's timeout."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from dlfleet.worker.elastic.abort import CollectiveAbort

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_abort_wakes_rank_zero_waiting_for_a_rank_that_never_joins() -> None:
    abort = CollectiveAbort()
    abort.before_init()
    timer = threading.Timer(0.5, abort.abort)
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(Exception):  # noqa: B017 - the store's own error types vary
            store = dist.TCPStore(  # type: ignore[attr-defined]
                "127.0.0.1", free_port(), 2, is_master=True, timeout=timedelta(seconds=30)
            )
            dist.init_process_group(
                "gloo", store=store, rank=0, world_size=2, timeout=timedelta(seconds=30)
            )
    finally:
        timer.cancel()
        abort.disarm()
        if dist.is_initialized():
            dist.destroy_process_group()
    assert abort.aborted.is_set()
    assert time.monotonic() - started < 10, "the abort did not wake the forming group"


def test_an_abort_outside_a_group_touches_nothing() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        try:
            abort = CollectiveAbort()
            abort.before_init()
            abort.disarm()  # no group formed, or it is gone: nothing is ours
            abort.abort()
            peer, _ = server.accept()
            with peer:
                client.sendall(b"x")
                assert peer.recv(1) == b"x"
        finally:
            client.close()


def test_a_stopped_process_is_told_from_a_running_one() -> None:
    import signal
    import subprocess

    from dlfleet.worker.agent.processes import process_stopped

    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert not process_stopped(proc.pid)
        proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not process_stopped(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_stopped(proc.pid)
        proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 5
        while process_stopped(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not process_stopped(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert not process_stopped(proc.pid)  # gone
