"""The training script of the recovery benchmark (bench/recovery.py).

A tiny DDP job over gloo, the same file under `dlworker` and under `torchrun`:
a Linear(32, 32) model, `--steps` optimizer steps per attempt, each padded to
`--step-ms` of wall time. It starts from step 0 in every attempt (no
checkpoint: the bench measures how fast training resumes, not what it resumes).

What it writes, for the bench to read:

* at start, before torch is imported: `<pids-dir>/<pid>.json` with its pid,
  ranks, attempt and start time (the bench picks its victim from these files);
* to `--step-log` (opened O_APPEND, one `write()` per line, so the lines of all the
  ranks never interleave): `<wall time> <attempt> <rank> <step> <pid>` once the
  process group is up (step -1) and after every completed optimizer step.

`<attempt>` is the dlfleet round (`DLFLEET_ROUND`) under dlworker and
`TORCHELASTIC_RESTART_COUNT` under torchrun; it is informative only: a
torchrun node whose workers were healthy restarts them without bumping its
restart count, so the bench tells attempts apart by pid.
"""

from __future__ import annotations

import argparse
import json
import os
import time

_STARTED = time.time()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--step-log", required=True, help="the per-trial step log (appended to)")
    parser.add_argument("--pids-dir", required=True, help="folder for the <pid>.json files")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per attempt")
    parser.add_argument("--step-ms", type=float, default=50.0, help="wall time of one step")
    parser.add_argument(
        "--pg-timeout", type=float, default=30.0, help="gloo collective timeout, seconds"
    )
    args = parser.parse_args()

    pid = os.getpid()
    rank = int(os.environ["RANK"])
    attempt = os.environ.get("DLFLEET_ROUND") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    info = {
        "pid": pid,
        "rank": rank,
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "world_size": int(os.environ["WORLD_SIZE"]),
        "attempt": attempt,
        "started": _STARTED,
    }
    tmp = os.path.join(args.pids_dir, f".{pid}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(info, f)
    os.replace(tmp, os.path.join(args.pids_dir, f"{pid}.json"))

    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    log = os.open(args.step_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def record(step: int) -> None:
        os.write(log, f"{time.time():.6f} {attempt} {rank} {step} {pid}\n".encode())

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    record(-1)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(32, 32))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    step_s = args.step_ms / 1000.0
    for step in range(args.steps):
        begun = time.monotonic()
        batch = torch.randn(16, 32, generator=generator)
        loss = model(batch).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        record(step)
        left = step_s - (time.monotonic() - begun)
        if left > 0:
            time.sleep(left)
    dist.barrier()
    dist.destroy_process_group()
    os.close(log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
