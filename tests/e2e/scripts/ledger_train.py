"""A DDP training job that logs, step by step, which records each rank trained:
the subject of the end-to-end exactly-once tests (checked by tests/e2e/ledger.py).

    ledger_train.py --ledger-dir DIR [--epochs 2] [--size 200] [--batch-size 4]
        [--shard-size 0] [--drop-last] [--checkpoint-every 5 | --no-checkpoint]
        [--crash-at-step K --crash-rank R [--crash-point logged|trained]]
        [--sleep-per-step S] [--catalog FILE... [--block-size B]]

Record i of the dataset is (features derived from i, i), so a batch names its
records. With `--catalog`, the records are read from files (a FileCatalog of
JSON lines, Parquet and WebDataset tars, tests/stream_files.py) and i is the
id stored in the record, so the ledger shows what the readers delivered.

Each process appends to its own ledger file,
`DIR/ledger-a<attempt>-r<rank>.jsonl`, one JSON line per step, written with one
write() and fsynced before the step goes on:

    {"attempt": A, "round": R, "restart": C, "rank": r, "world": W,
     "epoch": e, "step": s, "ids": [...], "t": T, "committed": K}

`committed` (with --in-memory) is the newest step the rank's Checkpointer had
been told is committed and replicated (`Checkpointer.committed_step`): no
failure may restore an older one. `t` is the wall-clock time (time.time()) at
which the line was logged; the
next line of the same process minus this one is the step's duration (the
chaos bench, bench/chaos.py, measures stalls and goodput with it).

`round` is DLFLEET_ROUND (0 under plain torchrun), `restart` is
TORCHELASTIC_RESTART_COUNT, and `attempt` orders the attempts of the job: the
round under dlfleet (every worker-group start is a new rendezvous round, with
the same number on every node, whereas restart counts are per node), the
restart count under plain torchrun. `step` is the global step, the same on
every rank (sync mode) and continued from the checkpoint after a restore.

With checkpoints, rank 0 starts every attempt by appending
`{"attempt": A, "round": R, "restart": C, "restored_step": S, "t": T}` to
`DIR/restores.jsonl`, where S is the step of the checkpoint it restored (0 when
there is none: then it writes a checkpoint of the initial state, so that a
failure before the first periodic checkpoint rolls the data back too).

When a step is logged (the moment that makes the checker exact):
a rank logs step s *after* the loader handed it the batch and *before* the
backward pass, i.e. before the gradient all-reduce that makes the step happen.
- A step is trained (on any rank) only if the all-reduce completes, and it
  cannot complete on any rank before every rank has entered it, that is, has
  logged the step. So a step that rank 0 completed, and may have checkpointed,
  is in every rank's ledger: a restore never rolls back to a step that some
  rank did not log.
- A logged step that never completed (a crash between the log line and the
  end of the all-reduce) is not in any checkpoint, so the next restore goes
  back to an earlier step and the checker discards the line.
So a crash anywhere after a step's line (before the all-reduce, after it,
between the optimizer step and the next fetch) cannot produce a duplicate or a
gap: the step counts iff the checkpoint that the next attempt restores holds
it. Logging after the optimizer step instead would lose lines: a rank killed
after the all-reduce but before its log line leaves a step that rank 0 trained
and checkpointed, with no record of that rank's batch.

Without checkpoints (`--no-checkpoint`), nothing is rolled back and a failure
restarts from fresh weights: dlfleet then promises at-least-once, not
exactly-once. The master re-leases whatever it does not know to be trained: a
lease is acked only when all of it was trained (on the next lease request),
and a partly trained lease's progress reaches the master only with a renewal
(every third of its time to live) or a snapshot. So the steps since the last
ack or renewal, including a logged step that never completed, are trained
again by the next round; the checker accepts those as "replayed" when asked to.

Failure injection, once per job (a marker file in DIR says it happened, so the
restarted worker does not do it again):
- `--crash-at-step K --crash-rank R`: global rank R SIGKILLs itself at step K,
  right after logging it (`--crash-point logged`, the default) or after the
  optimizer step and the checkpoint of that step, before asking for the next
  batch (`--crash-point trained`), or after training it and before
  checkpointing it (`--crash-point unsaved`).
- `--sleep-per-step S`: a pause after each step, so a test can kill a node or
  an agent mid-epoch.

`--ballast-mb N` (with `--in-memory`): the checkpoint also holds an N MiB
tensor that is a function of the step (replicated: large enough that the
Checkpointer cuts it among the ranks of a node); a restore checks it equals
that function of the restored step, and fails the rank if not.

The agent's step watchdog (`dlworker --step-timeout`) and the job's goodput
hear each step from ShardedDataLoader itself (`dlfleet.worker.progress.step()`
for every batch it hands out, `idle()` when an epoch's iteration ends).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from dlfleet import ShardedDataLoader
from dlfleet.worker import elastic
from dlfleet.worker.checkpoint import files
from dlfleet.worker.checkpoint.checkpointer import Checkpointer
from dlfleet.worker.loader.files import FileCatalog

FEATURES = 4
CHECKPOINT_FILE = "checkpoint.pt"
RESTORE_LOG = "restores.jsonl"
BALLAST_LOG = "ballast.jsonl"  # --ballast-mb: the rows of it each rank's image holds
CRASH_MARKER = "crashed.marker"


class Records(Dataset[tuple[torch.Tensor, int]]):
    """Record i: a few features computed from i, and i itself."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return features_of(index, self.size)


