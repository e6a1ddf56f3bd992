"""Images of one rank's state at one step: the writer, and the sources a restore reads.

The state dict is planned with DCP's own `DefaultSavePlanner`, locally and with
no collective: nested dicts are flattened the DCP way, plain tensors are whole
chunks, DTensors their local shard at its global offsets, anything else a
torch.save blob. Every rank keeps its own copy of replicated values; a restore
picks one, a persist writes only the `primary` one. Striped (`stripe`: this
rank's place among the ranks of its node), a large plain tensor is cut by rows
among the node's ranks instead: each keeps one part, so a save copies 1/n of
the replicated state per rank, and the node's images together hold it whole
(a restore reads the parts like DTensor shards; the agent keeps, and
replicates to a peer, every image of its node). DCP's own view of plain
tensors is that they are replicated; one that differs by rank (an RNG state)
is small, and small tensors are never cut.

Invariants of `ImageWriter` (see `files` for the layout):
- a slot holding the step named `protect` is never touched;
- a slot's header is removed before its body changes and written last, by
  rename, so a reader never sees half an image;
- the body files and their memory maps stay open across saves: a save of an
  unchanged size allocates nothing and faults no page, it only copies.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import math
import mmap
import os
import secrets
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from dlfleet.worker.checkpoint import files
from dlfleet.worker.checkpoint.errors import (
    CheckpointError,
    ImageChangedError,
    ImageFormatError,
    SlotError,
)
from dlfleet.worker.checkpoint.files import ImageHeader, ItemKind, ItemRecord
from dlfleet.worker.checkpoint.presence import Presence
from dlfleet.worker.checkpoint.slots import Held, choose, slot_count
from dlfleet.worker.checkpoint.structure import with_skeleton

StateDict = dict[str, Any]

# A plain tensor this large is cut among the ranks of a node when striping.
STRIPE_MIN_BYTES = 1 << 20
_GROWTH = 1 / 8  # spare room when a slot grows, so that small blobs can grow in place
# Of the widest element (complex128); Python's bytes and bytearray data are 16-aligned.
_ELEMENT_ALIGNMENT = 16


@dataclass(frozen=True)
class ImageFile:
    """Where `ImageWriter.write` put an image."""

    header_path: Path
    body_path: Path
    rank: int
    slot: int
    step: int
    round: int
    world_size: int
    nbytes: int  # of the body that belong to the image


def materialize(state_dict: Mapping[str, Any]) -> StateDict:
    """A shallow copy with each Stateful value replaced by its state_dict(), as dcp.save does."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ImageFormatError(f"unknown tensor dtype {name!r} in image header")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Stripe:
    """This rank's place among the ranks of its node (their global ranks are
    consecutive), for cutting large plain tensors among them."""

    local_rank: int
    local_world: int

    def rows(self, total: int) -> tuple[int, int]:
        """This rank's rows [start, end) of `total`, as torch.chunk would cut them."""
        per = -(-total // self.local_world)
        start = min(total, self.local_rank * per)
        return start, min(total, start + per)


@dataclass(frozen=True)
class _Planned:
    """One item of the plan, with the data to copy and its place in the body."""

    record: ItemRecord
    data: torch.Tensor | memoryview


class _Slot:
    """One body file of the writer and its memory map (mutable, owned by the writer)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.header: ImageHeader | None = None
        self.capacity = 0
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self.bytes: torch.Tensor | None = None  # uint8 view of the whole map
        self._pinned = False

    def ensure(self, nbytes: int, pin: bool) -> torch.Tensor:
        """The slot's bytes, at least `nbytes` of them, mapped (and pinned if asked)."""
        if self.bytes is not None and self.capacity >= nbytes:
            return self.bytes
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        size = os.fstat(self._fd).st_size
        if size < nbytes:
            size = _round_up(int(nbytes * (1 + _GROWTH)), 1 << 21)
            try:
                # Allocate now: a write into a tmpfs page that cannot be had is a SIGBUS.
                os.posix_fallocate(self._fd, 0, size)
            except OSError as e:
                raise CheckpointError(f"cannot allocate {size} bytes for {self.path}: {e}") from e
        self.unmap()
        self._map = mmap.mmap(self._fd, size)
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.capacity = size
        if pin and torch.cuda.is_available():
            # Pinned, the device-to-host copies of a save run at full speed and
            # asynchronously; unpinned, they still work, staged by the driver.
            status = _cudart().cudaHostRegister(self.bytes.data_ptr(), size, 0)
            self._pinned = int(status) == 0
        return self.bytes

    def unmap(self) -> None:
        if self.bytes is not None and self._pinned:
            _cudart().cudaHostUnregister(self.bytes.data_ptr())
        self._pinned = False
        self.bytes = None
        if self._map is not None:
            self._map.close()
            self._map = None

    def close(self) -> None:
        self.unmap()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class ImageWriter:
    """Writes the images of one rank into up to `slots` slots of a folder,
    chosen by the policy of `dlfleet.worker.checkpoint.slots`: the protected step and every
    newer image are kept while there is room; `memory_bytes` bounds how many
    slots images of the current size may take (never fewer than two)."""

    def __init__(
        self,
        directory: Path,
        rank: int,
        slots: int = 2,
        *,
        memory_bytes: int | None = None,
        pin_memory: bool = True,
        presence: bool = False,
    ) -> None:
        """With `presence`, the writer holds `rank`'s presence in the folder
        while it is open (see presence.py): the node's folder, shared by its
        ranks, then says whether this rank still lives."""
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        if slots < 1:
            raise ValueError(f"an image writer needs at least one slot, got {slots}")
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.rank = rank
        self._pin = pin_memory
        self._max_slots = slots
        self._memory_bytes = memory_bytes
        self._slots = [_Slot(directory / files.body_name(rank, s)) for s in range(slots)]
        self._blobs = BlobCache()
        self._plans = PlanCache()
        self._pending: PendingImage | None = None
        self._copier: ThreadPoolExecutor | None = None
        self._presence = Presence(directory, rank) if presence else None
        # A restarted worker finds the images of its predecessor: they may hold the
        # committed step, so they are adopted, never cleared.
        for image in files.list_images(directory, rank):
            slot = files.parse_name(image.header_path.name)
            if slot is not None and slot[1] < slots:
                self._slots[slot[1]].header = image.header

    def images(self) -> list[ImageFile]:
        """The complete images this writer's slots hold, oldest step first."""
        held = [(i, s.header) for i, s in enumerate(self._slots) if s.header is not None]
        return sorted((self._image_file(i, h) for i, h in held), key=lambda f: f.step)

    def background(self) -> ThreadPoolExecutor:
        """This writer's thread for its images' background copies (one
        image at a time), started with the first."""
        if self._copier is None:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="dlfleet-image-copy")
        return self._copier

    def has_room(self, step: int, protect: int | None) -> bool:
        """Whether an image of `step` would replace no image that may still
        be restored (see `dlfleet.worker.checkpoint.slots`; `protect` as `begin` takes it)."""
        return self._choose_slot(step, protect)[1]

    def write(
        self,
        step: int,
        state_dict: Mapping[str, Any],
        *,
        round: int,
        world_size: int,
        protect: int | None,
        stripe: Stripe | None = None,
    ) -> ImageFile:
        """Copy `state_dict` into a slot (never the one holding step
        `protect`, see `begin`); return where it is. With `stripe`, large
        plain tensors are cut among the node's ranks (see the module's doc)."""
        pending = self.begin(
            step, state_dict, round=round, world_size=world_size, protect=protect, stripe=stripe
        )
        return pending.finish()

    def begin(
        self,
        step: int,
        state_dict: Mapping[str, Any],
        *,
        round: int,
        world_size: int,
        protect: int | None,
        stripe: Stripe | None = None,
        defer: Callable[[torch.Tensor], bool] | None = None,
        sum_later: bool = False,
    ) -> PendingImage:
        """Start an image of `state_dict`: what `defer` does not claim is
        copied now, the tensors it claims (`defer(tensor)` is True: tensors
        that will not change until the caller waits, e.g. parameters and
        optimizer state until the next `optimizer.step()`) are copied in the
        background. With `sum_later`, the checksums of what is copied now
        are computed in the background too (from the copy, which nothing
        else writes). The image exists once `PendingImage.finish()` wrote its
        header; until then, and if the copy fails or the process dies, the
        slot holds no image at all. One image at a time per writer.

        The slot (see `dlfleet.worker.checkpoint.slots`): the image of step
        `protect` and the newer ones are kept while there is room (None:
        only the newest); `has_room` says whether there is."""
        if self._pending is not None and not self._pending.ended:
            raise SlotError(
                f"rank {self.rank}: the image of step {self._pending.step} is unfinished"
            )
        if step < 0 or round < 0:
            raise ValueError(f"step and round must be >= 0, got step {step}, round {round}")
        if not 0 <= self.rank < world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {world_size}")
        index = self._choose_slot(step, protect)[0]
        if stripe is not None and not (
            0 <= stripe.local_rank < stripe.local_world <= world_size
            and world_size % stripe.local_world == 0
        ):
            raise ValueError(f"{stripe} does not fit a world of {world_size}")
        planned, paths = _plan(
            with_skeleton(materialize(state_dict)), self.rank, stripe, self._blobs, self._plans
        )
        nbytes = max(
            (p.record.offset + p.record.length for p in planned), default=files.PREAMBLE_BYTES
        )
        slot = self._slots[index]
        header_path = self.directory / files.header_name(self.rank, index)
        slot.header = None
        header_path.unlink(missing_ok=True)
        body = slot.ensure(nbytes, self._pin)
        nonce = secrets.randbits(63)
        body[: files.PREAMBLE_BYTES].copy_(_as_bytes(files.preamble(nonce)))
        later = [
            i for i, p in enumerate(planned) if defer is not None and _deferrable(p.data, defer)
        ]
        header = ImageHeader(
            step=step,
            rank=self.rank,
            world_size=world_size,
            round=round,
            nonce=nonce,
            body_name=slot.path.name,
            body_nbytes=nbytes,
            items=tuple(p.record for p in planned),
            paths=paths,
        )
        pending = PendingImage(self, index, header_path, header)
        self._pending = pending
        deferred = set(later)
        now = [p for i, p in enumerate(planned) if i not in deferred]
        if sum_later:
            _copy_items(body, now, digest=False)
            pending.start(body, [planned[i] for i in later], unsummed=now)
        else:
            pending.add(now, _copy_items(body, now))
            if later:
                pending.start(body, [planned[i] for i in later])
        return pending

    def close(self) -> None:
        """Unmap the slots (after an unfinished image's copy ended: it stays
        unfinished); the files stay, for the agent."""
        if self._pending is not None:
            self._pending.wait(raise_error=False)
        if self._copier is not None:
            self._copier.shutdown(wait=False)
        for slot in self._slots:
            slot.close()
        if self._presence is not None:
            self._presence.close()

    def __enter__(self) -> ImageWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _choose_slot(self, step: int, protect: int | None) -> tuple[int, bool]:
        held = [
            Held(i, s.header.round, s.header.step)
            for i, s in enumerate(self._slots)
            if s.header is not None
        ]
        if protect is not None and protect == step and any(h.step == step for h in held):
            raise SlotError(f"step {step} is the protected step: its image may not be rewritten")
        image_bytes = max((s.header.body_nbytes for s in self._slots if s.header), default=0)
        count = slot_count(self._max_slots, self._memory_bytes, image_bytes)
        return choose(held, count, step=step, keep_from=protect)

    def _image_file(self, slot: int, header: ImageHeader) -> ImageFile:
        return ImageFile(
            header_path=self.directory / files.header_name(self.rank, slot),
            body_path=self.directory / header.body_name,
            rank=header.rank,
            slot=slot,
            step=header.step,
            round=header.round,
            world_size=header.world_size,
            nbytes=header.body_nbytes,
        )


