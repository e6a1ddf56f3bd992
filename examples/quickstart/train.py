"""dlfleet quickstart: an elastic, fault-tolerant DDP job on synthetic data.

Run it as a whole job (the master starts the nodes):

    dlmaster --job-config examples/quickstart/job.yaml

or by hand, one `dlworker` per node, or under plain torchrun (no master: the
loader falls back to rank-based sharding, with a warning):

    dlworker --master HOST:PORT --nnodes 1:2 --nproc-per-node 1 train.py --epochs 2
    torchrun --nproc-per-node 2 train.py --epochs 2

What a dlfleet training script does differently from a plain DDP script:

1. It reads its data through `ShardedDataLoader` instead of a DataLoader with a
   DistributedSampler. The master leases the dataset's shards to the whole
   round (sync mode), every rank takes its slice of each global batch, so all
   ranks run the same number of steps even when the world changes mid-epoch.
2. Its checkpoint holds `loader.state_dict()` next to the model and the
   optimizer, and a restart calls `loader.load_state_dict()` before the first
   iteration. Together they roll the model *and* the data back to the same
   step, so that every record of every epoch is trained exactly once by the
   model that survives (records trained after the checkpoint are trained again,
   but their earlier effect was rolled back with the model).

When a node dies or joins, the agents stop every worker and start them again in
a new round (with new ranks and world size): this script then simply starts
from its latest checkpoint. Nothing else is needed for elasticity.
"""

from __future__ import annotations

import argparse
import os
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

CHECKPOINT_FILE = "checkpoint.pt"
FEATURES, CLASSES = 16, 4


