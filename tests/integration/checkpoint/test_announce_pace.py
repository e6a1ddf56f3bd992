"""A rank that saves every few milliseconds tells its agent of its newest
image at most once every ANNOUNCE_INTERVAL_S (each announcement costs the
agent a report and the master a commit, whatever the save rate), and the
last image is told when the Checkpointer closes, without waiting out the
interval. A real keeper server (the agent's gRPC service) on a Unix socket
records what it is told."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dlfleet import Checkpointer
from dlfleet.api.env import AGENT_ENV, CHECKPOINT_DIR_ENV, TOKEN_ENV
from dlfleet.api.v1 import checkpoint_pb2
from dlfleet.worker.agent.keeper_server import AgentServer, KeeperService
from dlfleet.worker.checkpoint import checkpointer as module
from dlfleet.worker.checkpoint.checkpointer import ANNOUNCE_INTERVAL_S

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


class Told:
    """The agent's side of `Saved`: every notice, when it came; each answered
    committed at once (the rank then never waits for room)."""

    def __init__(self) -> None:
        self.notices: list[tuple[float, int]] = []
        self._lock = threading.Lock()

    def saved(self, notice: checkpoint_pb2.SavedNotice) -> checkpoint_pb2.SavedAck:
        with self._lock:
            self.notices.append((time.monotonic(), notice.step))
        return checkpoint_pb2.SavedAck(committed_step=notice.step)

    def receive(self, pieces: Iterator[checkpoint_pb2.ImagePiece]) -> checkpoint_pb2.ReplicateAck:
        raise AssertionError("no replicas here")

    def send(self, request: checkpoint_pb2.FetchRequest) -> Iterator[checkpoint_pb2.ImagePiece]:
        raise AssertionError("no fetches here")


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Told]:
    told = Told()
    server = AgentServer(
        KeeperService(None, told),
        token="t",
        local_address=f"unix:{tmp_path / 'agent.sock'}",
        host="127.0.0.1",
        threads=2,
    )
    server.start()
    monkeypatch.setenv(AGENT_ENV, server.local_address)
    monkeypatch.setenv(TOKEN_ENV, "t")
    monkeypatch.setenv(CHECKPOINT_DIR_ENV, str(tmp_path / "images"))
    (tmp_path / "images").mkdir()
    yield told
    server.stop()


def save(checkpointer: Checkpointer, step: int) -> None:
    checkpointer.save(step, {"w": torch.full((64,), float(step)), "step": step})


def test_saves_every_few_milliseconds_are_told_once_an_interval(agent: Told) -> None:
    began = time.monotonic()
    with Checkpointer(every=1, persist_every=0) as checkpointer:
        step = 0
        while time.monotonic() - began < 5 * ANNOUNCE_INTERVAL_S:
            step += 1
            save(checkpointer, step)
            time.sleep(0.002)
    span = time.monotonic() - began
    times = [at for at, _ in agent.notices]
    steps = [s for _, s in agent.notices]
    assert step > 20, "the saves came every few milliseconds"
    # One an interval at most (the last one, at close, may come sooner); as
    # they arrive here, a busy machine's scheduling moves each by a little.
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(gap >= ANNOUNCE_INTERVAL_S * 0.5 for gap in gaps[:-1]), gaps
    assert 3 <= len(steps) <= span / ANNOUNCE_INTERVAL_S + 2, steps
    assert steps == sorted(steps) and steps[-1] == step


def test_the_newest_image_is_told_at_close_without_waiting_out_the_interval(
    agent: Told, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(module, "ANNOUNCE_INTERVAL_S", 30.0)
    checkpointer = Checkpointer(every=1, persist_every=0)
    save(checkpointer, 1)
    deadline = time.monotonic() + 10
    while not agent.notices and time.monotonic() < deadline:  # the first, at once
        time.sleep(0.01)
    for step in range(2, 6):
        save(checkpointer, step)
    closing = time.monotonic()
    checkpointer.close()
    assert time.monotonic() - closing < 5.0
    # The first at once; the others wait for the interval, cut short by close:
    # the newest of them is told, the older ones are history.
    assert [s for _, s in agent.notices] == [1, 5]