class PendingImage:
    """An image being written (`ImageWriter.begin`): its deferred tensors are
    copied on a thread of its own (a CUDA tensor on a side stream that first
    waits for the work queued before the save), each piece summed as it is
    copied; `finish` waits for that copy and writes the header, which makes
    the image exist."""

    def __init__(
        self, writer: ImageWriter, slot: int, header_path: Path, header: ImageHeader
    ) -> None:
        self._writer = writer
        self._slot = slot
        self._header_path = header_path
        self._header = header
        self.step = header.step
        self.finished = False  # the header is written: the image exists
        self.ended = False  # finished, or abandoned: the writer may begin another
        self._digests: dict[str, tuple[int, ...]] = {}  # by item key
        self._job: Future[None] | None = None  # the background copy
        self._copied = threading.Event()  # every deferred source was read
        # When every deferred tensor is on one CUDA device: their copies are
        # queued on the side stream, behind which `_queued_event` is recorded.
        self._queued = threading.Event()
        self._queued_event: Any = None
        self._device: torch.device | None = None
        # Seconds from begin() until every source was read, until the header was written.
        self._began = time.perf_counter()
        self.copied_s: float | None = None
        self.ready_s: float | None = None
        self._error: BaseException | None = None

    def add(self, planned: Sequence[_Planned], digests: list[tuple[int, ...]]) -> None:
        for p, d in zip(planned, digests, strict=True):
            self._digests[_key(p.record)] = d

    def start(
        self, body: torch.Tensor, planned: list[_Planned], unsummed: Sequence[_Planned] = ()
    ) -> None:
        """Copy `planned` on a thread (summing each piece), then sum the
        `unsummed` items already in `body`."""
        stream = _side_stream(planned)
        devices = {p.data.device for p in planned if isinstance(p.data, torch.Tensor)}
        if stream is not None and len(devices) == 1:
            (self._device,) = devices

        def queued() -> None:
            if self._device is not None:
                event = cast(Any, torch.cuda).Event()
                event.record(stream)
                self._queued_event = event
            self._queued.set()

        def copy() -> None:
            try:
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    digests = _copy_items(body, planned, stream, self._mark_copied, queued=queued)
                    self.add(planned, digests)
                self._mark_copied()
                self.add(unsummed, _digests(body.numpy().data, unsummed))
            except BaseException as exc:  # noqa: BLE001 - raised again by finish()
                self._error = exc
            finally:
                self._queued.set()
                self._copied.set()

        # On one long-lived thread: starting a thread per save cost more than
        # a small state's whole copy.
        self._job = self._writer.background().submit(copy)

    def _mark_copied(self) -> None:
        if not self._copied.is_set():
            self.copied_s = time.perf_counter() - self._began
            self._copied.set()

    @property
    def copied(self) -> bool:
        """The deferred tensors are copied: they may change now (their
        checksums may still be under way)."""
        return self._job is None or self._copied.is_set()

    def wait_copied(self, *, raise_error: bool = True) -> None:
        """Until the deferred tensors are copied (before they change: the
        optimizer's next step)."""
        if self._job is not None:
            self._copied.wait()
        if raise_error and self._error is not None:
            raise self._error

    def hold_step(self) -> None:
        """Before the deferred tensors change (an optimizer step): when they
        are all on one CUDA device, the current stream waits for their
        copies on the device (the CPU only until the copies are queued: the
        step's kernels follow them, forward and backward went on meanwhile);
        otherwise the CPU waits for the copy."""
        if self._job is None or self._copied.is_set():
            return
        if self._device is not None:
            self._queued.wait()
            event = self._queued_event
            if event is not None:
                cast(Any, torch.cuda).current_stream(self._device).wait_event(event)
                return
        self._copied.wait()

    def wait(self, *, raise_error: bool = True) -> None:
        """Until the copy and its checksums are done."""
        if self._job is not None:
            self._job.result()
        if raise_error and self._error is not None:
            raise self._error

    def abandon(self) -> None:
        """Give up this image (its finish failed): once its copy ended, the
        writer may begin another; its slot holds no image."""
        self.wait(raise_error=False)
        self.ended = True

    def finish(self) -> ImageFile:
        """Wait for the copy and its checksums, then write the header: the
        image exists."""
        self.wait()
        header = replace(
            self._header,
            items=tuple(replace(i, digests=self._digests[_key(i)]) for i in self._header.items),
        )
        tmp = self._header_path.with_name(self._header_path.name + ".tmp")
        tmp.write_bytes(files.encode_header(header))
        tmp.replace(self._header_path)
        self._writer._slots[self._slot].header = header
        self.finished = self.ended = True
        self.ready_s = time.perf_counter() - self._began
        if self.copied_s is None:  # copied in begin(), nothing deferred
            self.copied_s = self.ready_s
        return self._writer._image_file(self._slot, header)


