"""Hugging Face `Trainer` on dlfleet: exactly-once data and checkpoints in
memory, by changing one line.

    from dlfleet.integrations.hf import DLFleetTrainer

    trainer = DLFleetTrainer(model=model, args=args, train_dataset=dataset,
                             data_collator=collator)          # was: Trainer(...)
    trainer.train()

What changes under the subclass:
- The train dataloader is a `ShardedDataLoader` (sync mode: the round leases
  the dataset's shards; each rank takes its slice of every global batch). It
  is not given to `accelerator.prepare`, which would split its batches a
  second time, and HF's data skipping on resume is off: the loader's own
  state says which records the model has seen. Its epochs are the run's
  (`num_train_epochs`, or the epochs `max_steps` takes in the largest world
  the job may have: the master's node count at most times a node's
  processes, so that a world that grows does not run out of data; a smaller
  one stops at `max_steps` with data left), registered once for the job.
- Optimizer steps are checkpointed through `dlfleet.Checkpointer` (model,
  optimizer, scheduler, grad scaler, the random generators, HF's
  `TrainerState` and the loader) as often as `save_every` says ("auto": as
  keeps the saves under 1% of the training time), the parameters and
  optimizer state copied while the next step's forward and backward run.
  `train()` first restores the newest step every rank saved: from this
  node's memory, a peer node's replica, or disk. HF's counters (global step,
  epoch, logged loss since the restore, `train_loss` of this call) continue
  from there as after HF's own resume.
- HF's own `save_steps` folders keep working, and carry the loader's state
  (`dlfleet_loader.pt`): `train(resume_from_checkpoint=...)` from one of them
  resumes the data exactly too, when dlfleet holds no newer step.
- A rank that gets no records in the last step of a resumed epoch trains a
  padding batch (a record another rank trains in that step) with a zero
  gradient, as the loader's `pad_empty` describes.

Under dlworker `train()` restarts in place (`dlfleet.elastic.run`): a peer's
failure or a changed world ends the round, the surviving processes train in
the next one restored from memory, and a spare process takes a dead rank.
Under torchrun with the dlfleet rendezvous, torchrun restarts the workers
cold and they restore from the node's memory; under plain torchrun (no
master) the loader slices by rank with a warning and only persisted steps
can be restored.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from accelerate.state import AcceleratorState, GradientState  # type: ignore[import-untyped]
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from dlfleet.api.env import AGENT_ENV
from dlfleet.worker import elastic
from dlfleet.worker.checkpoint.checkpointer import Checkpointer, Restored
from dlfleet.worker.loader import ShardedDataLoader
from dlfleet.worker.loader.padding import zero_weight

from .common import epochs_for_steps, largest_world, rng_state, set_rng_state

LOADER_FILE = "dlfleet_loader.pt"  # the loader's state in HF's checkpoint folders


class PaddingBatch(dict[str, Any]):
    """A batch that holds no record of this rank (see the loader's
    `pad_empty`): its loss gets a zero gradient. HF keeps a batch's type
    when it moves it to the device, so the mark reaches `compute_loss`."""


class TrainBatches:
    """The loader as HF's train dataloader: one epoch (or its rest) an
    iteration, padding batches marked."""

    def __init__(self, loader: ShardedDataLoader) -> None:
        self.loader = loader
        self.dataset = loader.dataset
        self.batch_size = loader.batch_size

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield self._marked(batch)

    def _marked(self, batch: Any) -> Any:
        if not self.loader.padding:
            return batch
        if isinstance(batch, Mapping):
            return PaddingBatch(batch)
        raise TypeError(
            "DLFleetTrainer needs batches that are mappings (a data collator's dict); "
            f"got {type(batch).__name__}"
        )

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        del epoch  # the master decides the data's epochs


class DLFleetTrainer(Trainer):
    """`transformers.Trainer` whose data comes from dlfleet's master and whose
    every step is checkpointed in memory (see the module's docstring).

    Extra keyword arguments: `persist_every` (steps between the persisted
    copies of dlfleet's checkpoint, in torch.distributed.checkpoint format
    under `persist_dir`, default `$DLFLEET_WORKDIR/checkpoints`; 0: never,
    HF's own folders still are written), and `dataset_name` (the dataset's
    name in the job: the default names it by its class)."""

    def __init__(
        self,
        *args: Any,
        save_every: int | str = "auto",
        persist_every: int = 0,
        persist_dir: str | Path | None = None,
        dataset_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.save_every = save_every
        # The loader resumes itself; skipping batches would skip them twice.
        self.args.ignore_data_skip = True
        self.persist_every = persist_every
        self.persist_dir = persist_dir
        self.dataset_name = dataset_name
        self.checkpointer: Checkpointer | None = None
        self.loader: ShardedDataLoader | None = None
        self.restored: Restored | None = None
        self._resume_folder: str | None = None
        self._loader_state: dict[str, Any] | None = None  # the loader's position to resume
        self._epoch_offset = (0, 0.0)  # (epoch restored into, fraction of it done then)
        self._state_json = _StateJson()
        self.add_callback(_SaveEveryStep(self))

    # ---------------------------------------------------------------- train

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """HF's `train`, after restoring the newest step dlfleet holds.

        Under dlworker it restarts in place (`dlfleet.elastic.run`): when the
        world changes or a peer fails, this process leaves the round and
        trains again in the next one, restored from memory, without a cold
        start; a spare process (the script run up to here, waiting) takes
        over a dead rank."""

        def attempt(current: elastic.Attempt | None) -> Any:
            if current is not None and current.in_process:
                self._join_round()
            return self._train_attempt(resume_from_checkpoint, trial, ignore_keys_for_eval, kwargs)

        with Checkpointer(
            every=self.save_every, persist_every=self.persist_every, persist_dir=self.persist_dir
        ) as ckpt:
            self.checkpointer = ckpt
            try:
                if os.environ.get(AGENT_ENV):
                    return elastic.run(attempt)
                return attempt(None)
            finally:
                self.checkpointer = None

    def _train_attempt(
        self,
        resume_from_checkpoint: str | bool | None,
        trial: Any,
        ignore_keys_for_eval: list[str] | None,
        kwargs: dict[str, Any],
    ) -> Any:
        assert self.checkpointer is not None
        self.restored = self.checkpointer.load()
        if self.restored is not None:
            resume_from_checkpoint = None  # dlfleet's step is the newest
        elif resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)  # type: ignore[no-untyped-call]
            if resume_from_checkpoint is None:
                raise ValueError(f"no checkpoint found in {self.args.output_dir}")
        self._resume_folder = (
            resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
        )
        try:
            return super().train(
                resume_from_checkpoint=resume_from_checkpoint,
                trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval,
                **kwargs,
            )
        finally:
            if self.loader is not None:
                self.loader.close()
                self.loader = None

    def _join_round(self) -> None:
        """Make HF and Accelerate see this round's world: the process group
        `elastic.run` set up (a spare made its TrainingArguments alone, a
        survivor in the world of the round before). Their state is built
        anew from it; the model stays, unwrapped, and the optimizer and
        scheduler are taken out of the previous round's wrappers (their
        state is restored from the checkpoint)."""
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        self.args.__dict__.pop("_setup_devices", None)  # a cached_property
        self.args.distributed_state = None
        device = self.args.device  # a PartialState on the round's group
        self.create_accelerator_and_postprocess()
        self.model_wrapped = self._module()
        if self.place_model_on_device:
            self._move_model_to_device(self._module(), device)
        if self.optimizer is not None:
            self.optimizer = _inner_optimizer(self.optimizer)
        self.lr_scheduler = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)

    def get_train_dataloader(self) -> Any:
        if self.train_dataset is None:
            raise ValueError("DLFleetTrainer: training requires a train_dataset")
        if self.loader is not None:
            self.loader.close()
        dataset: Any = self.train_dataset
        collator = self.data_collator
        if _is_hf_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        args = self.args
        records = len(dataset)
        if args.max_steps > 0:
            epochs = epochs_for_steps(
                args.max_steps,
                records,
                self._train_batch_size,
                largest_world(args.world_size),
                args.gradient_accumulation_steps,
            )
        else:
            epochs = max(int(-(-args.num_train_epochs // 1)), 1)
        loader = ShardedDataLoader(
            dataset,
            self._train_batch_size,
            shuffle=True,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            epochs=epochs,
            drop_last=args.dataloader_drop_last,
            name=self.dataset_name,
            num_workers=args.dataloader_num_workers,
            collate_fn=collator,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers
            and args.dataloader_num_workers > 0,
            pad_empty=True,
        )
        self._loader_state = None
        if self.restored is not None:
            self._loader_state = self.restored.state["loader"]
        elif self._resume_folder is not None:
            saved = Path(self._resume_folder) / LOADER_FILE
            if saved.exists():
                self._loader_state = torch.load(saved, weights_only=False)
        if self._loader_state is not None:
            loader.load_state_dict(self._loader_state)
        self.loader = loader
        return TrainBatches(loader)

    # The two hooks of HF's loop that a restore from dlfleet's checkpoint
    # fills: the trainer's state (before the epochs are counted), then the
    # optimizer's, scheduler's and generators' (once they exist).

    def _init_training_state(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        epochs_trained, steps_in_epoch = super()._init_training_state(*args, **kwargs)
        if self.restored is None:
            if self._loader_state is not None and self.loader is not None:
                # HF's folder: HF counts epochs by the steps of this world size,
                # the loader knows which epoch its records come from.
                return self.loader.resumes_in_epoch(self._loader_state), 0
            return epochs_trained, steps_in_epoch
        max_steps, _, num_train_epochs, _, trial = args
        state = TrainerState(**json.loads(self.restored.state["trainer_state"]))
        state.compute_steps(self.args, max_steps)  # type: ignore[no-untyped-call]
        self.state = state
        self._load_callback_state()
        self.state.init_training_references(  # type: ignore[no-untyped-call]
            self, max_steps, num_train_epochs, trial
        )
        # The epoch the loader resumes in, and how much of it was trained.
        assert self.loader is not None
        epoch = self.loader.resumes_in_epoch(self.restored.state["loader"])
        self._epoch_offset = (epoch, max(float(state.epoch or 0.0) - epoch, 0.0))
        return epoch, 0

    def _prepare_for_training(self, *args: Any, **kwargs: Any) -> Any:
        prepared = super()._prepare_for_training(*args, **kwargs)  # type: ignore[no-untyped-call]
        optimizer = _inner_optimizer(self.optimizer)
        if self.restored is not None:
            saved = self.restored.state
            set_state_dict(
                self._module(),
                optimizer,
                model_state_dict=saved["model"],
                optim_state_dict=saved["optimizer"],
            )
            if self.lr_scheduler is not None and "scheduler" in saved:
                self.lr_scheduler.load_state_dict(saved["scheduler"])
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None and "scaler" in saved:
                scaler.load_state_dict(saved["scaler"])
            set_rng_state(saved["rng"])
            if self.is_world_process_zero():
                print(
                    f"dlfleet: resumed at step {self.restored.step} from {self.restored.source} "
                    f"(world size {self.args.world_size})",
                    flush=True,
                )
        else:
            # The starting point as a checkpoint too: a failure before the
            # first step every rank saved rolls the data back with the model.
            self.save_dlfleet_checkpoint()
        return prepared

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        result = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        if isinstance(inputs, PaddingBatch):
            zero_weight(result[0] if isinstance(result, tuple) else result)
        return result

    # ----------------------------------------------------------- checkpoint

    def save_dlfleet_checkpoint(self, *, force: bool = False) -> None:
        """Checkpoint the step just taken (HF's `global_step`), on every rank,
        when `save_every` says it is due (always with `force`)."""
        if self.checkpointer is None or self.loader is None:
            return
        optimizer = _inner_optimizer(self.optimizer)
        self.checkpointer.save(
            self.state.global_step,
            self._dlfleet_state,
            overlap=(self._module(), optimizer),
            force=force,
        )

    def _dlfleet_state(self) -> dict[str, Any]:
        """What a step's checkpoint holds (built only for the steps saved)."""
        assert self.loader is not None
        optimizer = _inner_optimizer(self.optimizer)
        model_state, optimizer_state = get_state_dict(self._module(), optimizer)
        state: dict[str, Any] = {
            "model": model_state,
            "optimizer": optimizer_state,
            "trainer_state": self._state_json.dumps(self.state),
            "rng": rng_state(),
            "loader": self.loader.state_dict(),
        }
        if self.lr_scheduler is not None:
            state["scheduler"] = self.lr_scheduler.state_dict()
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler.state_dict()
        return state

    def _module(self) -> nn.Module:
        if not isinstance(self.model, nn.Module):
            raise ValueError("DLFleetTrainer: training requires a model")
        return self.model

    def _fix_epoch(self, state: TrainerState) -> None:
        """HF counts the resumed epoch's fraction from the restore: add what
        was trained of it before (the rest of it has as many steps at the new
        world size as HF's count expects)."""
        epoch, done = self._epoch_offset
        if done and state.epoch is not None and state.epoch < epoch + 1:
            state.epoch = min(state.epoch + done, float(epoch + 1))


class _SaveEveryStep(TrainerCallback):
    def __init__(self, trainer: DLFleetTrainer) -> None:
        self.trainer = trainer

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self.trainer._fix_epoch(state)
        self.trainer.save_dlfleet_checkpoint()

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """The step training ends with is kept, whatever the interval."""
        self.trainer.save_dlfleet_checkpoint(force=True)

    def on_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """HF wrote its folder: the loader's state goes beside its files."""
        loader = self.trainer.loader
        if loader is None:
            return
        folder = Path(args.output_dir or ".") / f"checkpoint-{state.global_step}"
        if folder.is_dir() and self.trainer.is_world_process_zero():
            torch.save(loader.state_dict(), folder / LOADER_FILE)


class _StateJson:
    """HF's `TrainerState` as JSON, as `TrainerState.save_to_json` writes it.
    Its `log_history` grows by a line per logging step and its past lines
    do not change: they are encoded once, not at every save."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._encoded: list[Any] = []  # the entries `_lines` encode

    def dumps(self, state: TrainerState) -> str:
        history = state.log_history
        known = len(self._encoded)
        if len(history) < known or any(
            a is not b for a, b in zip(history[:known], self._encoded, strict=True)
        ):
            self._lines, self._encoded, known = [], [], 0  # replaced or cut: again
        for entry in history[known:]:
            self._lines.append(json.dumps(entry, sort_keys=True))
            self._encoded.append(entry)
        fields = {
            f.name: getattr(state, f.name)
            for f in dataclasses.fields(state)
            if f.name != "log_history"
        }
        rest = json.dumps(fields, sort_keys=True)
        history_json = "[" + ", ".join(self._lines) + "]"
        return rest[:-1] + f', "log_history": {history_json}}}'


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under Accelerate's wrapper."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"DLFleetTrainer cannot checkpoint an optimizer of {type(inner).__name__}")
    return inner


def _is_hf_dataset(dataset: Any) -> bool:
    return type(dataset).__module__.startswith("datasets.") and hasattr(dataset, "column_names")


__all__ = ["LOADER_FILE", "DLFleetTrainer", "PaddingBatch", "TrainBatches"]
