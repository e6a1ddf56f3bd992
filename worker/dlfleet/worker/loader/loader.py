"""`ShardedDataLoader`: a `torch.utils.data.DataLoader` fed by dlfleet shards.

Why: under an elastic job, which records a rank trains must come from the
master, so that a round of W ranks and the next round of W' ranks together
train every record of every epoch exactly once, and a checkpoint can say which
records its model has seen. The loader wraps a real DataLoader with a batch
sampler fed by those shards, so num_workers, collate_fn, pin_memory and
persistent_workers keep working.

Modes (decided once, at construction):
- sync (default under dlfleet): shards are leased to the rendezvous round
  (DLFLEET_ROUND); every rank asks for position 0, 1, 2, ... and gets the same
  shards, cut into global batches of `batch_size * world_size` records, of
  which rank r takes its slice. All ranks yield the same number of batches per
  epoch, by construction (see slicing.py for the tail rule).
- async (`mode="async"`): each rank leases whole shards for itself; fast ranks
  take more. For evaluation and independent consumers, not for DDP.
- local (no DLFLEET_MASTER: plain torchrun, not dlworker or torchrun with
  `--rdzv-backend=dlfleet`, which both set it): a warning, then the same
  slicing over the seeded permutation of each epoch, no master involved.

Datasets: any map-style dataset, positions mapped to records by the epoch's
`EpochPermutation`; a dataset that decides its own epoch order
(`indexing.OrderedDataset`: a `FileCatalog` of streamed files, which visits
blocks of files in a seeded order) is mapped by that order instead. When that
order is read in blocks (`indexing.ReadOrder`), a global batch is split
between ranks by block, not by position (slicing.py), so that in sync mode a
rank reads about the blocks it trains, not every block of the round's.

Invariants:
- `__iter__` yields one epoch; iterating again continues with the next epoch,
  until the dataset's `epochs` are done (then iterations are empty).
- A batch counts as trained once the loop asks for the next one (or calls
  `state_dict`, or iterates again after a `break`); only then are its records
  acked or counted in a snapshot.
- `load_state_dict` must come before the first iteration of the process:
  in sync mode it restores the master's progress for this round before the
  round's first lease, so the round's positions start at 0 after it.
- With num_workers > 0 and a master, worker processes start from a
  forkserver unless `multiprocessing_context` says otherwise: forking a
  process whose gRPC threads are live is unsafe. The dataset must pickle.
- The constructor does no I/O; the master is first contacted on the first
  iteration, `state_dict` or `load_state_dict`.

Empty batches: a rank gets no records of a global batch only when its round
received fewer positions of an epoch than there are ranks (see slicing.py).
By default such a rank gets an empty list, and the script must still take
part in the step's collectives. Training frameworks (Hugging Face `Trainer`,
Lightning) cannot step on an empty list: with `pad_empty=True` such a rank
gets a *padding* batch instead, one record that another rank trains in the
same step, collated as usual, and `loader.padding` is True until the next
batch. The step must then weight it zero (`dlfleet.zero_weight(loss)`, which
the framework integrations call): its gradient is zero, so the step's
gradient comes from the other ranks' records alone, and the record is trained
once. The padding record is no part of this rank's progress or of a snapshot.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, default_collate

from dlfleet.api.client import MasterClient
from dlfleet.api.env import MASTER_ENV, ROUND_ENV
from dlfleet.api.epochs import cut, epoch_length, require_records
from dlfleet.api.errors import InvalidArgument, NotFound
from dlfleet.api.permutation import EpochPermutation
from dlfleet.api.v1 import shards_pb2
from dlfleet.worker import elastic, progress
from dlfleet.worker.loader.environment import LoaderEnvironment, LoaderMode
from dlfleet.worker.loader.indexing import (
    OrderedDataset,
    PositionIndexer,
    PositionOrder,
    ReadOrder,
)
from dlfleet.worker.loader.slicing import (
    GlobalBatch,
    batches_per_epoch,
    rank_bounds,
    share_key,
    shuffle_share,
)
from dlfleet.worker.loader.streams import EpochStream, LeasedStream, LocalStream

MAX_NAME_LENGTH = 200
# Spec fields that must agree with an earlier registration. batch_size and
# shard_size may differ: a later round with another world size registers a
# different global batch, and positions mean the same either way.
_MUST_MATCH = ("size", "epochs", "shuffle", "seed", "drop_last")


class ShardedDataLoader:
    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        epochs: int = 1,
        shard_size: int = 0,
        drop_last: bool = False,
        name: str | None = None,
        mode: str | None = None,
        environment: LoaderEnvironment | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        pad_empty: bool = False,
        **dataloader_kwargs: Any,
    ) -> None:
        if batch_size < 1:
            raise InvalidArgument(f"batch_size must be at least 1, got {batch_size}")
        _require_map_style(dataset)
        # What `renew` makes it from again.
        self._made_with: dict[str, Any] = {
            "dataset": dataset,
            "batch_size": batch_size,
            "shuffle": shuffle,
            "seed": seed,
            "epochs": epochs,
            "shard_size": shard_size,
            "drop_last": drop_last,
            "name": name,
            "mode": mode,
            "environment": environment,
            "num_workers": num_workers,
            "collate_fn": collate_fn,
            "pin_memory": pin_memory,
            "persistent_workers": persistent_workers,
            "pad_empty": pad_empty,
            **dataloader_kwargs,
        }
        self.dataset = dataset
        self.size = len(dataset)  # type: ignore[arg-type]
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epochs = epochs
        self.shard_size = shard_size
        self.drop_last = drop_last
        self.name = name or _default_name(dataset)
        require_records(self.name, self.size)  # with a master or without
        self.env = environment or LoaderEnvironment.detect()
        self.mode = _decide_mode(mode, self.env)
        world = self.env.world_size if self.mode is not LoaderMode.ASYNC else 1
        self.global_batch = batch_size * world
        self._world = world
        self._rank = self.env.rank if self.mode is not LoaderMode.ASYNC else 0
        self._round = self.env.round if self.mode is LoaderMode.SYNC else 0
        if self.mode is LoaderMode.LOCAL:
            # Without a master the loader applies the master's rule itself.
            self._epoch_length = epoch_length(self.name, self.size, self.global_batch, drop_last)
        else:
            # The master applies it when the dataset is registered (the first
            # iteration); its first registration's cut holds for later worlds.
            self._epoch_length = cut(self.size, self.global_batch, drop_last)
        self._client: MasterClient | None = None
        self._registered = False
        self._pending_restore: shards_pb2.DatasetSnapshot | None = None
        # (epoch, its order, the order again if it is read in blocks and
        # more than one rank splits each batch)
        self._permutation: tuple[int, PositionOrder, ReadOrder | None] | None = None
        self.stream: EpochStream
        if self.mode is LoaderMode.LOCAL:
            self.stream = LocalStream(self._epoch_length, epochs, self.global_batch, world)
        self.pad_empty = pad_empty
        # Whether each batch the sampler handed the DataLoader (and the loop
        # has not received yet) is padding, in the order the DataLoader
        # yields them (it keeps the sampler's order, with workers too).
        self._padding_ahead: collections.deque[bool] = collections.deque()
        self.padding = False  # the batch last yielded is padding (pad_empty)
        self._sampler = _StreamBatchSampler(self)
        if num_workers > 0 and self.mode is not LoaderMode.LOCAL:
            # The lease thread and gRPC's threads run while the DataLoader
            # starts its workers; a fork() then can crash the child in
            # gRPC's or Python's after-fork handlers. Fork from a clean server.
            dataloader_kwargs.setdefault("multiprocessing_context", "forkserver")
        self._loader = DataLoader(
            dataset,
            batch_sampler=self._sampler,
            num_workers=num_workers,
            collate_fn=_EmptySafeCollate(collate_fn),
            pin_memory=pin_memory,
            persistent_workers=persistent_workers,
            **dataloader_kwargs,
        )
        # Inside `dlfleet.elastic.run`: a loader belongs to one attempt (one
        # round); its lease thread and workers end with it.
        elastic.on_attempt_end(self.close)
        progress.announce()  # steps are reported: an error before the first is the script's

    # ---------------------------------------------------------------- API

    def __iter__(self) -> Iterator[Any]:
        stream = self._start()
        stream.begin_iteration()
        self.padding = False
        if stream.dataset_ended:
            return
        self._padding_ahead.clear()
        inner = iter(self._loader)
        try:
            while True:
                # Asking for the next batch means the step of the last one is done.
                stream.complete_received()
                try:
                    batch = next(inner)
                except StopIteration:
                    break
                stream.received()
                self.padding = bool(self._padding_ahead) and self._padding_ahead.popleft()
                progress.step(self.batch_size)  # the agent's watchdog and node metrics
                elastic.check()  # the agent ended the round: leave between steps
                yield batch
            stream.end_iteration()
        finally:
            progress.idle()  # between epochs, or after a break: not a hang

    def __len__(self) -> int:
        """Batches per rank in a full epoch (a resumed epoch yields fewer)."""
        if self.mode is LoaderMode.ASYNC:
            raise TypeError("an async ShardedDataLoader has no length: fast ranks take more")
        return batches_per_epoch(self._epoch_length, self.global_batch, self._world)

    def set_epoch(self, epoch: int) -> None:
        """Accepted for DistributedSampler compatibility; epochs come from the
        master (or from iterating again) instead."""
        del epoch

    @property
    def epoch(self) -> int:
        return max(self.stream.epoch, 0) if hasattr(self, "stream") else 0

    def state_dict(self) -> dict[str, Any]:
        """Progress as of the last batch the loop received (call it between
        steps, after the step that trained that batch)."""
        if self.mode is LoaderMode.LOCAL:
            assert isinstance(self.stream, LocalStream)
            return {"mode": self.mode.value, "dataset": self.name, **self.stream.state()}
        stream = self._leased_stream()
        snapshot = stream.snapshot()
        return {
            "mode": self.mode.value,
            "dataset": self.name,
            "epoch": snapshot.epoch,
            "snapshot": snapshot.SerializeToString(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state`: before the first iteration of this process."""
        if state.get("mode") != self.mode.value:
            raise InvalidArgument(
                f"a {state.get('mode')!r} loader state cannot resume a {self.mode.value!r} loader"
            )
        if state.get("dataset", self.name) != self.name:
            # E.g. a file catalog whose files changed: its numbering is another.
            raise InvalidArgument(
                f"the state is of dataset {state['dataset']!r}, this loader's is {self.name!r}"
            )
        if self.mode is LoaderMode.LOCAL:
            assert isinstance(self.stream, LocalStream)
            self.stream.restore(state)
            return
        stream = self._leased_stream()
        if stream.started:
            raise InvalidArgument("load_state_dict must be called before iterating the loader")
        self._pending_restore = shards_pb2.DatasetSnapshot.FromString(state["snapshot"])

    def resumes_in_epoch(self, state: dict[str, Any]) -> int:
        """The epoch whose records come first after `load_state_dict(state)`:
        the state's own, or the next one when all of the state's epoch was
        trained (a checkpoint of an epoch's last step: the first iteration
        then yields the next epoch). For a framework that numbers its epochs
        itself."""
        epoch = int(state.get("epoch", 0))
        if self.mode is LoaderMode.LOCAL:
            whole = int(state.get("batches", 0)) >= len(self)
            return epoch + 1 if whole else epoch
        snapshot = shards_pb2.DatasetSnapshot.FromString(state["snapshot"])
        if snapshot.finished:
            return self.epochs
        self._leased_stream()  # registered: the epoch's cut is the master's
        done = sum(r.end - r.start for r in snapshot.done)
        return epoch + 1 if done >= self._epoch_length else epoch

    def close(self) -> None:
        # Persistent DataLoader workers would otherwise live until garbage
        # collection joins them, at an arbitrary point of the program.
        workers = getattr(self._loader, "_iterator", None)
        if workers is not None and hasattr(workers, "_shutdown_workers"):
            workers._shutdown_workers()
            self._loader._iterator = None
        if hasattr(self, "stream") and isinstance(self.stream, LeasedStream):
            self.stream.close()
        if self._client is not None:
            self._client.close()
            self._client = None

    def renew(self) -> None:
        """Make this loader the current round's, as if made again now with
        the same arguments (its previous round's lease thread and workers
        closed). A loader reads its ranks and round when it is made, so one
        made before a restart in place (a script's, handed to a trainer that
        restarts in place: `dlfleet.integrations.lightning.DLFleetTrainer`)
        would lease for a world that is gone; renewed, the same object serves
        the next round, from the position its `load_state_dict` is then given."""
        self.close()
        ShardedDataLoader.__init__(self, **self._made_with)

    def __enter__(self) -> ShardedDataLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------- internals

    def rank_batch(self, batch: GlobalBatch) -> list[int]:
        """The indices this rank's DataLoader fetches for `batch`: its slice,
        or (`pad_empty`, an empty slice) one record of another rank's."""
        indices = self.rank_slice(batch)
        padding = not indices and self.pad_empty
        if padding:
            indices = next(
                found[:1]
                for found in (self.rank_slice(batch, r) for r in range(self._world))
                if found
            )
        self._padding_ahead.append(padding)
        return indices

    def rank_slice(self, batch: GlobalBatch, rank: int | None = None) -> list[int]:
        """The record indices of `rank`'s slice of `batch` (this rank's by default)."""
        rank = self._rank if rank is None else rank
        order, read_order = self._indexer(batch.epoch)
        if read_order is None:
            return order.ranges(batch.rank_ranges(rank, self._world))
        # Split by block: this rank's run of the batch's records in read
        # order, then shuffled, so that its batch is not sorted by block.
        records = read_order.in_read_order(batch.runs())
        lo, hi = rank_bounds(len(records), rank, self._world)
        key = share_key(self.seed, batch.epoch, self._round, batch.first)
        return shuffle_share(records[lo:hi], key)

    def _indexer(self, epoch: int) -> tuple[PositionOrder, ReadOrder | None]:
        if self._permutation is None or self._permutation[0] != epoch:
            order: PositionOrder
            if isinstance(self.dataset, OrderedDataset):
                # A file catalog reads blocks of files in order: its own
                # block-level shuffle (see files/order.py).
                order = self.dataset.epoch_order(self.seed, epoch, self.shuffle)
            else:
                order = PositionIndexer(EpochPermutation(self.size, self.seed, epoch, self.shuffle))
            # One rank takes whole batches: nothing to split.
            split = order if self._world > 1 and isinstance(order, ReadOrder) else None
            self._permutation = (epoch, order, split)
        return self._permutation[1], self._permutation[2]

    def _start(self) -> EpochStream:
        if self.mode is LoaderMode.LOCAL:
            return self.stream
        stream = self._leased_stream()
        if not stream.started:
            if self._pending_restore is not None:
                assert self._client is not None
                self._client.restore(self._pending_restore, round=self.env.round)
                self._pending_restore = None
                stream.forget_base()
            stream.start()
        return stream

    def _leased_stream(self) -> LeasedStream:
        """Connect and register once per process; the stream of this mode."""
        if not self._registered:
            assert self.env.master is not None
            if self.mode is LoaderMode.SYNC and self.env.round < 1:
                raise InvalidArgument(
                    f"a sync ShardedDataLoader needs {ROUND_ENV} >= 1 (set by dlworker)"
                )
            self._client = MasterClient(self.env.master, token=self.env.token)
            self._register(self._client)
            self.stream = LeasedStream(
                self._client,
                self.name,
                self.env,
                self.mode,
                self.global_batch,
                self._world,
                epoch_length=self._epoch_length,
                epochs=self.epochs,
            )
            self._registered = True
        assert isinstance(self.stream, LeasedStream)
        return self.stream

    def _register(self, client: MasterClient) -> None:
        spec = shards_pb2.DatasetSpec(
            name=self.name,
            size=self.size,
            batch_size=self.global_batch,
            shard_size=self.shard_size,
            epochs=self.epochs,
            shuffle=self.shuffle,
            seed=self.seed,
            drop_last=self.drop_last,
        )
        try:
            status = client.register_dataset(spec).status
        except InvalidArgument as conflict:
            try:
                status = client.dataset_status(self.name)
            except NotFound:
                raise conflict from None
            diff = [f for f in _MUST_MATCH if getattr(status.spec, f) != getattr(spec, f)]
            if diff:
                raise InvalidArgument(
                    f"dataset {self.name!r} is registered with a different "
                    + ", ".join(f"{f} ({getattr(status.spec, f)!r})" for f in diff)
                    + "; pass another name= for another dataset"
                ) from None
        # The first registration decides where the epoch is cut (drop_last).
        self._epoch_length = status.records_per_epoch