def _key(record: ItemRecord) -> str:
    return f"{record.fqn}@{record.chunk_offsets}"


def _deferrable(data: torch.Tensor | memoryview, defer: Callable[[torch.Tensor], bool]) -> bool:
    return isinstance(data, torch.Tensor) and defer(data)


def _side_stream(planned: list[_Planned]) -> Any:
    """A CUDA stream for the deferred copies of device tensors, after the
    work queued so far on the current stream (which computed them); None
    when no deferred tensor is on a device."""
    devices = {
        p.data.device for p in planned if isinstance(p.data, torch.Tensor) and p.data.is_cuda
    }
    if not devices:
        return None
    device = next(iter(devices))
    stream = cast(Any, torch.cuda).Stream(device=device)  # torch.cuda.Stream is untyped
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


class ImageSource(Protocol):
    """An image to restore from: zero-copy views of its items."""

    @property
    def header(self) -> ImageHeader: ...

    @property
    def local(self) -> bool:
        """Read from this node's files (cheaper than a copy fetched from a peer)."""
        ...

    def tensor(self, item: ItemRecord) -> torch.Tensor:
        """A view of a tensor item, shaped as its chunk; never write into it."""
        ...

    def blob(self, item: ItemRecord) -> bytes:
        """The torch.save blob of a bytes item."""
        ...

    def check_unchanged(self) -> None:
        """Raise ImageChangedError if the image changed since it was opened."""
        ...


