"""A Hugging Face `Trainer` job as people write it, with dlfleet's one changed
line (`DLFleetTrainer`), that logs which records each rank trained at every
step in the ledger format of ledger_train.py (checked by tests/e2e/ledger.py).

    hf_ledger_train.py --ledger-dir DIR [--size 203] [--batch-size 4] [--epochs 2]
        [--crash-at-step K --crash-rank R] [--sleep-per-step S] [--output-dir D]
        [--stock [--save-steps N]]

`--stock` runs HF's own `Trainer` instead, as a script without dlfleet is
written (DistributedSampler, HF's folders every `--save-steps` steps, resumed
from the newest one): the reference of bench/frameworks.py.

The model is a tiny GPT-2 built from a config (nothing is downloaded); record
i is a sequence of tokens drawn from a generator seeded with i, with `idx`: i.

A step is logged from `training_step`, before its backward (and so before the
gradient all-reduce that makes it happen anywhere), as ledger_train.py
explains; a padding batch (a rank without records) is not logged. Rank 0
appends the step every attempt restored (0 for none) to restores.jsonl.
`attempt` is the round under dlfleet, rank 0's start time under torchrun.
`--crash-at-step K` SIGKILLs rank R when it is about to train step K, in the
job's first worker group only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint

from dlfleet.integrations.hf import DLFleetTrainer, PaddingBatch

# tests/ on the path: the ledger lines are shared with the other framework script.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from e2e.scripts.step_ledger import Ledger

VOCAB, LENGTH = 64, 8


class Sequences(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = torch.randint(VOCAB, (LENGTH,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": tokens, "labels": tokens.clone(), "idx": torch.tensor(index)}


class LedgerTrainer(DLFleetTrainer):
    def __init__(self, cli: argparse.Namespace, **kwargs: Any) -> None:
        super().__init__(save_every=cli.dlfleet_save_every, **kwargs)
        self.ledger = Ledger(cli, "hf_ledger_train")

    def _prepare_for_training(self, *args: Any, **kwargs: Any) -> Any:
        prepared = super()._prepare_for_training(*args, **kwargs)
        self.ledger.refresh()  # a new round, when restarted in place
        if self.args.process_index == 0:
            self.ledger.restored(self.restored.step if self.restored is not None else 0)
        return prepared

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        ids = inputs.pop("idx")
        step, rank = self.state.global_step + 1, self.args.process_index
        self.ledger.crash_due(step, rank)
        if not isinstance(inputs, PaddingBatch):
            assert self.loader is not None
            self.ledger.step(step, rank, self.args.world_size, self.loader.epoch, ids)
        return super().training_step(model, inputs, num_items_in_batch)


class StockTrainer(Trainer):
    """HF's own Trainer, logging the same ledger."""

    def __init__(self, cli: argparse.Namespace, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ledger = Ledger(cli, "hf_ledger_train")
        self.add_callback(_RestoredStep(self))

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        ids = inputs.pop("idx")
        step, rank = self.state.global_step + 1, self.args.process_index
        self.ledger.crash_due(step, rank)
        self.ledger.step(step, rank, self.args.world_size, int(self.state.epoch or 0), ids)
        return super().training_step(model, inputs, num_items_in_batch)


class _RestoredStep(TrainerCallback):
    def __init__(self, trainer: StockTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.trainer.ledger.stamp_attempt()
        if args.process_index == 0:  # HF's resume has set the step by now
            self.trainer.ledger.restored(state.global_step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ledger-dir", type=Path, required=True)
    parser.add_argument("--output-dir", type=Path, default=None)
    parser.add_argument("--size", type=int, default=203)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--crash-at-step", type=int, default=-1)
    parser.add_argument("--crash-rank", type=int, default=0)
    parser.add_argument("--sleep-per-step", type=float, default=0.0)
    parser.add_argument("--save-steps", type=int, default=20)
    parser.add_argument("--stock", action="store_true", help="HF's own Trainer, no dlfleet")
    parser.add_argument(
        "--dlfleet-save-every",
        type=lambda v: v if v == "auto" else int(v),
        default="auto",
        help="dlfleet's save interval: steps or \"auto\" (the integration's default)",
    )
    cli = parser.parse_args()
    cli.ledger_dir.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=str(cli.output_dir or cli.ledger_dir.parent / "hf-output"),
        per_device_train_batch_size=cli.batch_size,
        num_train_epochs=cli.epochs,
        learning_rate=1e-3,
        logging_steps=10,
        save_steps=cli.save_steps,
        save_total_limit=2,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        remove_unused_columns=False,
        disable_tqdm=True,
        seed=0,
    )
    if cli.stock:
        trainer: Trainer = StockTrainer(
            cli, model=model, args=args, train_dataset=Sequences(cli.size)
        )
        output = str(args.output_dir)
        last = get_last_checkpoint(output) if Path(output).is_dir() else None  # type: ignore[no-untyped-call]
        result = trainer.train(resume_from_checkpoint=last)
    else:
        trainer = LedgerTrainer(cli, model=model, args=args, train_dataset=Sequences(cli.size))
        result = trainer.train()
    if args.process_index == 0:
        print(
            f"hf_ledger_train: done at step {result.global_step}, loss {result.training_loss:.4f}"
        )


if __name__ == "__main__":
    main()
