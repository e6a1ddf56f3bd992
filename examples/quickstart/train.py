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
2. It builds what does not depend on the world (dataset, model, optimizer)
   once, and hands a `train(attempt)` function to `dlfleet.elastic.run`.
   Under dlworker a world change or a failed peer does not kill the healthy
   processes: `run` aborts the attempt and calls `train` again, in the same
   process (torch imported, model built), with the new round's ranks; a dead
   rank is taken over by a spare process that the agent started ahead. So
   whatever depends on the rank or the world size (the DDP wrapper, the
   loader) is made inside `train`.
3. It checkpoints on every rank with `dlfleet.Checkpointer`, as often as keeps
   saves under 1% of the training time (`every="auto"`: every step when steps
   are long; this model's steps take milliseconds, so every few dozen steps,
   which rank 0 logs; `--save-every 1` saves every step). `save` copies the
   state into shared memory owned by the node agent (the step waits only for
   that copy; the agent replicates it to a peer node), and
   every `--persist-every` steps the state is also written to disk in
   torch.distributed.checkpoint format. Each attempt starts with `load`: the
   newest step that every rank saved, from this node's memory, a peer's
   replica, or disk. The state holds `loader.state_dict()`, restored before
   the first iteration: model *and* data roll back to the same step, so every
   record of every epoch is trained exactly once by the model that survives
   (records trained after that step are trained again, but their earlier
   effect was rolled back with the model).