class _StreamBatchSampler(Sampler[list[int]]):
    """The DataLoader's batch sampler: this rank's record indices of each
    global batch of the loader's stream. Runs in the main process."""

    def __init__(self, loader: ShardedDataLoader) -> None:
        self._loader = loader

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self._loader.stream.batches():
            yield self._loader.rank_batch(batch)

    def __len__(self) -> int:
        return len(self._loader)


class _EmptySafeCollate:
    """The user's collate_fn (default: torch's), except that a rank's empty
    batch stays an empty list; see slicing.py for when a rank gets none."""

    def __init__(self, inner: Callable[[list[Any]], Any] | None) -> None:
        self._inner = inner

    def __call__(self, batch: list[Any]) -> Any:
        if not batch:
            return []
        if self._inner is None:
            return default_collate(batch)
        return self._inner(batch)


def _decide_mode(mode: str | None, env: LoaderEnvironment) -> LoaderMode:
    if mode not in (None, "sync", "async"):
        raise InvalidArgument(f"mode must be 'sync' or 'async', got {mode!r}")
    if env.master is None:
        warnings.warn(
            f"ShardedDataLoader: no dlfleet master ({MASTER_ENV} is unset): the script was "
            "started neither by dlworker nor by torchrun --rdzv-backend=dlfleet; each rank "
            "takes a rank-based slice of every epoch, and nothing promises exactly once "
            "across a restart or a changed world",
            stacklevel=3,
        )
        return LoaderMode.LOCAL
    return LoaderMode.ASYNC if mode == "async" else LoaderMode.SYNC


