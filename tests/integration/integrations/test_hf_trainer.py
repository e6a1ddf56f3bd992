"""DLFleetTrainer with the real transformers package, one process (no master:
the loader slices by rank, with a warning, and the Checkpointer restores what
was persisted): each moment the adapter hooks into HF's loop.

- a failed train() leaves its newest step persisted; the next train() restores
  it, trains every record of each epoch exactly once with the first, and HF's
  counters continue (global step, the logged epoch, the scheduler);
- a padding batch's loss keeps its value and sends no gradient;
- HF's own save_steps folders carry the loader's state, so a resume from
  them is exact too.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from dlfleet.integrations.hf import LOADER_FILE, DLFleetTrainer, PaddingBatch

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:ShardedDataLoader"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

SIZE, BATCH, EPOCHS = 40, 4, 2  # 10 steps an epoch, 20 in all
VOCAB, LENGTH = 32, 6


class Sequences(Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = torch.randint(VOCAB, (LENGTH,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": tokens, "labels": tokens.clone(), "idx": torch.tensor(index)}


class Crash(TrainerCallback):
    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.at_step:
            raise RuntimeError(f"crash at step {self.at_step}")


class Recording(DLFleetTrainer):
    """Records (step, epoch, ids) of every trained batch."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.trained: list[tuple[int, int, list[int]]] = []

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        ids = inputs.pop("idx")
        assert self.loader is not None
        self.trained.append((self.state.global_step + 1, self.loader.epoch, [int(i) for i in ids]))
        return super().training_step(model, inputs, num_items_in_batch)


def make_trainer(output: Path, **kwargs: Any) -> Recording:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=16, n_layer=1, n_head=2)
    args = TrainingArguments(
        output_dir=str(output),
        per_device_train_batch_size=BATCH,
        num_train_epochs=EPOCHS,
        learning_rate=1e-3,
        logging_steps=2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        remove_unused_columns=False,
        disable_tqdm=True,
        seed=0,
    )
    for name, value in kwargs.pop("args", {}).items():
        setattr(args, name, value)
    return Recording(model=GPT2LMHeadModel(config), args=args, train_dataset=Sequences(), **kwargs)


def assert_each_record_once_per_epoch(trained: list[tuple[int, int, list[int]]]) -> None:
    for epoch in range(EPOCHS):
        counts = Counter(i for _, e, ids in trained if e == epoch for i in ids)
        assert sorted(counts) == list(range(SIZE)), f"epoch {epoch}: {sorted(counts)}"
        assert set(counts.values()) == {1}, f"epoch {epoch}: twice: {counts.most_common(3)}"