class _BufferImage:
    """The item views shared by both sources."""

    def __init__(self, header: ImageHeader, body: torch.Tensor) -> None:
        self._header = header
        self._body = body

    @property
    def header(self) -> ImageHeader:
        return self._header

    def tensor(self, item: ItemRecord) -> torch.Tensor:
        if item.kind is ItemKind.BYTES:
            raise ValueError(f"item {item.fqn!r} holds bytes, not a tensor")
        span = self._body[item.offset : item.offset + item.length]
        return span.view(dtype_of(item.dtype)).view(item.chunk_sizes)

    def blob(self, item: ItemRecord) -> bytes:
        if item.kind is not ItemKind.BYTES:
            raise ValueError(f"item {item.fqn!r} holds a tensor, not bytes")
        return self._body[item.offset : item.offset + item.length].numpy().tobytes()


class LocalImage(_BufferImage):
    """An image in this node's files, memory-mapped copy-on-write (never
    written); its items verified against their checksums when opened."""

    def __init__(self, header_path: Path) -> None:
        header = files.read_header(header_path)
        self.body_path = header_path.parent / header.body_name
        try:
            with self.body_path.open("rb") as f:
                self._map = mmap.mmap(f.fileno(), header.body_nbytes, access=mmap.ACCESS_COPY)
        except (FileNotFoundError, ValueError) as e:
            raise ImageFormatError(
                f"no body of {header.body_nbytes} bytes at {self.body_path}"
            ) from e
        files.check_body(header, self._map)
        files.verify_items(header, self._map)
        super().__init__(header, torch.frombuffer(self._map, dtype=torch.uint8))

    @property
    def local(self) -> bool:
        return True

    def check_unchanged(self) -> None:
        with self.body_path.open("rb") as f:
            if f.read(files.PREAMBLE_BYTES) != files.preamble(self.header.nonce):
                raise ImageChangedError(f"{self.body_path} was overwritten while it was read")


