"""PyTorch Lightning on dlfleet: a world that follows the round, exactly-once
data, checkpoints in memory and restarts in place, with two changed lines
(and the imports).

    from dlfleet import ShardedDataLoader
    from dlfleet.integrations.lightning import DLFleetTrainer

    trainer = DLFleetTrainer(max_epochs=2, ...)                # was: L.Trainer(...)
    loader = ShardedDataLoader(dataset, batch_size=32, epochs=2, pad_empty=True)
    trainer.fit(model, train_dataloaders=loader)             # was: a DataLoader

- `DLFleetTrainer` is `pl.Trainer` with the two adapters below added, whose
  `fit` restarts in place under dlworker (`dlfleet.elastic.run`): when a
  rank fails or the world changes, the surviving processes leave the round
  (Lightning tears its fit down as after any exception) and fit again in
  the next one, restored from memory, with the `ShardedDataLoader` renewed
  for the round; a spare process (the script run up to `fit`, waiting)
  takes a dead rank. Without dlworker its `fit` is Lightning's own.
- `DLFleetEnvironment` is torchelastic's environment (dlworker and torchrun
  set the same variables) whose number of nodes is the round's: a round that
  lost a node trains in the smaller world, where Lightning's own environment
  refuses a world size that is not `devices x num_nodes`.
- `DLFleetCheckpoint` checkpoints optimizer steps (as often as `save_every`
  says: "auto", the default, as keeps the saves under 1% of the training
  time; 1: every step) through
  `dlfleet.Checkpointer`: the checkpoint Lightning itself would write (model,
  optimizers, schedulers, loops, callbacks, precision, and the loader's
  position, which Lightning keeps for a loader with a `state_dict`), the
  parameters and optimizer state copied while the next step's forward and
  backward run. When training starts it restores the newest step every rank
  saved (this node's memory, a peer node's replica, or disk) through
  Lightning's own restore, so its counters, loops and schedulers continue
  from there. Lightning's own `ModelCheckpoint` files keep working beside it
  (and hold the loader's position too).
- A rank with no records in the last step of a resumed epoch trains a
  padding batch (`pad_empty=True`: a record another rank trains in that
  step); the callback gives its loss a zero gradient.

The two adapters also work on a `pl.Trainer` of the script's own
(`plugins=[DLFleetEnvironment()], callbacks=[DLFleetCheckpoint()]`): under
dlworker a failed worker group is then restarted cold by the agent, and the
new processes restore from memory. Do not also pass `ckpt_path` to `fit`: a
checkpoint file named there replaces the newer one dlfleet restored.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning_fabric.plugins.environments.torchelastic import TorchElasticEnvironment
from pytorch_lightning.callbacks import Callback

from dlfleet.api.env import AGENT_ENV
from dlfleet.worker import elastic
from dlfleet.worker.checkpoint.checkpointer import Checkpointer, Restored
from dlfleet.worker.loader import ShardedDataLoader
from dlfleet.worker.loader.padding import zero_weight

STATE_KEY = "lightning"  # the Lightning checkpoint's key in dlfleet's state


class DLFleetEnvironment(TorchElasticEnvironment):
    """torchelastic's variables, with the number of nodes the round decides."""

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Lightning's `num_nodes` is what the job starts with; the round may
        have fewer (a lost node) or more. Only the devices per node must agree."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", num_devices))
        if local != num_devices:
            raise ValueError(
                f"You set `devices={num_devices}` in Lightning, but this node runs {local} "
                "processes (dlworker --nproc-per-node): they must agree"
            )
        del num_nodes

    def num_nodes(self) -> int:
        """The round's nodes (GROUP_WORLD_SIZE), else the world over this node's processes."""
        group = os.environ.get("GROUP_WORLD_SIZE")
        if group:
            return int(group)
        return max(self.world_size() // int(os.environ.get("LOCAL_WORLD_SIZE") or 1), 1)


class DLFleetCheckpoint(Callback):
    """Optimizer steps checkpointed in memory (`save_every`); the newest restored when
    `fit` starts (see the module's docstring). `persist_every`: steps between
    persisted copies in torch.distributed.checkpoint format under
    `persist_dir` (default `$DLFLEET_WORKDIR/checkpoints`; 0: never)."""

    def __init__(
        self,
        *,
        save_every: int | str = "auto",
        persist_every: int = 0,
        persist_dir: str | Path | None = None,
    ) -> None:
        self.save_every = save_every
        self.persist_every = persist_every
        self.persist_dir = persist_dir
        self.checkpointer: Checkpointer | None = None
        self.restored: Restored | None = None
        self._last_saved = -1
        # The Checkpointer of a `fit` that outlives it (DLFleetTrainer's
        # restarts in place: one for all rounds, closed by the trainer).
        self.kept: Checkpointer | None = None

    # ---------------------------------------------------------------- hooks

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _follow_the_round(trainer)
        self.checkpointer = self.kept or self.make_checkpointer()
        self.restored = self.checkpointer.load()
        if self.restored is not None:
            # Lightning restores from the checkpoint it loaded (modules and
            # callbacks next, then optimizers, schedulers, loops and the
            # loader's position), as from a file named by `ckpt_path`.
            connector = trainer._checkpoint_connector
            connector._loaded_checkpoint = self.restored.state[STATE_KEY]
            self._last_saved = self.restored.step
            if trainer.is_global_zero:
                print(
                    f"dlfleet: resumed at step {self.restored.step} from {self.restored.source} "
                    f"(world size {trainer.world_size})",
                    flush=True,
                )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.restored is None:
            # The starting point as a checkpoint too: a failure before the
            # first step every rank saved rolls the data back with the model.
            self._save(trainer, pl_module)

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        if any(loader.padding for loader in _sharded_loaders(trainer)):
            zero_weight(loss)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if trainer.global_step != self._last_saved:  # an optimizer step was taken
            self._save(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The step training ends with is kept, whatever the interval."""
        self._save(trainer, pl_module, force=True)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._close()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Lightning calls no teardown after an exception: close here."""
        self._close()

    def state_dict(self) -> dict[str, Any]:
        return {}  # nothing of its own: the checkpoint restores the rest

    # ------------------------------------------------------------ internals

    def make_checkpointer(self) -> Checkpointer:
        return Checkpointer(
            every=self.save_every, persist_every=self.persist_every, persist_dir=self.persist_dir
        )

    def _close(self) -> None:
        """The fit ends (or failed): its Checkpointer closes, unless it is kept."""
        if self.checkpointer is not None and self.checkpointer is not self.kept:
            self.checkpointer.close()  # persists the newest step, when persisting
        self.checkpointer = None

    def _save(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *, force: bool = False
    ) -> None:
        if self.checkpointer is None:
            return
        connector = trainer._checkpoint_connector
        self.checkpointer.save(
            trainer.global_step,
            lambda: {STATE_KEY: connector.dump_checkpoint(weights_only=False)},
            overlap=(pl_module, *trainer.optimizers),
            force=force,
        )
        self._last_saved = trainer.global_step


class DLFleetTrainer(pl.Trainer):
    """`pl.Trainer` with dlfleet's adapters added (`DLFleetEnvironment`, and
    `DLFleetCheckpoint` with `save_every`, `persist_every`, `persist_dir`,
    unless the lists given hold their own), whose `fit` restarts in place
    under dlworker, as a script in `dlfleet.elastic.run` does: when a rank
    fails or the world changes, the surviving processes leave the round and
    fit again in the next one, restored from memory, with the interpreter,
    imports and model kept; a spare process (the script run up to `fit`,
    waiting) takes a dead rank. Elsewhere (torchrun, no launcher) `fit` is
    Lightning's own."""

    def __init__(
        self,
        *args: Any,
        save_every: int | str = "auto",
        persist_every: int = 0,
        persist_dir: str | Path | None = None,
        **kwargs: Any,
    ) -> None:
        plugins = _listed(kwargs.pop("plugins", None))
        if not any(isinstance(plugin, ClusterEnvironment) for plugin in plugins):
            plugins.append(DLFleetEnvironment())
        callbacks = _listed(kwargs.pop("callbacks", None))
        given = [c for c in callbacks if isinstance(c, DLFleetCheckpoint)]
        self._fleet = (
            given[0]
            if given
            else DLFleetCheckpoint(
                save_every=save_every, persist_every=persist_every, persist_dir=persist_dir
            )
        )
        if not given:
            callbacks.append(self._fleet)
        super().__init__(*args, plugins=plugins, callbacks=callbacks, **kwargs)

    def fit(
        self,
        model: pl.LightningModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: pl.LightningDataModule | None = None,
        ckpt_path: str | Path | None = None,
        weights_only: bool | None = None,
    ) -> None:
        """Lightning's `fit`; under dlworker once per round (see the class)."""
        if not os.environ.get(AGENT_ENV):
            super().fit(
                model, train_dataloaders, val_dataloaders, datamodule, ckpt_path, weights_only
            )
            return

        def attempt(current: elastic.Attempt) -> None:
            self._join_round()
            # A loader belongs to one round (its ranks are read when it is
            # made): renewed for this one, at the position the restore gives.
            if isinstance(train_dataloaders, ShardedDataLoader):
                train_dataloaders.renew()
            super(DLFleetTrainer, self).fit(
                model, train_dataloaders, val_dataloaders, datamodule, ckpt_path, weights_only
            )

        # One Checkpointer for every round, as a script in `elastic.run` keeps
        # its own: closed per round, it would persist its last step as the
        # aborted fit tears down, and wait there for the parts of ranks that
        # are gone (a dead rank of another node) while the round moves on.
        with self._fleet.make_checkpointer() as kept:
            self._fleet.kept = kept
            try:
                elastic.run(attempt)
            finally:
                self._fleet.kept = None

    def _join_round(self) -> None:
        """Lightning's ranks and node count for this round's world: the
        environment `elastic.run` set (a spare made its Trainer in a world of
        its own, a survivor in the round before); the process group is the
        round's, set up by `elastic.run`, which Lightning takes as it is."""
        strategy = self.strategy
        environment = getattr(strategy, "cluster_environment", None)
        if isinstance(environment, DLFleetEnvironment) and hasattr(strategy, "num_nodes"):
            strategy.num_nodes = environment.num_nodes()
        set_world_ranks = getattr(strategy, "set_world_ranks", None)
        if callable(set_world_ranks):
            set_world_ranks()


def _listed(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _follow_the_round(trainer: pl.Trainer) -> None:
    """Lightning keeps the `num_nodes` it was given; the round's count is what
    its samplers (validation) and world arithmetic must use."""
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if isinstance(environment, DLFleetEnvironment) and hasattr(trainer.strategy, "num_nodes"):
        trainer.strategy.num_nodes = environment.num_nodes()


def _sharded_loaders(trainer: pl.Trainer) -> list[ShardedDataLoader]:
    loaders = trainer.train_dataloader
    found = loaders if isinstance(loaders, (list, tuple)) else [loaders]
    if isinstance(loaders, dict):
        found = list(loaders.values())
    return [loader for loader in found if isinstance(loader, ShardedDataLoader)]


__all__ = ["STATE_KEY", "DLFleetCheckpoint", "DLFleetEnvironment"]
