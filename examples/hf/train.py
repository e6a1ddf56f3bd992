"""A Hugging Face `Trainer` script as people write it, on dlfleet.

The lines that change for dlfleet are marked `# dlfleet`: one import and the
trainer's class (`Trainer` -> `DLFleetTrainer`). Run it as a job:

    dlmaster --job-config examples/hf/job.yaml

or on each node with `dlworker --master HOST:PORT --nnodes 1:2 train.py`.
The train dataloader then leases from the master, so that every record is
trained once through a lost node or a killed worker; every step is
checkpointed in memory (and replicated to a peer node), and a failure
restarts training in place: the surviving processes go on in the next
round, a spare process takes a dead rank, all from the step before the
failure. HF's own
`save_steps` folders are still written. Under plain `torchrun` the same
script runs with rank-based sharding (a warning says so).

The model is a small GPT-2 built from a config (nothing is downloaded); the
data are sequences that count up modulo the vocabulary from a random start,
which the model learns to continue.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from dlfleet.integrations.hf import DLFleetTrainer  # dlfleet

VOCAB, LENGTH = 64, 16


class CountingSequences(Dataset[dict[str, torch.Tensor]]):
    """Record i: LENGTH tokens counting up (mod VOCAB) from a start drawn with seed i."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = int(torch.randint(VOCAB, (1,), generator=torch.Generator().manual_seed(index)))
        tokens = (torch.arange(LENGTH) + start) % VOCAB
        return {"input_ids": tokens, "labels": tokens.clone()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--size", type=int, default=4096, help="records in the dataset")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--output-dir", type=Path, default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=64, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(config)
    workdir = Path(os.environ.get("DLFLEET_WORKDIR", "."))
    training = TrainingArguments(
        output_dir=str(args.output_dir or workdir / "hf-output"),
        per_device_train_batch_size=args.batch_size,
        num_train_epochs=args.epochs,
        learning_rate=3e-3,
        warmup_steps=20,
        logging_steps=50,
        save_steps=200,
        save_total_limit=2,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        disable_tqdm=True,
        seed=0,
    )
    trainer = DLFleetTrainer(  # dlfleet: was Trainer(...)
        model=model, args=training, train_dataset=CountingSequences(args.size)
    )
    result = trainer.train()
    if trainer.is_world_process_zero():
        print(f"done: {args.epochs} epochs, final loss {result.training_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