class SyntheticClassification(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """`size` points in `features` dimensions, labelled by a fixed random
    "teacher" network: a deterministic function of `seed`, so every rank (and
    every restart) sees the same dataset without any file."""

    def __init__(
        self, size: int, features: int = FEATURES, classes: int = CLASSES, seed: int = 0
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(size, features, generator=generator)
        teacher = torch.randn(features, classes, generator=generator)
        self.labels = torch.tanh(self.inputs @ teacher).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.labels[index]


def make_model(features: int = FEATURES, classes: int = CLASSES, hidden: int = 64) -> nn.Module:
    return nn.Sequential(
        nn.Linear(features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, classes),
    )


def empty_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """What a rank trains when the loader gives it no records (an empty list):
    possible only in the last step of an epoch resumed with fewer records left
    than ranks. The rank must still take part in the step's all-reduce."""
    return torch.empty(0, FEATURES), torch.empty(0, dtype=torch.long)


def batch_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; 0 (with a zero gradient) for an empty batch, where
    the plain mean would be NaN and poison every rank's weights."""
    total = nn.functional.cross_entropy(logits, labels, reduction="sum")
    return total / max(len(labels), 1)


@torch.no_grad()
def evaluate(model: nn.Module, dataset: SyntheticClassification) -> tuple[float, float]:
    """Loss and accuracy on the whole training set (it is small)."""
    logits = model(dataset.inputs)
    loss = nn.functional.cross_entropy(logits, dataset.labels).item()
    accuracy = (logits.argmax(dim=1) == dataset.labels).float().mean().item()
    return loss, accuracy


def parse_args() -> argparse.Namespace:
    default_dir = Path(os.environ.get("DLFLEET_WORKDIR", ".")) / "checkpoints"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--size", type=int, default=4096, help="records in the dataset")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=default_dir,
        help="where checkpoints go (default: $DLFLEET_WORKDIR/checkpoints, else ./checkpoints)",
    )
    parser.add_argument("--checkpoint-every", type=int, default=20, help="steps")
    parser.add_argument("--log-every", type=int, default=10, help="steps")
    return parser.parse_args()


# ------------------------------------------------------------- checkpoints


def save_checkpoint(directory: Path, state: dict[str, Any]) -> None:
    """Write `state` so that a reader sees the old checkpoint or the new one,
    never half of one: a temporary file, flushed to disk, then renamed over
    the old one (a rename within a directory is atomic on POSIX)."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / CHECKPOINT_FILE
    tmp = directory / f".{CHECKPOINT_FILE}.tmp"
    with tmp.open("wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def agree_on_checkpoint(directory: Path) -> dict[str, Any] | None:
    """The checkpoint every rank resumes from, as rank 0 sees it (None: start
    from scratch).

    Rank 0 decides and broadcasts, so that all ranks restore the same state
    even if the directory changes while they start (rank 0 writes the initial
    checkpoint right after this) or a node does not see the file. Nothing is
    written before every rank has loaded: a new checkpoint needs a training
    step, and a step needs every rank.
    """
    path = directory / CHECKPOINT_FILE
    step = torch.tensor([-1])
    if dist.get_rank() == 0 and path.exists():
        step[0] = torch.load(path, weights_only=True)["step"]
    dist.broadcast(step, src=0)  # a tensor: object collectives need numpy
    if step.item() < 0:
        return None
    # weights_only=True: a checkpoint holds tensors, numbers, strings and
    # bytes only, so loading one never runs arbitrary pickled code.
    state: dict[str, Any] = torch.load(path, weights_only=True)
    if state["step"] != step.item():
        raise RuntimeError(f"{path} holds step {state['step']}, rank 0 read step {step.item()}")
    return state


# ------------------------------------------------------------------ train


class Trainer:
    """One rank's training: the step counter, and the checkpoints that tie the
    model, the optimizer and the data's progress to one step."""

    def __init__(
        self,
        model: DistributedDataParallel,
        optimizer: torch.optim.Optimizer,
        loader: ShardedDataLoader,
        args: argparse.Namespace,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loader = loader
        self.args = args
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.step = 0  # optimizer steps since the job began, across restarts
        self.saved_step = -1

    def resume(self) -> None:
        """Continue from the latest checkpoint, or checkpoint the start."""
        state = agree_on_checkpoint(self.args.checkpoint_dir)
        if state is None:
            # A checkpoint of the starting point: if this attempt fails before
            # its first periodic checkpoint, the next one rolls the data back
            # to the start too, instead of resuming the data with new weights.
            self.checkpoint()
            return
        self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        # Before the first iteration: this rolls the master's progress on the
        # dataset back to the checkpoint's step, so the records trained after
        # it (by a model that is now discarded) are trained again.
        self.loader.load_state_dict(state["loader"])
        self.step = self.saved_step = int(state["step"])
        if self.rank == 0:
            print(f"resumed at step {self.step}, world size {self.world}", flush=True)

    def checkpoint(self) -> None:
        """Save between steps: loader.state_dict() counts the batches that the
        model has been trained on, and no others. Every rank holds the same
        weights (DDP), so rank 0 writes alone."""
        if self.saved_step == self.step:
            return
        if self.rank == 0:
            state = {
                "model": self.model.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "loader": self.loader.state_dict(),
                "step": self.step,
            }
            save_checkpoint(self.args.checkpoint_dir, state)
        self.saved_step = self.step

    def train_epoch(self) -> int:
        """Train (the rest of) the loader's current epoch; the batches trained,
        0 once every epoch is done."""
        batches = 0
        window_start, window_samples = time.monotonic(), 0
        for batch in self.loader:
            inputs, labels = batch if batch else empty_batch()
            loss = batch_loss(self.model(inputs), labels)
            self.optimizer.zero_grad(set_to_none=True)
            # DDP all-reduces the gradients here. (torch leaves backward() unannotated.)
            loss.backward()  # type: ignore[no-untyped-call]
            self.optimizer.step()
            self.step += 1
            batches += 1
            window_samples += len(labels) * self.world
            if self.step % self.args.checkpoint_every == 0:
                self.checkpoint()
            if self.rank == 0 and self.step % self.args.log_every == 0:
                rate = window_samples / max(time.monotonic() - window_start, 1e-9)
                print(
                    f"epoch {self.loader.epoch} step {self.step} loss {loss.item():.4f} "
                    f"{rate:,.0f} samples/s (world {self.world})",
                    flush=True,
                )
                window_start, window_samples = time.monotonic(), 0
        return batches


@record  # a failure's traceback reaches the agent (and the job's status)
def main() -> None:
    args = parse_args()
    # env:// rendezvous: dlworker (or torchrun) sets RANK, WORLD_SIZE,
    # MASTER_ADDR and MASTER_PORT. The timeout bounds a hang if a peer vanishes
    # without the agents noticing; normally the agent stops us long before.
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    dataset = SyntheticClassification(args.size, seed=args.seed)
    # The loader's spec (size, epochs, shuffle, seed) is registered with the
    # master by the first rank that uses it; `name` identifies the dataset
    # within the job, so a restarted worker resumes the same one.
    loader = ShardedDataLoader(
        dataset,
        args.batch_size,
        shuffle=True,
        seed=args.seed,
        epochs=args.epochs,
        name="quickstart-synthetic",
    )
    trainer = Trainer(model, optimizer, loader, args)
    trainer.resume()
    # One iteration of the loader is (the rest of) one epoch; after the last
    # epoch an iteration yields nothing.
    while trainer.train_epoch():
        trainer.checkpoint()  # the epoch is complete: its data acked, the model saved

    # The model is replicated: each rank can evaluate it alone (through
    # model.module, which runs no collective).
    final_loss, accuracy = evaluate(model.module, dataset)
    if dist.get_rank() == 0:
        print(f"done: {args.epochs} epochs, final loss {final_loss:.4f}, accuracy {accuracy:.1%}")
    loader.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