def features_of(key: int, size: int) -> tuple[torch.Tensor, int]:
    x = float(key) / size
    return torch.tensor([x, math.sin(7 * x), math.cos(5 * x), 1.0]), key


class CatalogRecord:
    """A catalog record (a JSON object, a Parquet row, a WebDataset sample)
    -> (features, id): the id read from the file, so the ledger shows which
    record the reader delivered."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, record: dict[str, Any]) -> tuple[torch.Tensor, int]:
        if "json" in record:  # a WebDataset sample
            record = json.loads(record["json"])
        return features_of(int(record["id"]), self.size)


def catalog(args: argparse.Namespace) -> FileCatalog:
    files = FileCatalog(
        args.catalog, block_size=args.block_size, transform=CatalogRecord(args.size)
    )
    if len(files) != args.size:
        raise SystemExit(f"the catalog holds {len(files)} records, --size says {args.size}")
    return files


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="exactly-once ledger training job")
    parser.add_argument("--ledger-dir", type=Path, required=True)
    parser.add_argument("--checkpoint-dir", type=Path, help="default: LEDGER_DIR/checkpoints")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--size", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=4, help="per rank")
    parser.add_argument("--shard-size", type=int, default=0, help="0: the master's default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drop-last", action="store_true")
    parser.add_argument("--checkpoint-every", type=int, default=5, help="steps")
    parser.add_argument("--no-checkpoint", action="store_true")
    parser.add_argument(
        "--in-memory",
        action="store_true",
        help="restart in place (dlfleet.elastic.run) and checkpoint every step in memory "
        "(dlfleet.Checkpointer), every rank",
    )
    parser.add_argument(
        "--persist-every", type=int, default=0, help="--in-memory: persist every N steps"
    )
    parser.add_argument("--crash-at-step", type=int, default=-1)
    parser.add_argument("--crash-rank", type=int, default=0)
    parser.add_argument("--crash-point", choices=("logged", "trained", "unsaved"), default="logged")
    parser.add_argument("--sleep-per-step", type=float, default=0.0)
    parser.add_argument("--ballast-mb", type=int, default=0, help="--in-memory: see above")
    parser.add_argument("--knee", type=int, default=0, help="world size past which steps slow")
    parser.add_argument("--dataset-name", default="ledger-records")
    parser.add_argument(
        "--catalog",
        nargs="+",
        help="train a FileCatalog of these files (JSON lines, Parquet, WebDataset tars) whose "
        "records carry an id instead of the indexed records; it must hold --size records",
    )
    parser.add_argument("--block-size", type=int, default=8, help="--catalog: records a block")
    args = parser.parse_args()
    if args.checkpoint_dir is None:
        args.checkpoint_dir = args.ledger_dir / "checkpoints"
    return args


def append_line(path: Path, record: dict[str, Any]) -> None:
    """One line, in one write(), on disk before this returns."""
    data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def save_atomically(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_agreed_checkpoint(path: Path) -> dict[str, Any] | None:
    """Rank 0 says whether (and at which step) to resume; every rank then
    reads that checkpoint. Nothing can overwrite it before every rank has read
    it: the next checkpoint needs a step, and a step needs every rank."""
    step = torch.tensor([-1])
    if dist.get_rank() == 0 and path.exists():
        step[0] = torch.load(path, weights_only=True)["step"]
    dist.broadcast(step, src=0)
    if step.item() < 0:
        return None
    state: dict[str, Any] = torch.load(path, weights_only=True)
    if state["step"] != step.item():
        raise RuntimeError(f"{path} holds step {state['step']}, rank 0 read {step.item()}")
    return state


def crash_once(ledger_dir: Path, step: int) -> None:
    marker = ledger_dir / CRASH_MARKER
    if marker.exists():
        return
    append_line(marker, {"step": step, "rank": dist.get_rank(), "pid": os.getpid()})
    print(f"ledger_train: rank {dist.get_rank()} crashing at step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class LedgerTrainer:
    """One rank: its model, its ledger and its checkpoints."""

    def __init__(
        self,
        args: argparse.Namespace,
        model: nn.Module | None = None,
        checkpointer: Checkpointer | None = None,
    ) -> None:
        self.args = args
        self.checkpointer = checkpointer
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.round = int(os.environ.get("DLFLEET_ROUND") or 0)
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
        self.attempt = self.round if self.round > 0 else self.restart
        self.ledger = args.ledger_dir / f"ledger-a{self.attempt}-r{self.rank}.jsonl"
        self.checkpoint_path = args.checkpoint_dir / CHECKPOINT_FILE
        torch.manual_seed(args.seed)
        self.model = DistributedDataParallel(model or nn.Linear(FEATURES, 1))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.loader = ShardedDataLoader(
            catalog(args) if args.catalog else Records(args.size),
            args.batch_size,
            shuffle=True,
            seed=args.seed,
            epochs=args.epochs,
            shard_size=args.shard_size,
            drop_last=args.drop_last,
            name=args.dataset_name,
        )
        self.step = 0
        self.steps_this_attempt = 0

    def ballast(self) -> torch.Tensor:
        """`--ballast-mb` MiB of float32, a function of the step."""
        rows = 256
        columns = self.args.ballast_mb * (1 << 20) // (4 * rows)
        return torch.arange(rows * columns, dtype=torch.float32).reshape(rows, columns) + self.step

    def identity(self) -> dict[str, int]:
        return {"attempt": self.attempt, "round": self.round, "restart": self.restart}

    def resume(self) -> None:
        if self.args.no_checkpoint:
            return
        if self.checkpointer is not None:
            restored = self.checkpointer.load()
            state = restored.state if restored is not None else None
        else:
            state = load_agreed_checkpoint(self.checkpoint_path)
        if state is not None:
            self.model.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.loader.load_state_dict(state["loader"])  # before the first iteration
            self.step = int(state["step"])
            if self.args.ballast_mb and not torch.equal(state["ballast"], self.ballast()):
                raise RuntimeError(f"the ballast restored with step {self.step} is not its own")
        if self.rank == 0:
            restore = {**self.identity(), "restored_step": self.step, "t": time.time()}
            append_line(self.args.ledger_dir / RESTORE_LOG, restore)
        if state is None:
            self.checkpoint()  # the initial state: see the module docstring

    def checkpoint(self) -> None:
        if self.checkpointer is not None:  # every rank, every step: in memory
            self.checkpointer.save(
                self.step,
                {
                    "model": self.model.module.state_dict(),
                    "optimizer": self.optimizer.state_dict(),
                    "loader": self.loader.state_dict(),
                    "step": self.step,
                    "epoch": self.loader.epoch,
                    **({"ballast": self.ballast()} if self.args.ballast_mb else {}),
                },
            )
            image = self.checkpointer.last_image
            if self.args.ballast_mb and image is not None and self.steps_this_attempt == 0:
                header = files.read_header(image.header_path)
                (held,) = [i.chunk_sizes[0] for i in header.items if i.fqn == "ballast"]
                append_line(self.args.ledger_dir / BALLAST_LOG, {"rank": self.rank, "rows": held})
            return
        if self.rank == 0 and not self.args.no_checkpoint:
            state = {
                "model": self.model.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "loader": self.loader.state_dict(),
                "step": self.step,
                "epoch": self.loader.epoch,
            }
            save_atomically(self.checkpoint_path, state)

    def train_epoch(self) -> int:
        args = self.args
        batches = 0
        for batch in self.loader:
            features, ids = batch if batch else (torch.empty(0, FEATURES), torch.empty(0))
            self.step += 1
            self.steps_this_attempt += 1
            batches += 1
            line = {
                **self.identity(),
                "rank": self.rank,
                "world": self.world,
                "epoch": self.loader.epoch,
                "step": self.step,
                "ids": [int(i) for i in ids],
                "t": time.time(),
            }
            if self.checkpointer is not None:
                # What the agent has told this rank is committed (and
                # replicated) so far: no failure may roll back before it.
                line["committed"] = self.checkpointer.committed_step
            append_line(self.ledger, line)  # before the step's all-reduce: see above
            crash_here = self.step == args.crash_at_step and self.rank == args.crash_rank
            if crash_here and args.crash_point == "logged":
                crash_once(args.ledger_dir, self.step)
            error = (self.model(features) - features.sum(dim=1, keepdim=True)) ** 2
            loss = error.sum() / max(len(ids), 1)  # an empty batch gives a zero gradient
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()  # the all-reduce: the step happens on all ranks or none
            self.optimizer.step()
            if crash_here and args.crash_point == "unsaved":
                crash_once(args.ledger_dir, self.step)  # trained, not checkpointed
            if self.checkpointer is not None or self.step % args.checkpoint_every == 0:
                self.checkpoint()
            if crash_here and args.crash_point == "trained":
                crash_once(args.ledger_dir, self.step)
            if args.sleep_per_step:
                # --knee K: a shared bottleneck (a parameter server, a storage
                # link): past K ranks a step takes longer in proportion, so
                # the job's throughput stops growing at K.
                slowdown = max(1.0, self.world / args.knee) if args.knee else 1.0
                time.sleep(args.sleep_per_step * slowdown)
        return batches


def train(trainer: LedgerTrainer) -> None:
    trainer.resume()
    while trainer.train_epoch():
        pass
    if trainer.rank == 0:
        print(
            f"ledger_train: done, {trainer.step} steps in total, {trainer.steps_this_attempt} "
            f"in attempt {trainer.attempt} (world {trainer.world})",
            flush=True,
        )
    trainer.loader.close()


def main_in_memory(args: argparse.Namespace) -> None:
    """The model lives as long as the process; each attempt (round) wraps it
    anew and restores it from the newest step every rank saved in memory."""
    torch.manual_seed(args.seed)
    model = nn.Linear(FEATURES, 1)
    persist_dir = args.checkpoint_dir / "persisted"
    with Checkpointer(persist_every=args.persist_every, persist_dir=persist_dir) as checkpointer:
        elastic.run(
            lambda attempt: train(LedgerTrainer(args, model, checkpointer)),
            backend="gloo",
            timeout=timedelta(seconds=60),
        )


@record
def main() -> None:
    args = parse_args()
    args.ledger_dir.mkdir(parents=True, exist_ok=True)
    if args.in_memory:
        main_in_memory(args)
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    train(LedgerTrainer(args))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