Under plain torchrun, `run` initialises the process group from the environment
and calls `train` once, and `load` finds only what was persisted to disk.
"""

from __future__ import annotations

import argparse
import copy
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from dlfleet import Checkpointer, ShardedDataLoader, elastic

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


def _save_every(text: str) -> int | str:
    if text == "auto":
        return text
    every = int(text)
    if every < 1:
        raise argparse.ArgumentTypeError(f'a step count >= 1 or "auto", got {text}')
    return every


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--size", type=int, default=4096, help="records in the dataset")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="where checkpoints are persisted (default: $DLFLEET_WORKDIR/checkpoints, "
        "else ./checkpoints)",
    )
    parser.add_argument(
        "--persist-every",
        "--checkpoint-every",
        type=int,
        default=50,
        help="steps between checkpoints written to disk (of the steps checkpointed in memory)",
    )
    parser.add_argument(
        "--save-every",
        type=_save_every,
        default="auto",
        help='steps between checkpoints in memory: a count, or "auto" (as often as keeps '
        "saves under 1%% of the training time)",
    )
    parser.add_argument("--log-every", type=int, default=10, help="steps")
    return parser.parse_args()


class Trainer:
    """One process's training. What is built here outlives the attempts (and
    is what a restart in place does not pay for again); `train` is one attempt."""

    def __init__(self, args: argparse.Namespace, checkpointer: Checkpointer) -> None:
        self.args = args
        self.checkpointer = checkpointer
        torch.manual_seed(args.seed)  # the same initial weights on every rank and spare
        self.dataset = SyntheticClassification(args.size, seed=args.seed)
        self.model = make_model()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        # A copy of the starting point, for an attempt that finds no checkpoint:
        # an earlier attempt of this process may have trained the model past it.
        # (get_state_dict also gives AdamW its state before the first step, so
        # that the checkpoint of step 0 has the shape of every later one.)
        self.initial = copy.deepcopy(get_state_dict(self.model, self.optimizer))

    def train(self, attempt: elastic.Attempt) -> None:
        """One attempt: from the newest checkpoint to the end of the last epoch."""
        ddp = DistributedDataParallel(self.model)
        # The loader's spec (size, epochs, shuffle, seed) is registered with the
        # master by the first rank that uses it; `name` identifies the dataset
        # within the job, so a new attempt resumes the same one. It is closed
        # when the attempt ends, however it ends.
        loader = ShardedDataLoader(
            self.dataset,
            self.args.batch_size,
            shuffle=True,
            seed=self.args.seed,
            epochs=self.args.epochs,
            name="quickstart-synthetic",
        )
        step = self.restore(loader, attempt)
        # Each iteration of the loader is (the rest of) the next epoch; once the
        # last epoch is done an iteration yields nothing. A resumed attempt has
        # at most `epochs` epochs (or rests of one) left.
        for _ in range(self.args.epochs):
            step = self.train_epoch(ddp, loader, step, attempt)
        self.save(step, loader, final=True)  # the model training ends with, whatever the interval

        # The model is replicated: each rank can evaluate it alone (through
        # the plain module, which runs no collective).
        final_loss, accuracy = evaluate(self.model, self.dataset)
        if attempt.rank == 0:
            print(
                f"done: {self.args.epochs} epochs, final loss {final_loss:.4f}, "
                f"accuracy {accuracy:.1%}",
                flush=True,
            )

    def restore(self, loader: ShardedDataLoader, attempt: elastic.Attempt) -> int:
        """Load the newest step that every rank saved (all ranks agree on it);
        the step to continue from."""
        restored = self.checkpointer.load()
        if restored is None:
            # A copy: the optimizer keeps the very tensors it loads, and training
            # would change the starting point in place.
            model_state, optimizer_state = copy.deepcopy(self.initial)
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=model_state,
                optim_state_dict=optimizer_state,
            )
            # A checkpoint of the starting point: if this attempt fails before
            # the first step is saved by every rank, the next one rolls the data
            # back to the start too, instead of resuming the data with new weights.
            self.save(0, loader)
            return 0
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=restored.state["model"],
            optim_state_dict=restored.state["optimizer"],
        )
        # Before the first iteration: this rolls the master's progress on the
        # dataset back to the checkpoint's step, so the records trained after
        # it (by a model that is now discarded) are trained again.
        loader.load_state_dict(restored.state["loader"])
        if attempt.rank == 0:
            print(
                f"resumed at step {restored.step} from {restored.source}, "
                f"world size {attempt.world_size} (round {attempt.round})",
                flush=True,
            )
        return int(restored.step)

    def save(self, step: int, loader: ShardedDataLoader, final: bool = False) -> None:
        """Checkpoint between steps, on every rank: loader.state_dict() counts
        the batches that the model has been trained on, and no others."""
        if not (final or self.checkpointer.due(step)):
            return  # every rank answers the same
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state: dict[str, Any] = {
            "model": model_state,
            "optimizer": optimizer_state,
            "loader": loader.state_dict(),
        }
        # The model's and optimizer's tensors are copied while the next
        # step's forward and backward run; its optimizer.step() waits for them.
        self.checkpointer.save(step, state, overlap=(self.model, self.optimizer), force=final)

    def train_epoch(
        self,
        ddp: DistributedDataParallel,
        loader: ShardedDataLoader,
        step: int,
        attempt: elastic.Attempt,
    ) -> int:
        """Train (the rest of) the loader's next epoch, from `step`; the step reached."""
        window_start, window_samples = time.monotonic(), 0
        for batch in loader:
            inputs, labels = batch if batch else empty_batch()
            loss = batch_loss(ddp(inputs), labels)
            self.optimizer.zero_grad(set_to_none=True)
            # DDP all-reduces the gradients here. (torch leaves backward() unannotated.)
            loss.backward()  # type: ignore[no-untyped-call]
            self.optimizer.step()
            step += 1
            self.save(step, loader)
            window_samples += len(labels) * attempt.world_size
            if attempt.rank == 0 and step % self.args.log_every == 0:
                rate = window_samples / max(time.monotonic() - window_start, 1e-9)
                print(
                    f"epoch {loader.epoch} step {step} loss {loss.item():.4f} "
                    f"{rate:,.0f} samples/s (world {attempt.world_size})",
                    flush=True,
                )
                window_start, window_samples = time.monotonic(), 0
        return step


@record  # a failure's traceback reaches the agent (and the job's status)
def main() -> None:
    args = parse_args()
    # Closing persists the last step saved (when persisting at all).
    with Checkpointer(
        every=args.save_every, persist_every=args.persist_every, persist_dir=args.checkpoint_dir
    ) as ckpt:
        trainer = Trainer(args, ckpt)
        # The process group's timeout bounds a silent hang; a dead peer or a
        # world change ends the attempt at once.
        elastic.run(trainer.train, backend="gloo", timeout=timedelta(seconds=60))


if __name__ == "__main__":
    main()
