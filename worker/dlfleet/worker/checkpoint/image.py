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
import warnings
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

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

    def populate(self) -> None:
        if self._map is not None:
            # MADV_POPULATE_WRITE (Linux 5.14+) faults every page now; on older
            # kernels the first save faults them instead.
            with contextlib.suppress(OSError, ValueError):
                self._map.madvise(23)

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
    """Writes the images of one rank into `slots` rotating slots of a folder."""

    def __init__(
        self,
        directory: Path,
        rank: int,
        slots: int = 2,
        *,
        checksum: bool = False,
        pin_memory: bool = True,
    ) -> None:
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        if slots < 1:
            raise ValueError(f"an image writer needs at least one slot, got {slots}")
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.rank = rank
        self._checksum = checksum
        self._pin = pin_memory
        self._slots = [_Slot(directory / files.body_name(rank, s)) for s in range(slots)]
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

    def reserve(self, nbytes: int) -> None:
        """Allocate and fault every slot for a body of `nbytes`, off the hot path."""
        for slot in self._slots:
            slot.ensure(nbytes + files.PREAMBLE_BYTES, self._pin)
            slot.populate()

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
        """Copy `state_dict` into the slot not holding step `protect`; return
        where it is. With `stripe`, large plain tensors are cut among the
        node's ranks (see the module's doc)."""
        if step < 0 or round < 0:
            raise ValueError(f"step and round must be >= 0, got step {step}, round {round}")
        if not 0 <= self.rank < world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {world_size}")
        index = self._choose_slot(step, protect)
        if stripe is not None and not (
            0 <= stripe.local_rank < stripe.local_world <= world_size
            and world_size % stripe.local_world == 0
        ):
            raise ValueError(f"{stripe} does not fit a world of {world_size}")
        planned, paths = _plan(with_skeleton(materialize(state_dict)), self.rank, stripe)
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
        _copy_items(body, planned)
        crc = zlib.crc32(body[:nbytes].numpy().data) if self._checksum else None
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
            crc32=crc,
        )
        tmp = header_path.with_name(header_path.name + ".tmp")
        tmp.write_bytes(files.encode_header(header))
        tmp.replace(header_path)
        slot.header = header
        return self._image_file(index, header)

    def close(self) -> None:
        """Unmap the slots; the files stay, for the agent."""
        for slot in self._slots:
            slot.close()

    def __enter__(self) -> ImageWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _choose_slot(self, step: int, protect: int | None) -> int:
        held = {i: s.header.step for i, s in enumerate(self._slots) if s.header is not None}
        if protect is not None and protect == step and protect in held.values():
            raise SlotError(f"step {step} is the protected step: its image may not be rewritten")
        free = [i for i in range(len(self._slots)) if protect is None or held.get(i) != protect]
        if not free:
            raise SlotError(
                f"every one of the {len(self._slots)} slots of rank {self.rank} holds the "
                f"protected step {protect}: give the writer more slots"
            )
        for i in free:
            if held.get(i) == step:
                return i  # a save of the same step again replaces its older image
        empty = [i for i in free if i not in held]
        return empty[0] if empty else min(free, key=lambda i: held[i])

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
    """An image in this node's files, memory-mapped copy-on-write (never written)."""

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
        super().__init__(header, torch.frombuffer(self._map, dtype=torch.uint8))

    @property
    def local(self) -> bool:
        return True

    def check_unchanged(self) -> None:
        with self.body_path.open("rb") as f:
            if f.read(files.PREAMBLE_BYTES) != files.preamble(self.header.nonce):
                raise ImageChangedError(f"{self.body_path} was overwritten while it was read")


class BytesImage(_BufferImage):
    """An image held in memory, e.g. fetched from a peer: its header and body bytes."""

    def __init__(self, header: bytes, body: bytes | bytearray | memoryview) -> None:
        decoded = files.decode_header(header)
        files.check_body(decoded, body)
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


def _plan(
    state_dict: StateDict, rank: int, stripe: Stripe | None = None
) -> tuple[list[_Planned], dict[str, files.ObjectPath]]:
    """DCP's local save plan of `state_dict`, laid out in a body: tensors first, then blobs."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, storage_meta=None, is_coordinator=rank == 0)
    plan = planner.create_local_plan()
    flat: StateDict = planner.state_dict
    planned: list[_Planned] = []
    offset = files.PREAMBLE_BYTES
    items = sorted(plan.items, key=lambda i: i.type == WriteItemType.BYTE_IO)
    for item in items:
        if item.type == WriteItemType.BYTE_IO:
            blob = planner.resolve_data(item)
            assert isinstance(blob, io.BytesIO)  # DCP's planner torch.saves bytes items
            data: torch.Tensor | memoryview = blob.getbuffer()
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
            data = tensor
            value = flat[item.index.fqn]
            cut = _cut(item, tensor, stripe) if not isinstance(value, DTensor) else None
            if cut is not None and stripe is not None:
                # The first node's parts are the ones a persist writes.
                data, start = cut
                record = _tensor_record(item, data, offset, rank < stripe.local_world, start)
            else:
                record = _tensor_record(item, data, offset, _is_primary(value, rank))
        planned.append(_Planned(record, data))
        offset = _round_up(offset + record.length, files.ALIGNMENT)
    paths = {fqn: tuple(path) for fqn, path in (plan.planner_data or {}).items()}
    return planned, paths


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


def _copy_items(body: torch.Tensor, planned: list[_Planned]) -> None:
    """Copy every item into its span of `body`: host memory with memmove (split
    over torch's intra-op threads when it has several), device memory with
    asynchronous copies into the (pinned) body, waited for at the end."""
    devices: set[torch.device] = set()
    spans: list[tuple[int, int, int]] = []  # (to, from, nbytes), host memory
    keep: list[torch.Tensor] = []  # the sources of `spans`, alive until copied
    base = body.data_ptr()
    for p in planned:
        span = body[p.record.offset : p.record.offset + p.record.length]
        if isinstance(p.data, memoryview):
            span.copy_(_as_bytes(p.data))
            continue
        data = p.data.detach()
        if (
            data.device.type == "cpu"
            and data.layout == torch.strided
            and data.is_contiguous()
            and not (data.is_conj() or data.is_neg())
        ):
            spans.append((base + p.record.offset, data.data_ptr(), p.record.length))
            keep.append(data)
            continue
        target = span.view(data.dtype).view(data.shape)
        if data.is_cuda:
            devices.add(data.device)
        target.copy_(data, non_blocking=data.is_cuda)
    _memmove_all(spans, torch.get_num_threads())
    del keep
    for device in devices:
        torch.cuda.synchronize(device)


def _memmove_all(spans: list[tuple[int, int, int]], threads: int) -> None:
    """glibc's memmove streams large copies past the cache, faster than a
    tensor copy_ (about 1.3x here); the GIL is released while it runs."""
    total = sum(n for _, _, n in spans)
    if threads <= 1 or total < 2 * _PARALLEL_COPY_BYTES:
        for to, from_, n in spans:
            ctypes.memmove(to, from_, n)
        return
    pieces = [
        (to + at, from_ + at, min(_PARALLEL_COPY_BYTES, n - at))
        for to, from_, n in spans
        for at in range(0, n, _PARALLEL_COPY_BYTES)
    ]
    pool = _copy_pool(threads)
    for _ in pool.map(lambda piece: ctypes.memmove(*piece), pieces):
        pass


_PARALLEL_COPY_BYTES = 64 * 2**20  # a piece of a copy split over threads
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
