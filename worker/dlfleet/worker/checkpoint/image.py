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

from dlfleet.worker.checkpoint import files
from dlfleet.worker.checkpoint.errors import (
    CheckpointError,
    ImageChangedError,
    ImageFormatError,
    SlotError,
)
from dlfleet.worker.checkpoint.files import ImageHeader, ItemKind, ItemRecord
from dlfleet.worker.checkpoint.plan import (
    BlobCache,
    PlanCache,
    Planned,
    Stripe,
    plan_state,
    round_up,
)
from dlfleet.worker.checkpoint.presence import Presence
from dlfleet.worker.checkpoint.slots import Held, choose, slot_count

StateDict = dict[str, Any]

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


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ImageFormatError(f"unknown tensor dtype {name!r} in image header")
    return dtype


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
            size = round_up(int(nbytes * (1 + _GROWTH)), 1 << 21)
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
        inline_bytes: int = 0,
    ) -> PendingImage:
        """Start an image of `state_dict`: what `defer` does not claim is
        copied now, the tensors it claims (`defer(tensor)` is True: tensors
        that will not change until the caller waits, e.g. parameters and
        optimizer state until the next `optimizer.step()`) are copied in the
        background. With `sum_later`, the checksums of what is copied now
        are computed in the background too (from the copy, which nothing
        else writes). An image of at most `inline_bytes` is copied and
        summed here, all of it (a background copy would cost more than it
        saves), and `PendingImage.background` is False. The image exists
        once `PendingImage.finish()` wrote its header; until then, and if
        the copy fails or the process dies, the slot holds no image at all.
        One image at a time per writer.

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
        planned, paths = plan_state(state_dict, self.rank, stripe, self._blobs, self._plans)
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
        inline = nbytes <= inline_bytes
        later = [
            i
            for i, p in enumerate(planned)
            if not inline and defer is not None and _deferrable(p.data, defer)
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
        if sum_later and not inline:
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

    def add(self, planned: Sequence[Planned], digests: list[tuple[int, ...]]) -> None:
        for p, d in zip(planned, digests, strict=True):
            self._digests[_key(p.record)] = d

    def start(
        self, body: torch.Tensor, planned: list[Planned], unsummed: Sequence[Planned] = ()
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
    def background(self) -> bool:
        """Whether a part of the image is copied or summed in the background."""
        return self._job is not None

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
            items=tuple(files.with_digests(i, self._digests[_key(i)]) for i in self._header.items),
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


def _side_stream(planned: list[Planned]) -> Any:
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


def _copy_items(
    body: torch.Tensor,
    planned: list[Planned],
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
        if isinstance(p.data, memoryview):  # a blob: a plain memcpy into the host body
            view[p.record.offset : p.record.offset + p.record.length] = p.data.cast("B")
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
        span = body[p.record.offset : p.record.offset + p.record.length]
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


def _digests(view: memoryview, planned: Sequence[Planned]) -> list[tuple[int, ...]]:
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


@dataclass(slots=True)  # made per item and save: no frozen-init cost
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