class BytesImage(_BufferImage):
    """An image held in memory, e.g. fetched from a peer: its header and body
    bytes, verified against their checksums."""

    def __init__(self, header: bytes, body: bytes | bytearray | memoryview) -> None:
        decoded = files.decode_header(header)
        files.check_body(decoded, body)
        files.verify_items(decoded, body)
        view = _as_bytes(body)
        if view.data_ptr() % _ELEMENT_ALIGNMENT:
            # Items are aligned within the body; a body at an odd address (a slice of
            # a network buffer) is copied once so that every tensor view is aligned.
            view = view.clone()
        super().__init__(decoded, view)

    @property
    def local(self) -> bool:
        return False

    def check_unchanged(self) -> None:
        return None  # the bytes are ours


class BlobCache:
    """The serialized bytes of the plain values of the last image (a learning
    rate, betas, an epoch, a list of parameter ids): each is a `torch.save`
    of its own, together most of a small state's save, and most do not change
    from step to step. A value is served from here only when it equals the
    one the bytes were made of, type for type (so 1, 1.0 and True differ)."""

    MAX_LEAVES = 256  # larger values are serialized each time

    def __init__(self) -> None:
        self._held: dict[str, tuple[object, bytes]] = {}

    def serialized(self, fqn: str, value: object, make: Callable[[], io.BytesIO]) -> memoryview:
        key = _plain_key(value, [self.MAX_LEAVES])
        held = self._held.get(fqn)
        if key is not None and held is not None and held[0] == key:
            return memoryview(held[1])
        blob = make()
        if key is None:
            self._held.pop(fqn, None)
            return blob.getbuffer()
        data = blob.getvalue()
        self._held[fqn] = (key, data)
        return memoryview(data)


_PLAIN_TYPES = (int, float, bool, str, bytes, type(None))


def _plain_key(value: object, budget: list[int]) -> object | None:
    """`value` as nested tuples that compare equal only for an equal value of
    the same types; None for a value that is not made of plain leaves, or of
    more than `budget[0]` of them."""
    budget[0] -= 1
    if budget[0] < 0:
        return None
    kind = type(value)
    if kind is float:  # -0.0 == 0.0, yet they are saved apart
        return (kind, value, math.copysign(1.0, cast(float, value)))
    if kind in _PLAIN_TYPES:
        return (kind, value)
    if kind is list or kind is tuple:
        items = []
        for item in cast(Sequence[object], value):
            key = _plain_key(item, budget)
            if key is None:
                return None
            items.append(key)
        return (kind, tuple(items))
    return None


