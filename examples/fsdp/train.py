"""dlfleet with FSDP2 (`torch.distributed.fsdp.fully_shard`) on CPU and gloo.

The same job as examples/quickstart (read that one first), with the model's
parameters, gradients and optimizer state sharded over the ranks instead of
replicated by DDP:

    dlmaster --job-config examples/fsdp/job.yaml
    torchrun --nproc-per-node 2 train.py --epochs 2

FSDP on CPU: gloo implements the collectives that fully_shard uses
(all_gather_into_tensor, reduce_scatter_tensor), so FSDP2 trains on CPU as is.
The one thing to get right is the device mesh: by default fully_shard builds a
mesh on the machine's accelerator (`torch.accelerator`), so a CPU/gloo job on a
machine that has a GPU would put the parameters on CUDA and run gloo on them.
This script passes an explicit CPU mesh.

What differs from the DDP quickstart:

- Sharding depends on the world, so each attempt of `train` (a new round,
  perhaps of another size) shards its own copy of the model, built once
  before `dlfleet.elastic.run`, over a mesh of this round's ranks, and makes
  its optimizer on those shards. A copy of a built model costs a memory copy,
  not a cold start. (For a model too large for one host, build it on the
  meta device instead and let the restore fill it.)
- Every rank checkpoints its own shards (`get_state_dict` gives DTensors),
  and a restore passes a template, `load(template)`: the state of this
  attempt's shards, which the Checkpointer fills in place, reading the pieces
  each rank needs from the images of every rank that saved them, from this
  node's memory, a peer node or disk, resharded when the world size changed.
  `set_state_dict` then puts it into the model and the optimizer.
- Every `--persist-every` steps the shards are written to disk in
  torch.distributed.checkpoint format, loadable by `dcp.load` at any world size.
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard
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


def make_model(
    features: int = FEATURES, classes: int = CLASSES, hidden: int = 256
) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, classes),
    )


def shard(model: nn.Sequential, world_size: int) -> None:
    """FSDP2 over all ranks, on an explicit CPU mesh (see the module docstring).
    Each layer is its own FSDP unit, its parameters gathered only around its
    forward and backward; the root then takes what is left."""
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def empty_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """What a rank trains when the loader gives it no records (an empty list):
    possible only in the last step of an epoch resumed with fewer records left
    than ranks. The rank must still take part in the step's collectives."""
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


def checkpoint_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, loader: ShardedDataLoader | None = None
) -> dict[str, Any]:
    """What a step's checkpoint holds, and (without a loader) the template
    that a restore fills in place.

    The model's and the optimizer's state are this rank's shards (DTensors).
    The loader's state goes in as one value, in a tuple: nested dicts are
    flattened into keys (the torch.distributed.checkpoint way) that a template
    would have to name one by one, whereas a tuple is kept whole, so that the
    template needs only a placeholder."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {
        "model": model_state,
        "optimizer": optimizer_state,
        "loader": (loader.state_dict(),) if loader is not None else (),
    }


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
        help="steps between checkpoints written to disk (every step is checkpointed in memory)",
    )
    parser.add_argument("--log-every", type=int, default=10, help="steps")
    return parser.parse_args()


class Trainer:
    """One process's training. The dataset and the unsharded model are built
    once and outlive the attempts; `train` is one attempt."""

    def __init__(self, args: argparse.Namespace, checkpointer: Checkpointer) -> None:
        self.args = args
        self.checkpointer = checkpointer
        torch.manual_seed(args.seed)  # the same initial weights on every rank and spare
        self.dataset = SyntheticClassification(args.size, seed=args.seed)
        self.base = make_model()  # never sharded: each attempt shards a copy

    def train(self, attempt: elastic.Attempt) -> None:
        """One attempt: from the newest checkpoint to the end of the last epoch."""
        model = copy.deepcopy(self.base)
        shard(model, attempt.world_size)
        # Built after fully_shard, on the sharded parameters (DTensors): each rank
        # keeps the optimizer state of its own shard only.
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.args.lr)
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
            name="fsdp-synthetic",
        )
        step = self.restore(model, optimizer, loader, attempt)
        # Each iteration of the loader is (the rest of) the next epoch; once the
        # last epoch is done an iteration yields nothing. A resumed attempt has
        # at most `epochs` epochs (or rests of one) left.
        for _ in range(self.args.epochs):
            step = self.train_epoch(model, optimizer, loader, step, attempt)

        # A sharded model's forward is collective: every rank evaluates.
        final_loss, accuracy = evaluate(model, self.dataset)
        if attempt.rank == 0:
            print(
                f"done: {self.args.epochs} epochs, final loss {final_loss:.4f}, "
                f"accuracy {accuracy:.1%}",
                flush=True,
            )

    def restore(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loader: ShardedDataLoader,
        attempt: elastic.Attempt,
    ) -> int:
        """Load the newest step that every rank saved (all ranks agree on it),
        resharded to this attempt's world; the step to continue from."""
        restored = self.checkpointer.load(checkpoint_state(model, optimizer))
        if restored is None:
            # A checkpoint of the starting point (the model is a fresh copy):
            # if this attempt fails before the first step is saved by every
            # rank, the next one rolls the data back to the start too.
            self.checkpointer.save(0, checkpoint_state(model, optimizer, loader))
            return 0
        set_state_dict(
            model,
            optimizer,
            model_state_dict=restored.state["model"],
            optim_state_dict=restored.state["optimizer"],
        )
        # Before the first iteration: this rolls the master's progress on the
        # dataset back to the checkpoint's step, so the records trained after
        # it (by a model that is now discarded) are trained again.
        (loader_state,) = restored.state["loader"]
        loader.load_state_dict(loader_state)
        if attempt.rank == 0:
            print(
                f"resumed at step {restored.step} from {restored.source}, "
                f"world size {attempt.world_size} (round {attempt.round})",
                flush=True,
            )
        return int(restored.step)

    def train_epoch(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loader: ShardedDataLoader,
        step: int,
        attempt: elastic.Attempt,
    ) -> int:
        """Train (the rest of) the loader's next epoch, from `step`; the step reached."""
        window_start, window_samples = time.monotonic(), 0
        for batch in loader:
            inputs, labels = batch if batch else empty_batch()
            loss = batch_loss(model(inputs), labels)
            optimizer.zero_grad(set_to_none=True)
            # FSDP reduce-scatters the gradients here. (torch leaves backward() unannotated.)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            step += 1
            # Between steps, on every rank: loader.state_dict() counts the
            # batches that the model has been trained on, and no others. The
            # shards of the model and the optimizer are copied while the next
            # step's forward and backward run (overlap).
            self.checkpointer.save(
                step, checkpoint_state(model, optimizer, loader), overlap=(model, optimizer)
            )
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
    with Checkpointer(persist_every=args.persist_every, persist_dir=args.checkpoint_dir) as ckpt:
        trainer = Trainer(args, ckpt)
        # The process group's timeout bounds a silent hang; a dead peer or a
        # world change ends the attempt at once.
        elastic.run(trainer.train, backend="gloo", timeout=timedelta(seconds=60))


if __name__ == "__main__":
    main()
