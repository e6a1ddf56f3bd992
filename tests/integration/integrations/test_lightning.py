"""DLFleetCheckpoint and DLFleetEnvironment with the real pytorch-lightning
package, one process (no master: the loader slices by rank, with a warning,
and the Checkpointer restores what was persisted): each moment the adapter
hooks into Lightning's loop.

- a failed fit leaves its newest step persisted; the next fit restores it
  through Lightning's own restore: every record of each epoch exactly once
  with the first, the global step, loops and scheduler continued;
- a checkpoint at an epoch's last step goes on with the next epoch;
- a padding batch's loss sends no gradient;
- the environment takes the round's node count, and refuses devices that
  are not the node's processes.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import Dataset

from dlfleet import ShardedDataLoader
from dlfleet.integrations.lightning import DLFleetCheckpoint, DLFleetEnvironment, DLFleetTrainer
from dlfleet.worker.loader import LoaderEnvironment

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:ShardedDataLoader"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

SIZE, BATCH, EPOCHS = 40, 4, 2  # 10 steps an epoch, 20 in all


class Records(Dataset[tuple[torch.Tensor, int]]):
    def __init__(self, size: int = SIZE) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.randn(4, generator=torch.Generator().manual_seed(index)), index


class Model(pl.LightningModule):
    def __init__(self, crash_at: int = -1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)
        self.crash_at = crash_at
        self.loader: ShardedDataLoader | None = None
        self.trained: list[tuple[int, int, list[int]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, ids = batch
        assert self.loader is not None
        step = self.trainer.global_step + 1
        self.trained.append((step, self.loader.epoch, [int(i) for i in ids]))
        loss: torch.Tensor = self.net(x).pow(2).mean()
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step == self.crash_at:
            raise RuntimeError(f"crash at step {self.crash_at}")

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def fit(
    tmp_path: Path, crash_at: int = -1, trainer_class: type[pl.Trainer] = pl.Trainer, **loader: Any
) -> tuple[Model, DLFleetCheckpoint]:
    model = Model(crash_at)
    fleet = DLFleetCheckpoint(persist_every=5, persist_dir=tmp_path / "ckpt")
    trainer = trainer_class(
        accelerator="cpu",
        devices=1,
        max_epochs=EPOCHS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[fleet],
    )
    model.loader = ShardedDataLoader(
        loader.pop("dataset", Records()), BATCH, epochs=EPOCHS, pad_empty=True, **loader
    )
    if crash_at < 0:
        trainer.fit(model, train_dataloaders=model.loader)
    else:
        with pytest.raises(RuntimeError, match="crash at step"):
            trainer.fit(model, train_dataloaders=model.loader)
    return model, fleet


def assert_each_record_once_per_epoch(trained: list[tuple[int, int, list[int]]]) -> None:
    for epoch in range(EPOCHS):
        counts = Counter(i for _, e, ids in trained if e == epoch for i in ids)
        assert sorted(counts) == list(range(SIZE)), f"epoch {epoch}: {sorted(counts)}"
        assert set(counts.values()) == {1}, f"epoch {epoch}: twice: {counts.most_common(3)}"


@pytest.fixture(autouse=True)
def no_job(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DLFLEET_MASTER", "DLFLEET_AGENT", "DLFLEET_CHECKPOINT_DIR", "DLFLEET_WORKDIR"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("trainer_class", [pl.Trainer, DLFleetTrainer], ids=["pl", "dlfleet"])
@pytest.mark.parametrize("crash_at", [12, 10], ids=["mid-epoch", "epoch-end"])
def test_a_failed_fit_is_resumed_from_its_newest_step_by_lightnings_own_restore(
    tmp_path: Path, crash_at: int, trainer_class: type[pl.Trainer]
) -> None:
    """Outside dlworker `DLFleetTrainer.fit` is Lightning's own, with the
    callback given (not a second one added)."""
    first, _ = fit(tmp_path, crash_at=crash_at, trainer_class=trainer_class)
    second, fleet = fit(tmp_path, trainer_class=trainer_class)
    added = [c for c in second.trainer.callbacks if isinstance(c, DLFleetCheckpoint)]  # type: ignore[attr-defined]
    assert added == [fleet]
    assert fleet.restored is not None and fleet.restored.step == crash_at
    assert fleet.restored.source == "disk"
    kept = [entry for entry in first.trained if entry[0] <= crash_at]
    assert [s for s, _, _ in second.trained] == list(range(crash_at + 1, 21))
    assert_each_record_once_per_epoch(kept + second.trained)
    assert second.trainer.global_step == 20
    assert second.trainer.current_epoch == EPOCHS
    schedule = second.trainer.lr_scheduler_configs[0].scheduler
    assert schedule.last_epoch == 20  # stepped 20 times across both fits


def test_a_padding_batch_sends_no_gradient(tmp_path: Path) -> None:
    # 2 records and a loader that believes it is rank 0 of 3: its one batch
    # is padding (a record of rank 1's), trained with a zero gradient.
    model, _ = fit(
        tmp_path,
        dataset=Records(2),
        environment=LoaderEnvironment(master=None, rank=0, world_size=3),
    )
    before = Model().net.weight.detach().clone()
    assert model.trained, "no step ran"
    assert torch.equal(model.net.weight.detach(), before)


def test_the_environment_takes_the_rounds_nodes_and_checks_the_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    environment = DLFleetEnvironment()
    environment.validate_settings(num_devices=1, num_nodes=3)  # the job's max: fine
    assert environment.num_nodes() == 2
    with pytest.raises(ValueError, match="devices=2"):
        environment.validate_settings(num_devices=2, num_nodes=1)


def test_the_dlfleet_trainer_adds_the_environment_and_the_checkpoint_callback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    trainer = DLFleetTrainer(
        accelerator="cpu", devices=1, strategy="ddp", save_every=3, logger=False
    )
    added = [c for c in trainer.callbacks if isinstance(c, DLFleetCheckpoint)]  # type: ignore[attr-defined]
    assert len(added) == 1 and added[0].save_every == 3
    assert isinstance(trainer.strategy.cluster_environment, DLFleetEnvironment)  # type: ignore[attr-defined]
