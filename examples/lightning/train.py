"""A PyTorch Lightning script as people write it, on dlfleet.

The lines that change for dlfleet are marked `# dlfleet`: the imports, the
Trainer (dlfleet's `DLFleetTrainer` where `pl.Trainer` was), and the train
loader (a `ShardedDataLoader` where a DataLoader was). Run it as a job:

    dlmaster --job-config examples/lightning/job.yaml

or on each node with `dlworker --master HOST:PORT --nnodes 1:2 train.py`.
The loader leases from the master, so that every record is trained once
through a lost node or a killed worker; `DLFleetTrainer` lets the world
shrink when a node is lost (Lightning's own environment refuses a world that
is not devices x num_nodes), checkpoints steps in memory (replicated to a
peer node), and under dlworker restarts `fit` in place when a rank fails or
the world changes, restored through Lightning's own restore. Under plain
`torchrun` the same script runs with rank-based sharding (a warning says
so).
"""

from __future__ import annotations

import argparse

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import Dataset

from dlfleet import ShardedDataLoader  # dlfleet
from dlfleet.integrations.lightning import DLFleetTrainer  # dlfleet

FEATURES, CLASSES = 16, 4


class SyntheticClassification(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Points labelled by a fixed random "teacher" network (a function of the seed)."""

    def __init__(self, size: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(size, FEATURES, generator=generator)
        teacher = torch.randn(FEATURES, CLASSES, generator=generator)
        self.labels = torch.tanh(self.inputs @ teacher).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.labels[index]


class Classifier(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, CLASSES)
        )

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, labels = batch
        loss = nn.functional.cross_entropy(self.net(inputs), labels)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--size", type=int, default=16384, help="records in the dataset")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    pl.seed_everything(0)
    dataset = SyntheticClassification(args.size)
    model = Classifier(args.lr)
    trainer = DLFleetTrainer(  # dlfleet: was pl.Trainer
        accelerator="cpu",
        devices=1,
        num_nodes=args.nodes,
        strategy="ddp",
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    # dlfleet: was DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
    loader = ShardedDataLoader(dataset, args.batch_size, epochs=args.epochs, pad_empty=True)
    trainer.fit(model, train_dataloaders=loader)

    with torch.no_grad():
        logits = model.net(dataset.inputs)
        loss = nn.functional.cross_entropy(logits, dataset.labels).item()
        accuracy = (logits.argmax(dim=1) == dataset.labels).float().mean().item()
    if trainer.is_global_zero:
        print(
            f"done: {args.epochs} epochs, final loss {loss:.4f}, accuracy {accuracy:.1%}",
            flush=True,
        )


if __name__ == "__main__":
    main()
