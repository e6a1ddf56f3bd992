"""A Hugging Face `Trainer` job as people write it, with dlfleet's one changed
line (`DLFleetTrainer`), that logs which records each rank trained at every
step in the ledger format of ledger_train.py (checked by tests/e2e/ledger.py).

    hf_ledger_train.py --ledger-dir DIR [--size 203] [--batch-size 4] [--epochs 2]
        [--crash-at-step K --crash-rank R] [--sleep-per-step S] [--output-dir D]

The model is a tiny GPT-2 built from a config (nothing is downloaded); record
i is a sequence of tokens drawn from a generator seeded with i, with `idx`: i.

A step is logged from `training_step`, before its backward (and so before the
gradient all-reduce that makes it happen anywhere), as ledger_train.py
explains; a padding batch (a rank without records) is not logged. Rank 0
appends the step every attempt restored (0 for none) to restores.jsonl.
`--crash-at-step K` SIGKILLs rank R when it is about to train step K, in the
job's first worker group only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from dlfleet.integrations.hf import DLFleetTrainer, PaddingBatch

VOCAB, LENGTH = 64, 8


class Sequences(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = torch.randint(VOCAB, (LENGTH,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": tokens, "labels": tokens.clone(), "idx": torch.tensor(index)}


def append_line(path: Path, entry: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


class LedgerTrainer(DLFleetTrainer):
    def __init__(self, cli: argparse.Namespace, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cli = cli
        self.round = int(os.environ.get("DLFLEET_ROUND") or 0)
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
        self.attempt = self.round if self.round > 0 else self.restart

    def identity(self) -> dict[str, int]:
        return {"attempt": self.attempt, "round": self.round, "restart": self.restart}

    def _prepare_for_training(self, *args: Any, **kwargs: Any) -> Any:
        prepared = super()._prepare_for_training(*args, **kwargs)
        if self.args.process_index == 0:
            restored = self.restored.step if self.restored is not None else 0
            append_line(
                self.cli.ledger_dir / "restores.jsonl",
                {**self.identity(), "restored_step": restored, "t": time.time()},
            )
        return prepared

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        ids = inputs.pop("idx")
        step = self.state.global_step + 1
        rank, world = self.args.process_index, self.args.world_size
        if (
            step == self.cli.crash_at_step
            and rank == self.cli.crash_rank
            and self.restart == 0
            and self.round <= 1
        ):
            print(f"hf_ledger_train: rank {rank} crashing at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if not isinstance(inputs, PaddingBatch):
            assert self.loader is not None
            append_line(
                self.cli.ledger_dir / f"ledger-a{self.attempt}-r{rank}.jsonl",
                {
                    **self.identity(),
                    "rank": rank,
                    "world": world,
                    "epoch": self.loader.epoch,
                    "step": step,
                    "ids": [int(i) for i in ids],
                    "t": time.time(),
                },
            )
        if self.cli.sleep_per_step:
            time.sleep(self.cli.sleep_per_step)
        return super().training_step(model, inputs, num_items_in_batch)


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
    trainer = LedgerTrainer(cli, model=model, args=args, train_dataset=Sequences(cli.size))
    result = trainer.train()
    if args.process_index == 0:
        print(
            f"hf_ledger_train: done at step {result.global_step}, loss {result.training_loss:.4f}"
        )


if __name__ == "__main__":
    main()
