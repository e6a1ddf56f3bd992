"""A worker group without processes, for the node agent's `worker_group`
seam (`dlfleet.worker.agent.loop.Agent`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from dlfleet.worker.agent.config import AgentConfig
from dlfleet.worker.agent.workers import GroupState, GroupStatus, WorkerFailure, WorkerGroup


class FakeWorkerGroup(WorkerGroup):
    """Stands in for `WorkerGroup` (a round's worker processes): it starts
        none; its ranks and spares are made-up pids, its status is what the test
        sets (`status`), and `started_spares` counts the spares asked for (primed
    ones too)."""

    def __init__(self) -> None:
        # No super().__init__: that reads the node's OOM-kill count.
        self.status = GroupStatus.RUNNING
        self._pids: tuple[int, ...] = ()
        self._spare_pids: list[int] = []
        self._primed: list[int] = []  # of _spare_pids: primed, not yet told to run
        self._next_pid = 10_000
        self.started_spares = 0
        self.stopped = False

    @property
    def pids(self) -> tuple[int, ...]:
        return self._pids

    @property
    def spare_pids(self) -> tuple[int, ...]:
        return tuple(self._spare_pids)

    def start(
        self,
        config: AgentConfig,
        envs: Sequence[Mapping[str, str]],
        log_dir: Path,
        round_id: int,
    ) -> None:
        self._pids = tuple(self._new_pid() for _ in envs)

    def start_spare(
        self, config: AgentConfig, env: Mapping[str, str], log_dir: Path, primed: bool = False
    ) -> int:
        self.started_spares += 1
        pid = self._new_pid()
        self._spare_pids.append(pid)
        if primed:
            self._primed.append(pid)
        return pid

    @property
    def primed_pids(self) -> tuple[int, ...]:
        return tuple(self._primed)

    def release_primed(self) -> list[int]:
        released, self._primed = self._primed, []
        return released

    def drop_primed(self) -> list[int]:
        dropped, self._primed = self._primed, []
        self._spare_pids = [pid for pid in self._spare_pids if pid not in dropped]
        return dropped

    def reap_spares(self) -> list[WorkerFailure]:
        return []

    def poll(self, *, wait_alike: bool = True) -> GroupState:
        return self._state()

    def stop(self, timeout_s: float) -> GroupState:
        self.stopped = True
        return self._state()

    def _state(self) -> GroupState:
        code = {GroupStatus.RUNNING: None, GroupStatus.SUCCEEDED: 0}.get(self.status, 1)
        return GroupState(self.status, tuple(code for _ in self._pids))

    def _new_pid(self) -> int:
        self._next_pid += 1
        return self._next_pid
