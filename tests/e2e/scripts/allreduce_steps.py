"""A tiny gloo job for the agent's end-to-end tests.

    allreduce_steps.py OUT_DIR STEPS STEP_SECONDS

Each rank records its torchrun environment once and one line per step
(round, rank, world size, the allreduce of ones). FAIL_MODE=once makes global
rank 0 exit 3 on the first attempt; FAIL_MODE=always makes it raise every time
(inside @record, so the agent reads the traceback from the error file).
FAIL_MODE=hang makes global rank 1 stop forever before step 3 (or $HANG_STEP)
of the first attempt, so that rank 0 waits in its all-reduce: a silent hang. Each step is
reported to the agent's watchdog (dlfleet.worker.progress).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from dlfleet.worker import progress

KEYS = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
    "DLFLEET_MASTER",
    "DLFLEET_ROUND",
    "DLFLEET_NODE_ID",
    "DLFLEET_MAX_NODES",
]


@record
def main() -> None:
    out, steps, pause = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    mode = os.environ.get("FAIL_MODE", "")
    rank = int(os.environ["RANK"])
    hang_step = int(os.environ.get("HANG_STEP", "3"))
    if mode == "once" and rank == 0 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        sys.exit(3)
    if mode == "always" and rank == 0:
        raise RuntimeError("rank 0 always fails")
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    # Under plain torchrun (no dlfleet master) the restart count names the attempt.
    round_id = os.environ.get("DLFLEET_ROUND") or f"t{os.environ['TORCHELASTIC_RESTART_COUNT']}"
    tag = f"r{round_id}-g{rank}"
    (out / f"env-{tag}.json").write_text(json.dumps({k: os.environ.get(k) for k in KEYS}))
    with (out / f"steps-{tag}.jsonl").open("a") as log:
        for step in range(steps):
            if mode == "hang" and rank == 1 and step == hang_step and round_id == "1":
                time.sleep(3600)
            total = torch.ones(1)
            dist.all_reduce(total)
            log.write(json.dumps({"step": step, "world": world, "sum": total.item()}) + "\n")
            log.flush()
            progress.step()
            time.sleep(pause)
    progress.idle()  # the teardown below is not a step
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
