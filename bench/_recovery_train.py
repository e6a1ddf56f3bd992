"""The training script of the recovery benchmark (bench/recovery.py).

A small DDP job over gloo, the same file under `dlworker`, under `torchrun`
and started bare (the cold-start reference): an MLP of `--width` (default
512: ~0.5 M parameters, ~6 MB of model and optimizer state), trained through
`dlfleet.elastic.run`, checkpointed with `dlfleet.Checkpointer` after every
step (in memory; persisted to `--ckpt-dir` every `--persist-every` saves),
each step padded to `--step-ms` of wall time. `--steps` is the step to reach;
an attempt starts from the step after the one it restored.

Under dlworker an attempt restores from memory and a failure restarts the
healthy ranks in place; under torchrun and bare, `elastic.run` initialises
the process group from the environment once, and `load()` finds only what was
persisted to disk. The cold-start reference is this script started bare on a
folder holding a persisted step: process start, imports, process group, model
build, the read from disk, the first step.

What it writes, for the bench to read:

* at start, before torch is imported, and again whenever an attempt begins:
  `<pids-dir>/<pid>.json` with its pid, ranks (-1 for a spare not yet given
  one), round and start time (the bench picks its victim from these files);
* to `--step-log` (opened O_APPEND, one `write()` per line, so the lines of all
  the ranks never interleave): `<wall time> <round> <rank> <step> <pid>` once
  the process group is up (step -1) and after every completed optimizer step;
* to `--restore-log`: `<wall time> <round> <rank> <restored step or -1>
  <memory|peer|disk|none> <seconds the restore took> <pid>` per attempt.

`<round>` is the dlfleet round under dlworker and TORCHELASTIC_RESTART_COUNT
under torchrun (informative only: the bench tells torchrun's attempts apart by
pid).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from dlfleet.api.env import ROUND_ENV, SPARE_ENV

_STARTED = time.time()


def write_pid_file(folder: str, info: dict[str, Any]) -> None:
    tmp = os.path.join(folder, f".{info['pid']}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(info, f)
    os.replace(tmp, os.path.join(folder, f"{info['pid']}.json"))


def init_optimizer_state(model: Any, optimizer: Any) -> None:
    """Before the first step, AdamW has no state for a restore to fill: one
    step with zero gradients and a zero learning rate makes it, and changes
    no weight."""
    if optimizer.state:
        return
    import torch

    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--step-log", required=True, help="the per-trial step log (appended to)")
    parser.add_argument("--restore-log", required=True, help="one line per attempt's restore")
    parser.add_argument("--pids-dir", required=True, help="folder for the <pid>.json files")
    parser.add_argument("--ckpt-dir", required=True, help="where checkpoints are persisted")
    parser.add_argument("--steps", type=int, default=100, help="train until this step")
    parser.add_argument("--step-ms", type=float, default=50.0, help="wall time of one step")
    parser.add_argument("--width", type=int, default=512, help="hidden width of the MLP")
    parser.add_argument("--persist-every", type=int, default=20, help="saves between persists")
    parser.add_argument(
        "--pg-timeout", type=float, default=30.0, help="gloo collective timeout, seconds"
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    pid = os.getpid()
    spare = os.environ.get(SPARE_ENV) == "1"
    write_pid_file(
        args.pids_dir,
        {
            "pid": pid,
            "rank": -1 if spare else int(os.environ.get("RANK", "0")),
            "local_rank": -1 if spare else int(os.environ.get("LOCAL_RANK", "0")),
            "round": os.environ.get(ROUND_ENV, ""),
            "started": _STARTED,
        },
    )

    from datetime import timedelta

    import torch
    from torch.nn.parallel import DistributedDataParallel

    from dlfleet import Checkpointer, elastic

    torch.set_num_threads(1)
    log = os.open(args.step_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    restores = os.open(args.restore_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, args.width),
        torch.nn.ReLU(),
        torch.nn.Linear(args.width, args.width),
        torch.nn.ReLU(),
        torch.nn.Linear(args.width, 32),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    checkpointer = Checkpointer(persist_every=args.persist_every, persist_dir=args.ckpt_dir)
    step_s = args.step_ms / 1000.0

    def train(attempt: elastic.Attempt) -> None:
        attempt_id = os.environ.get(ROUND_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        write_pid_file(
            args.pids_dir,
            {
                "pid": pid,
                "rank": attempt.rank,
                "local_rank": attempt.local_rank,
                "round": attempt_id,
                "started": _STARTED,
            },
        )

        def record(step: int) -> None:
            os.write(log, f"{time.time():.6f} {attempt_id} {attempt.rank} {step} {pid}\n".encode())

        record(-1)
        begun = time.monotonic()
        init_optimizer_state(model, optimizer)
        restored = checkpointer.load({"model": model.state_dict(), "optim": optimizer.state_dict()})
        took = time.monotonic() - begun
        line = (
            f"{time.time():.6f} {attempt_id} {attempt.rank} "
            f"{restored.step if restored else -1} {restored.source if restored else 'none'} "
            f"{took:.4f} {pid}\n"
        )
        os.write(restores, line.encode())
        if restored is not None:
            optimizer.load_state_dict(restored.state["optim"])
        first = restored.step + 1 if restored else 0
        ddp = DistributedDataParallel(model)
        generator = torch.Generator().manual_seed(attempt.rank)
        for step in range(first, args.steps):
            started = time.monotonic()
            batch = torch.randn(16, 32, generator=generator)
            loss = ddp(batch).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            checkpointer.save(step, {"model": model.state_dict(), "optim": optimizer.state_dict()})
            record(step)
            left = step_s - (time.monotonic() - started)
            if left > 0:
                time.sleep(left)

    elastic.run(train, backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    checkpointer.close()
    os.close(log)
    os.close(restores)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
