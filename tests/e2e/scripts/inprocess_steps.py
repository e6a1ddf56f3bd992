"""A tiny DDP job that restarts in place (`dlfleet.elastic.run`), for the
agent's end-to-end tests.

    inprocess_steps.py OUT_DIR STEPS STEP_SECONDS [HANG_RANK HANG_STEP]

The model is built once per process, outside the training function. Every
attempt appends one JSON line per step to `OUT_DIR/steps-r<round>-g<rank>.jsonl`
(round, rank, world size, pid, the attempt's index in its process, the sum of
an all-reduce of ones) and runs STEPS steps from 0. With HANG_RANK and
HANG_STEP, that rank hangs (sleeps, in Python, without stepping) at that step
of round 1. With $INPROCESS_STEPS_SPARE_DELAY_S, a spare process sleeps that
long before it attaches (a slow start-up).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dlfleet import elastic
from dlfleet.worker import progress

SPARE_DELAY_ENV = "INPROCESS_STEPS_SPARE_DELAY_S"  # the tests' knob, see main()


def main() -> None:
    out, steps, pause = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    hang_rank, hang_step = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (-1, -1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    started = time.time()
    if os.environ.get("DLFLEET_SPARE") == "1":
        # A spare that starts slowly (a large import, a model to build).
        time.sleep(float(os.environ.get(SPARE_DELAY_ENV, "0")))

    def train(attempt: elastic.Attempt) -> None:
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        path = out / f"steps-r{attempt.round}-g{attempt.rank}.jsonl"
        for step in range(steps):
            if (attempt.round, attempt.rank, step) == (1, hang_rank, hang_step):
                time.sleep(3600)  # hung where no abort reaches: not in a collective
            loss = ddp(torch.ones(2, 4)).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ones = torch.ones(1)
            dist.all_reduce(ones)
            line = {
                "round": attempt.round,
                "rank": attempt.rank,
                "world": attempt.world_size,
                "pid": os.getpid(),
                "started": started,
                "index": attempt.index,
                "step": step,
                "sum": ones.item(),
                "time": time.time(),
            }
            with path.open("a") as f:
                f.write(json.dumps(line) + "\n")
            progress.step()
            elastic.check()
            time.sleep(pause)

    elastic.run(train)


if __name__ == "__main__":
    main()