class PlanCache:
    """The layout of the last image planned (`_plan`): while a state dict
    keeps its structure (the same keys, and plain tensors of the same shapes,
    dtypes and devices), the next save reuses it instead of DCP's planning,
    whose cost grows with the number of tensors and is most of a small
    state's save. A DTensor or ShardedTensor anywhere: always planned anew."""

    def __init__(self) -> None:
        self.layout: _Layout | None = None


@dataclass(frozen=True)
class _Layout:
    key: tuple[Any, ...]  # the state's structure (see `_structure`)
    tensors: tuple[tuple[str, ItemRecord, tuple[int, int] | None], ...]  # fqn, record, rows cut
    blobs: tuple[tuple[str, bool], ...]  # fqn, primary; laid out from `blob_offset` on
    blob_offset: int
    paths: dict[str, files.ObjectPath]


def _plan(
    state_dict: StateDict,
    rank: int,
    stripe: Stripe | None = None,
    blobs: BlobCache | None = None,
    cache: PlanCache | None = None,
) -> tuple[list[_Planned], dict[str, files.ObjectPath]]:
    """DCP's local save plan of `state_dict`, laid out in a body: tensors
    first, then blobs (serialized again only when they changed, with `blobs`;
    the layout reused while the structure is the same, with `cache`)."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, storage_meta=None, is_coordinator=rank == 0)
    flat: StateDict = planner.state_dict
    key = _structure(flat, planner.mappings, rank, stripe) if cache is not None else None
    layout = cache.layout if cache is not None else None
    if layout is not None and key is not None and layout.key == key:
        return _replan(layout, flat, blobs), layout.paths
    plan = planner.create_local_plan()
    planned: list[_Planned] = []
    tensors: list[tuple[str, ItemRecord, tuple[int, int] | None]] = []
    offset = files.PREAMBLE_BYTES
    items = sorted(plan.items, key=lambda i: i.type == WriteItemType.BYTE_IO)
    blob_offset: int | None = None  # where the first blob goes (they follow the tensors)
    for item in items:
        data: torch.Tensor | memoryview
        if item.type == WriteItemType.BYTE_IO:
            blob_offset = offset if blob_offset is None else blob_offset
            data = _serialized(item.index.fqn, flat[item.index.fqn], blobs)
            record = ItemRecord(
                fqn=item.index.fqn,
                kind=ItemKind.BYTES,
                offset=offset,
                length=len(data),
                primary=rank == 0,
            )
        else:
            tensor = planner.resolve_data(item)
            assert isinstance(tensor, torch.Tensor)
            value = flat[item.index.fqn]
            cut = _cut(item, tensor, stripe) if not isinstance(value, DTensor) else None
            span: tuple[int, int] | None = None
            if cut is not None and stripe is not None:
                # The first node's parts are the ones a persist writes.
                part, start = cut
                record = _tensor_record(item, part, offset, rank < stripe.local_world, start)
                span = (start, part.shape[0])
                tensor = part
            else:
                record = _tensor_record(item, tensor, offset, _is_primary(value, rank))
            data = tensor
            tensors.append((item.index.fqn, record, span))
        planned.append(_Planned(record, data))
        offset = _round_up(offset + record.length, files.ALIGNMENT)
    paths = {fqn: tuple(path) for fqn, path in (plan.planner_data or {}).items()}
    if cache is not None:
        cache.layout = None
        if key is not None:
            cache.layout = _Layout(
                key=key,
                tensors=tuple(tensors),
                blobs=tuple(
                    (p.record.fqn, p.record.primary)
                    for p in planned
                    if p.record.kind is ItemKind.BYTES
                ),
                blob_offset=offset if blob_offset is None else blob_offset,
                paths=paths,
            )
    return planned, paths


def _structure(
    flat: StateDict, mappings: Mapping[str, Any], rank: int, stripe: Stripe | None
) -> tuple[Any, ...] | None:
    """What the layout of a flattened state dict depends on; None when it
    holds a value whose layout DCP computes each time (a DTensor, a
    ShardedTensor, any tensor that plans its own writes)."""
    parts: list[Any] = [rank, stripe]
    for fqn, value in flat.items():
        if isinstance(value, torch.Tensor):
            if not _is_plain_tensor(value):  # DTensor, ShardedTensor, any subclass
                return None
            parts.append(
                (fqn, mappings.get(fqn), tuple(value.shape), value.dtype, value.device,
                 value.layout, value.requires_grad)
            )  # fmt: skip
        else:
            parts.append((fqn, mappings.get(fqn)))
    return tuple(parts)


def _is_plain_tensor(value: torch.Tensor) -> bool:
    return type(value) is torch.Tensor or type(value) is torch.nn.Parameter


def _replan(layout: _Layout, flat: StateDict, blobs: BlobCache | None) -> list[_Planned]:
    planned = [
        _Planned(record, flat[fqn] if span is None else flat[fqn].narrow(0, *span))
        for fqn, record, span in layout.tensors
    ]
    offset = layout.blob_offset
    for fqn, primary in layout.blobs:
        data = _serialized(fqn, flat[fqn], blobs)
        record = ItemRecord(
            fqn=fqn, kind=ItemKind.BYTES, offset=offset, length=len(data), primary=primary
        )
        planned.append(_Planned(record, data))
        offset = _round_up(offset + len(data), files.ALIGNMENT)
    return planned


def _serialized(fqn: str, value: object, blobs: BlobCache | None) -> memoryview:
    """`value` as DCP's planner writes a non-tensor: its torch.save bytes."""

    def serialize() -> io.BytesIO:
        blob = io.BytesIO()
        torch.save(value, blob)
        return blob

    return blobs.serialized(fqn, value, serialize) if blobs is not None else serialize().getbuffer()