def _require_map_style(dataset: object) -> None:
    """Leases name records by position: a dataset must be indexed to be leased."""
    cls = type(dataset)
    if isinstance(dataset, IterableDataset):
        what = "a torch IterableDataset, which yields records but cannot fetch one by index"
    elif not (hasattr(cls, "__len__") and hasattr(cls, "__getitem__")):
        what = "without __len__ and __getitem__"
    else:
        return
    raise TypeError(
        f"ShardedDataLoader cannot lease {cls.__qualname__}, {what}: it leases records by "
        "index, so that each is trained once. For records streamed from files (JSON lines, "
        "Parquet, WebDataset tars, token files) use dlfleet.FileCatalog, read in order and "
        "leased exactly once (a stream without files: cut it into files once with "
        "dlfleet.write_jsonl_shards); otherwise a map-style Dataset with __len__ and "
        "__getitem__."
    )


def _default_name(dataset: Dataset[Any]) -> str:
    cls = type(dataset)
    name = f"{cls.__module__}.{cls.__qualname__}"
    # A dataset that can tell its contents apart (a file catalog: its files,
    # counts and block order) gets a name of its own per contents.
    fingerprint = getattr(dataset, "fingerprint", None)
    if isinstance(fingerprint, str):
        name = f"{cls.__qualname__}-{fingerprint}"
    return name[:MAX_NAME_LENGTH]
