"""The ledger lines of the framework scripts (hf_ledger_train.py,
lightning_ledger_train.py), in ledger_train.py's format: one JSON line per
step and rank, written with one write() and fsynced, and one line per
attempt in restores.jsonl (see ledger_train.py for why a step is logged
before its backward, and tests/e2e/ledger.py for the check).

`attempt` orders the attempts of a job: the round under dlfleet; under
torchrun, which restarts a node's workers without counting a restart when
the membership changed, rank 0's start time in ms (`stamp_attempt`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch


def append_line(path: Path, entry: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


class Ledger:
    """What every rank logs. `cli` has ledger_dir, crash_at_step, crash_rank
    and sleep_per_step."""

    def __init__(self, cli: argparse.Namespace, name: str) -> None:
        self.cli = cli
        self.name = name
        self.refresh()

    def refresh(self) -> None:
        """The attempt this process is in now: a process that restarts in
        place (dlfleet.elastic.run) trains in several rounds, each setting
        the environment anew."""
        self.round = int(os.environ.get("DLFLEET_ROUND") or 0)
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
        self.attempt = self.round if self.round > 0 else self.restart

    def stamp_attempt(self) -> None:
        """Under torchrun: rank 0's start time, the same on every rank (a
        collective: every rank calls it as training starts)."""
        import torch.distributed as dist

        stamp = torch.tensor([time.time_ns() // 1_000_000], dtype=torch.int64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(stamp, src=0)
        self.attempt = int(stamp.item())

    def identity(self) -> dict[str, int]:
        return {"attempt": self.attempt, "round": self.round, "restart": self.restart}

    def restored(self, step: int) -> None:
        """Rank 0, once an attempt restored `step` (0: nothing)."""
        append_line(
            self.cli.ledger_dir / "restores.jsonl",
            {**self.identity(), "restored_step": step, "t": time.time()},
        )

    def crash_due(self, step: int, rank: int) -> None:
        """`--crash-at-step`: SIGKILL rank `--crash-rank` about to train that
        step, in the job's first worker group only."""
        first = self.restart == 0 and self.round <= 1
        if step == self.cli.crash_at_step and rank == self.cli.crash_rank and first:
            print(f"{self.name}: rank {rank} crashing at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def step(self, step: int, rank: int, world: int, epoch: int, ids: Iterable[Any]) -> None:
        append_line(
            self.cli.ledger_dir / f"ledger-a{self.attempt}-r{rank}.jsonl",
            {
                **self.identity(),
                "rank": rank,
                "world": world,
                "epoch": epoch,
                "step": step,
                "ids": [int(i) for i in ids],
                "t": time.time(),
            },
        )
        if self.cli.sleep_per_step:
            time.sleep(self.cli.sleep_per_step)