def _tensor_record(
    item: WriteItem, data: torch.Tensor, offset: int, primary: bool, start: int | None = None
) -> ItemRecord:
    """The record of a tensor item; with `start`, of `data` as the rows from
    `start` on of the planned tensor (a part cut by `Stripe`)."""
    meta = item.tensor_data
    assert meta is not None and meta.chunk is not None  # DCP sets both for tensor items
    chunk_offsets, chunk_sizes = tuple(meta.chunk.offsets), tuple(meta.chunk.sizes)
    if start is not None:
        chunk_offsets, chunk_sizes = (start, *chunk_offsets[1:]), tuple(data.shape)
    if tuple(data.shape) != chunk_sizes:
        raise CheckpointError(
            f"{item.index.fqn}: local tensor of shape {tuple(data.shape)} does not match its "
            f"planned chunk {chunk_sizes}"
        )
    if data.device.type == "meta":
        raise CheckpointError(f"{item.index.fqn} is a meta tensor: it has no data to save")
    return ItemRecord(
        fqn=item.index.fqn,
        kind=ItemKind.SHARD if item.type == WriteItemType.SHARD else ItemKind.TENSOR,
        offset=offset,
        length=math.prod(chunk_sizes) * data.element_size(),
        primary=primary,
        dtype=dtype_name(meta.properties.dtype),
        size=tuple(meta.size),
        chunk_offsets=chunk_offsets,
        chunk_sizes=chunk_sizes,
        requires_grad=meta.properties.requires_grad,
    )


def _cut(
    item: WriteItem, tensor: torch.Tensor, stripe: Stripe | None
) -> tuple[torch.Tensor, int] | None:
    """This rank's rows of a large plain tensor, and where they start; None
    when it is kept whole (no striping, small, or too few rows)."""
    if (
        stripe is None
        or stripe.local_world < 2
        or item.type != WriteItemType.TENSOR
        or tensor.dim() == 0
        or tensor.shape[0] < stripe.local_world
        or tensor.numel() * tensor.element_size() < STRIPE_MIN_BYTES
    ):
        return None
    start, end = stripe.rows(tensor.shape[0])
    return tensor.narrow(0, start, end - start), start


def _is_primary(value: object, rank: int) -> bool:
    """Whether this rank's copy of `value` is the one a persisted checkpoint keeps."""
    if not isinstance(value, DTensor):
        return rank == 0  # DCP treats plain values as replicated: rank 0 keeps them
    coordinate = value.device_mesh.get_coordinate()
    if coordinate is None:
        return False
    return all(
        c == 0 for c, p in zip(coordinate, value.placements, strict=True) if not p.is_shard()
    )


