"""A PyTorch Lightning job as people write it, with dlfleet's changed lines
(its Trainer, the loader), that logs which records each rank trained at
every step in the ledger format of ledger_train.py (checked by
tests/e2e/ledger.py).

    lightning_ledger_train.py --ledger-dir DIR [--size 203] [--batch-size 4]
        [--epochs 2] [--nodes 2] [--crash-at-step K --crash-rank R]
        [--sleep-per-step S] [--adapters] [--stock [--save-every N --checkpoint-dir D]]

`DLFleetTrainer` restarts in place under dlworker; `--adapters` takes
Lightning's own Trainer with the environment and checkpoint callback added
instead (the group is then restarted cold).

`--stock` runs the script as it is written without dlfleet: a DataLoader
(Lightning adds the DistributedSampler), Lightning's own environment, a
`ModelCheckpoint` every `--save-every` steps, and `fit(ckpt_path=...)` from
its last file: the reference of bench/frameworks.py.

Record i is (features derived from i, a target, i). A step is logged from
`training_step`, before its backward (and so before the gradient all-reduce),
as ledger_train.py explains; a padding batch is not logged. Rank 0 appends
the step every attempt restored (0 for none) to restores.jsonl. `attempt`
is the round under dlfleet, rank 0's start time under torchrun (`--stock`).
`--crash-at-step K` SIGKILLs rank R when it is about to train step K, in the
job's first worker group only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dlfleet import ShardedDataLoader
from dlfleet.integrations.lightning import DLFleetCheckpoint, DLFleetEnvironment, DLFleetTrainer

# tests/ on the path: the ledger lines are shared with the other framework script.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from e2e.scripts.step_ledger import Ledger

FEATURES = 8


class Records(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x = torch.randn(FEATURES, generator=torch.Generator().manual_seed(index))
        return x, x.sum(dim=0, keepdim=True), index


class Regression(pl.LightningModule):
    def __init__(self, cli: argparse.Namespace) -> None:
        super().__init__()
        self.cli = cli
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 1))
        self.ledger = Ledger(cli, "lightning_ledger_train")
        self.loader: ShardedDataLoader | None = None
        self.fleet = DLFleetCheckpoint(
            save_every=cli.dlfleet_save_every,
            persist_every=cli.dlfleet_persist_every,
            persist_dir=cli.dlfleet_persist_dir,
        )

    def on_train_start(self) -> None:
        self.ledger.refresh()  # a new round, when restarted in place
        if self.cli.stock:
            self.ledger.stamp_attempt()
        if self.global_rank == 0:
            restored = self.fleet.restored.step if self.fleet.restored is not None else 0
            if self.cli.stock:
                restored = self.trainer.global_step  # Lightning's restore has set it
            self.ledger.restored(restored)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, ids = batch
        step = self.trainer.global_step + 1
        rank, world = self.global_rank, self.trainer.world_size
        self.ledger.crash_due(step, rank)
        loader = self.loader
        if not (loader is not None and loader.padding):
            epoch = loader.epoch if loader is not None else self.current_epoch
            self.ledger.step(step, rank, world, epoch, ids)
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ledger-dir", type=Path, required=True)
    parser.add_argument("--size", type=int, default=203)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--crash-at-step", type=int, default=-1)
    parser.add_argument("--crash-rank", type=int, default=0)
    parser.add_argument("--sleep-per-step", type=float, default=0.0)
    parser.add_argument("--stock", action="store_true", help="Lightning alone, no dlfleet")
    parser.add_argument("--adapters", action="store_true", help="pl.Trainer + the adapters")
    parser.add_argument(
        "--dlfleet-save-every",
        type=lambda v: v if v == "auto" else int(v),
        default="auto",
        help="dlfleet's save interval: steps or \"auto\" (the integration's default)",
    )
    parser.add_argument("--dlfleet-persist-every", type=int, default=0)
    parser.add_argument("--dlfleet-persist-dir", type=Path, default=None)
    parser.add_argument("--save-every", type=int, default=20, help="--stock: steps")
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    cli = parser.parse_args()
    cli.ledger_dir.mkdir(parents=True, exist_ok=True)

    pl.seed_everything(0)
    model = Regression(cli)
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "num_nodes": cli.nodes,
        "strategy": "ddp",
        "max_epochs": cli.epochs,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    if cli.stock:
        folder = cli.checkpoint_dir or cli.ledger_dir.parent / "lightning-checkpoints"
        every = ModelCheckpoint(
            dirpath=folder, every_n_train_steps=cli.save_every, save_top_k=-1, save_last=True
        )
        trainer = pl.Trainer(**settings, callbacks=[every])
        last = folder / "last.ckpt"
        loader = DataLoader(Records(cli.size), batch_size=cli.batch_size, shuffle=True)
        trainer.fit(model, train_dataloaders=loader, ckpt_path=last if last.exists() else None)
    elif cli.adapters:
        trainer = pl.Trainer(
            **settings,
            enable_checkpointing=False,
            plugins=[DLFleetEnvironment()],
            callbacks=[model.fleet],
        )
        model.loader = ShardedDataLoader(
            Records(cli.size), cli.batch_size, epochs=cli.epochs, pad_empty=True
        )
        trainer.fit(model, train_dataloaders=model.loader)
    else:
        trainer = DLFleetTrainer(**settings, enable_checkpointing=False, callbacks=[model.fleet])
        model.loader = ShardedDataLoader(
            Records(cli.size), cli.batch_size, epochs=cli.epochs, pad_empty=True
        )
        trainer.fit(model, train_dataloaders=model.loader)
    if trainer.is_global_zero:
        print(f"lightning_ledger_train: done at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