@pytest.fixture(autouse=True)
def no_job(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DLFLEET_MASTER", "DLFLEET_AGENT", "DLFLEET_CHECKPOINT_DIR", "DLFLEET_WORKDIR"):
        monkeypatch.delenv(name, raising=False)


def test_a_failed_train_is_resumed_from_its_newest_step_with_hf_counters_and_data_exact(
    tmp_path: Path,
) -> None:
    first = make_trainer(tmp_path / "out", persist_every=5, persist_dir=tmp_path / "ckpt")
    first.add_callback(Crash(at_step=12))  # after the adapter's save of step 12
    with pytest.raises(RuntimeError, match="crash at step 12"):
        first.train()
    # close() persisted the newest step saved (12), beside the periodic 5 and 10.
    second = make_trainer(tmp_path / "out", persist_every=5, persist_dir=tmp_path / "ckpt")
    result = second.train()

    assert second.restored is not None and second.restored.step == 12
    assert second.restored.source == "disk"
    kept = [entry for entry in first.trained if entry[0] <= 12]
    assert [s for s, _, _ in second.trained] == list(range(13, 21))
    assert_each_record_once_per_epoch(kept + second.trained)
    assert result.global_step == 20 and second.state.global_step == 20
    assert second.state.epoch == pytest.approx(2.0)
    # The epoch logged after the restore counts the resumed epoch from its
    # start, not from the restore.
    logged = [h for h in second.state.log_history if "loss" in h]
    # The history is restored (step 12 failed before it was logged); the
    # first log after the restore averages the loss of steps 13 and 14.
    assert [h["step"] for h in logged] == [2, 4, 6, 8, 10, 14, 16, 18, 20]
    assert logged[5]["epoch"] == pytest.approx(1.4)
    assert second.lr_scheduler is not None
    assert second.lr_scheduler.last_epoch == 20


def test_a_step_restored_at_an_epochs_end_goes_on_with_the_next_epoch(tmp_path: Path) -> None:
    first = make_trainer(tmp_path / "out", persist_every=5, persist_dir=tmp_path / "ckpt")
    first.add_callback(Crash(at_step=10))  # the last step of epoch 0
    with pytest.raises(RuntimeError):
        first.train()
    second = make_trainer(tmp_path / "out", persist_every=5, persist_dir=tmp_path / "ckpt")
    second.train()
    assert second.restored is not None and second.restored.step == 10
    assert [(s, e) for s, e, _ in second.trained] == [(s, 1) for s in range(11, 21)]
    assert_each_record_once_per_epoch(first.trained + second.trained)
    assert second.state.global_step == 20 and second.state.epoch == pytest.approx(2.0)


def test_a_padding_batch_keeps_its_loss_and_sends_no_gradient(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path / "out")
    model = trainer.model
    assert isinstance(model, nn.Module)
    batch = {key: value.unsqueeze(0) for key, value in Sequences()[3].items() if key != "idx"}
    for padding in (False, True):
        model.zero_grad()
        inputs = PaddingBatch(batch) if padding else dict(batch)
        loss = trainer.compute_loss(model, inputs)
        assert isinstance(loss, torch.Tensor) and loss.item() > 0
        loss.backward()  # type: ignore[no-untyped-call]
        grads = sum(float(p.grad.abs().sum()) for p in model.parameters() if p.grad is not None)
        assert (grads == 0.0) is padding, (padding, grads)


def test_hf_save_steps_folders_carry_the_loader_so_their_resume_is_exact(tmp_path: Path) -> None:
    settings = {"save_strategy": "steps", "save_steps": 5}
    first = make_trainer(tmp_path / "out", args=settings)
    first.add_callback(Crash(at_step=12))
    with pytest.raises(RuntimeError):
        first.train()
    assert (tmp_path / "out" / "checkpoint-10" / LOADER_FILE).exists()
    second = make_trainer(tmp_path / "out", args=settings)
    second.train(resume_from_checkpoint=True)  # HF's newest folder: checkpoint-10
    assert second.restored is None
    kept = [entry for entry in first.trained if entry[0] <= 10]
    assert [s for s, _, _ in second.trained] == list(range(11, 21))
    assert_each_record_once_per_epoch(kept + second.trained)


@pytest.mark.parametrize(("max_nodes", "epochs"), [(None, 2), ("4", 5)])
def test_a_step_budget_takes_the_data_epochs_of_the_largest_world(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_nodes: str | None, epochs: int
) -> None:
    """15 steps: at world 1 (10 steps an epoch) 2 epochs; in a job that may
    grow to 4 nodes of 1 process (3 steps an epoch there) 5, so a grown world
    does not run out of data. The world of 1 stops at step 15 all the same."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    if max_nodes is None:
        monkeypatch.delenv("DLFLEET_MAX_NODES", raising=False)
    else:
        monkeypatch.setenv("DLFLEET_MAX_NODES", max_nodes)
    trainer = make_trainer(tmp_path / "out", args={"max_steps": 15})
    trainer.get_train_dataloader()
    assert trainer.loader is not None and trainer.loader.epochs == epochs
    result = trainer.train()
    assert result.global_step == 15