def _copy_items(
    body: torch.Tensor,
    planned: list[_Planned],
    stream: Any = None,
    copied: Callable[[], None] | None = None,
    *,
    digest: bool = True,
    queued: Callable[[], None] | None = None,
) -> list[tuple[int, ...]]:
    """Copy every item into its span of `body` and sum each piece copied
    (`files.piece_digests`): host memory with memmove, a piece per task over
    torch's intra-op threads when it has several, each task summing the piece
    it just wrote while it is still warm in the cache; device memory with
    asynchronous copies into the (pinned) body (on `stream` when given: the
    caller made it current), waited for, then summed in pieces over the same
    threads. `copied` is called once every source was read (they may change
    from then on) and before the summing of device items; `queued` once the
    device copies are queued (before the host ones). Returns each item's
    checksums (none without `digest`: `_digests` sums the copy later)."""
    devices: set[torch.device] = set()
    pieces: list[_Piece] = []  # host memory
    keep: list[torch.Tensor] = []  # the sources of `pieces`, alive until copied
    later: list[int] = []  # the items summed once every copy is done
    base = body.data_ptr()
    view = body.numpy().data
    for index, p in enumerate(planned):
        span = body[p.record.offset : p.record.offset + p.record.length]
        if isinstance(p.data, memoryview):
            span.copy_(_as_bytes(p.data))
            later.append(index)
            continue
        data = p.data.detach()
        if (
            data.device.type == "cpu"
            and data.layout == torch.strided
            and data.is_contiguous()
            and not (data.is_conj() or data.is_neg())
        ):
            start, end = p.record.offset, p.record.offset + p.record.length
            # A piece of the copy is a piece of the item's checksums.
            piece_bytes = files.DIGEST_PIECE_BYTES
            for at in range(start, max(end, start + 1), piece_bytes):
                till = min(end, at + piece_bytes)
                pieces.append(_Piece(index, base + at, data.data_ptr() + at - start, view[at:till]))
            keep.append(data)
            continue
        target = span.view(data.dtype).view(data.shape)
        if data.is_cuda:
            devices.add(data.device)
        target.copy_(data, non_blocking=data.is_cuda)
        later.append(index)
    if queued is not None:
        queued()
    sums = _copy_and_sum(pieces, torch.get_num_threads(), digest=digest)
    del keep
    if stream is not None:
        stream.synchronize()  # the side stream's copies only, not the training's work
    else:
        for device in devices:
            torch.cuda.synchronize(device)
    if copied is not None:
        copied()
    if not digest:
        return []
    digests: list[list[int]] = [[] for _ in planned]
    for piece, value in zip(pieces, sums, strict=True):
        digests[piece.item].append(value)
    for index, sums_of_item in zip(later, _digests(view, [planned[i] for i in later]), strict=True):
        digests[index].extend(sums_of_item)
    return [tuple(d) for d in digests]


def _digests(view: memoryview, planned: Sequence[_Planned]) -> list[tuple[int, ...]]:
    """The checksums of each item of `planned` as `view` (the body) holds it,
    a piece at a time."""
    spans = [
        (index, view[at : min(end, at + files.DIGEST_PIECE_BYTES)])
        for index, p in enumerate(planned)
        for end in [p.record.offset + p.record.length]
        for at in range(p.record.offset, max(end, p.record.offset + 1), files.DIGEST_PIECE_BYTES)
    ]
    digests: list[list[int]] = [[] for _ in planned]
    for (index, _), value in zip(spans, _sum_all([span for _, span in spans]), strict=True):
        digests[index].append(value)
    return [tuple(d) for d in digests]


def _sum_all(spans: list[memoryview]) -> list[int]:
    """The checksums of `spans`, over torch's intra-op threads when it has
    several and there is enough to sum (the sum releases the GIL)."""
    threads = torch.get_num_threads()
    if threads <= 1 or sum(len(span) for span in spans) < 2 * files.DIGEST_PIECE_BYTES:
        return [files.digest(span) for span in spans]
    return list(_copy_pool(threads).map(files.digest, spans))


@dataclass(frozen=True)
class _Piece:
    """One piece of a host-memory copy: `target` is its span of the body."""

    item: int
    to: int
    from_: int
    target: memoryview

    def copy_and_sum(self) -> int:
        ctypes.memmove(self.to, self.from_, len(self.target))
        return files.digest(self.target)

    def copy(self) -> int:
        ctypes.memmove(self.to, self.from_, len(self.target))
        return 0


def _copy_and_sum(pieces: list[_Piece], threads: int, *, digest: bool = True) -> list[int]:
    """glibc's memmove streams large copies past the cache, faster than a
    tensor copy_ (about 1.3x here); memmove and the sum both release the GIL
    while they run, so the pieces go over threads. Without `digest`, the
    copy only (and zeros)."""
    work = _Piece.copy_and_sum if digest else _Piece.copy
    total = sum(len(piece.target) for piece in pieces)
    if threads <= 1 or total < 2 * files.DIGEST_PIECE_BYTES:
        return [work(piece) for piece in pieces]
    return list(_copy_pool(threads).map(work, pieces))


_pools: dict[int, ThreadPoolExecutor] = {}


def _copy_pool(threads: int) -> ThreadPoolExecutor:
    pool = _pools.get(threads)
    if pool is None:
        pool = _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="dlfleet-copy")
    return pool


def _as_bytes(data: bytes | bytearray | memoryview) -> torch.Tensor:
    if len(data) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only source buffers
        return torch.frombuffer(data, dtype=torch.uint8)


def _cudart() -> Any:
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to
