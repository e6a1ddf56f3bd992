"""What an image is on disk and on the wire, readable without torch.

An *image* is one rank's state at one step, as two files in one folder (the
node's /dev/shm folder for in-memory images):

    rank-00003.slot-1.body     a 64-byte preamble, then the raw bytes of every item
    rank-00003.slot-1.header   a small JSON description of the body

Invariants:
- The header is written last, by an atomic rename, and removed before its body
  is reused: a header on disk always describes a complete body. A reader never
  sees half an image.
- The preamble carries the image's nonce, also in its header. A writer changes
  the preamble before it changes any other byte of a body, so a reader that
  checks the nonce after reading knows whether the body changed under it.
- Every item starts at a multiple of `ALIGNMENT` bytes in the body.
- Every item carries a checksum of each `DIGEST_PIECE_BYTES` of its bytes
  (xxh3-64, computed by the writer as it copies): a restore verifies the items
  it reads before it uses them, and a node receiving a peer's replica verifies
  it as it arrives, so a damaged image is never trained from; the error names
  the item. (Pieces, not one sum per item: the writer copies a large tensor
  in pieces on several threads, each summing what it copied.)

The node agent ships `header` and `body` as opaque bytes and reads only the
header's step, rank, round and world size: this module imports no torch.
"""

from __future__ import annotations

import functools
import json
import mmap
import os
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any

import xxhash

from dlfleet.worker.checkpoint.errors import ImageChangedError, ImageCorruptError, ImageFormatError

FORMAT = "dlfleet-image/1"
MAGIC = b"DLFLIMG1"
PREAMBLE_BYTES = 64
ALIGNMENT = 64
DIGEST_PIECE_BYTES = 64 << 20  # an item's checksums: one per piece of this size

# Beside a node's own folder (`<root>/own`), the agent keeps each peer
# node's replicas in `<root>/replicas/<node>`.
REPLICAS = "replicas"

_NAME = re.compile(r"^rank-(\d{5})\.slot-(\d+)\.(header|body)$")
_NONCE = struct.Struct("<Q")

ObjectPath = tuple[str | int, ...]


class ItemKind(Enum):
    """How an item is stored: DCP's WriteItemType, by name."""

    TENSOR = "tensor"  # a whole plain tensor
    SHARD = "shard"  # one chunk of a DTensor, at its global offsets
    BYTES = "bytes"  # any other value, as a torch.save blob


@dataclass(frozen=True)
class ItemRecord:
    """One write item of DCP's plan and where its bytes are in the body."""

    fqn: str  # DCP's flattened key, e.g. "optim.state.0.weight.exp_avg"
    kind: ItemKind
    offset: int  # of the item's bytes in the body
    length: int
    # This rank's copy is the one persisted: rank 0 for replicated values, the
    # first replica of each DTensor shard.
    primary: bool
    # Tensors only: DCP's TensorWriteData.
    dtype: str = ""  # torch dtype name without "torch.", e.g. "float32"
    size: tuple[int, ...] = ()  # of the whole (global) tensor
    chunk_offsets: tuple[int, ...] = ()
    chunk_sizes: tuple[int, ...] = ()
    requires_grad: bool = False
    # xxh3-64 of each DIGEST_PIECE_BYTES of the item's bytes (the last piece
    # shorter); empty in an image written without checksums.
    digests: tuple[int, ...] = ()


@dataclass(frozen=True)
class ImageSummary:
    """What a header says of its image but its items: all the node agent
    reads of the images it lists (`list_summaries`)."""

    step: int
    rank: int
    world_size: int
    round: int
    nonce: int  # also in the body's preamble
    body_name: str
    body_nbytes: int  # the bytes of the body that belong to this image

    def summary(self) -> ImageSummary:
        """This summary alone (of a whole header: without its items)."""
        return ImageSummary(*(getattr(self, f.name) for f in fields(ImageSummary)))


@dataclass(frozen=True)
class ImageHeader(ImageSummary):
    items: tuple[ItemRecord, ...]
    # DCP's planner_data: flattened key -> path in the nested state dict.
    paths: Mapping[str, ObjectPath] = field(default_factory=dict)


@dataclass(frozen=True)
class StoredImage:
    """An image found in a folder."""

    header_path: Path
    body_path: Path
    header: ImageHeader


@dataclass(frozen=True)
class StoredSummary:
    """An image found in a folder, by its summary (`list_summaries`)."""

    header_path: Path
    body_path: Path
    header: ImageSummary


def header_name(rank: int, slot: int) -> str:
    return f"rank-{rank:05d}.slot-{slot}.header"


def body_name(rank: int, slot: int) -> str:
    return f"rank-{rank:05d}.slot-{slot}.body"


def parse_name(name: str) -> tuple[int, int, str] | None:
    """(rank, slot, "header" | "body") of an image file name, None for other names."""
    match = _NAME.match(name)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2)), match.group(3)


def preamble(nonce: int) -> bytes:
    """The first `PREAMBLE_BYTES` of a body whose header carries `nonce`."""
    return (MAGIC + _NONCE.pack(nonce)).ljust(PREAMBLE_BYTES, b"\0")


def encode_header(header: ImageHeader) -> bytes:
    doc = {
        "format": FORMAT,
        "step": header.step,
        "rank": header.rank,
        "world_size": header.world_size,
        "round": header.round,
        "nonce": header.nonce,
        "body_name": header.body_name,
        "body_nbytes": header.body_nbytes,
        "paths": {fqn: list(path) for fqn, path in header.paths.items()},
    }
    # The items last, each encoded once while it stays the same (a save of
    # a small state writes a header every step, and most items repeat).
    head = json.dumps(doc, separators=(",", ":"))
    items = ",".join(_item_json(item) for item in header.items)
    return f'{head[:-1]},"items":[{items}]}}'.encode()


def _item_json(item: ItemRecord) -> str:
    """`json.dumps(_encode_item(item), separators=(",", ":"))`, formatted by
    hand: a header is written at every save, and json's encoder spent most
    of a small image's header on its items. All but the checksums repeat
    from save to save, and are formatted once."""
    key = _without_digests(item)
    fields = _FIELDS.get(key)
    if fields is None:
        if len(_FIELDS) >= _FIELDS_KEPT:
            _FIELDS.clear()
        fields = _FIELDS[key] = _item_fields(item)
    if item.digests:
        return f'{fields},"digests":[{_ints(item.digests)}]}}'
    return fields + "}"


def _item_fields(item: ItemRecord) -> str:
    text = (
        f'{{"fqn":{_json_string(item.fqn)},"kind":"{item.kind.value}","offset":{item.offset},'
        f'"length":{item.length},"primary":{_JSON_BOOL[item.primary]}'
    )
    if item.kind is not ItemKind.BYTES:
        text += (
            f',"dtype":{_json_string(item.dtype)},"size":[{_ints(item.size)}],'
            f'"chunk_offsets":[{_ints(item.chunk_offsets)}],'
            f'"chunk_sizes":[{_ints(item.chunk_sizes)}],'
            f'"requires_grad":{_JSON_BOOL[item.requires_grad]}'
        )
    return text


_FIELDS: dict[_Fields, str] = {}
_FIELDS_KEPT = 8192
_JSON_BOOL = {True: "true", False: "false"}


@functools.lru_cache(maxsize=8192)
def _json_string(text: str) -> str:
    return json.dumps(text)


def _ints(values: tuple[int, ...]) -> str:
    return ",".join(map(str, map(int, values)))


def with_digests(item: ItemRecord, digests: tuple[int, ...]) -> ItemRecord:
    """`item` with its checksums."""
    return ItemRecord(*_without_digests(item), digests)


_Fields = tuple[
    str, ItemKind, int, int, bool, str, tuple[int, ...], tuple[int, ...], tuple[int, ...], bool
]


def _without_digests(item: ItemRecord) -> _Fields:
    """Every field of `item` but its checksums, in the constructor's order
    (positional: `dataclasses.replace` and `astuple` cost more per save)."""
    return (
        item.fqn,
        item.kind,
        item.offset,
        item.length,
        item.primary,
        item.dtype,
        item.size,
        item.chunk_offsets,
        item.chunk_sizes,
        item.requires_grad,
    )


def decode_header(data: bytes) -> ImageHeader:
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ImageFormatError(f"not a {FORMAT} header")
        header = ImageHeader(
            step=int(doc["step"]),
            rank=int(doc["rank"]),
            world_size=int(doc["world_size"]),
            round=int(doc["round"]),
            nonce=int(doc["nonce"]),
            body_name=str(doc["body_name"]),
            body_nbytes=int(doc["body_nbytes"]),
            paths={str(fqn): tuple(path) for fqn, path in doc["paths"].items()},
            items=tuple(_decode_item(item) for item in doc["items"]),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ImageFormatError(f"malformed image header: {e!r}") from e
    _check_header(header)
    return header


# A header's head, as `encode_header` writes it (json.dumps's order and
# separators): its summary is read from here without decoding its items.
_HEAD = re.compile(
    rb'\{"format":"' + re.escape(FORMAT.encode()) + rb'","step":(\d+),"rank":(\d+),'
    rb'"world_size":(\d+),"round":(\d+),"nonce":(\d+),'
    rb'"body_name":("(?:[^"\\]|\\.)*"),"body_nbytes":(\d+),"paths":'
)


def decode_summary(data: bytes) -> ImageSummary:
    """The summary of a header: from its head alone when it has the form
    `encode_header` writes (a listing decodes every new header, most of
    whose bytes are items), else from the whole header."""
    match = _HEAD.match(data)
    if match is None or not data.endswith(b"]}"):
        return decode_header(data).summary()
    step, rank, world, round_, nonce = (int(match.group(i)) for i in range(1, 6))
    summary = ImageSummary(
        step=step,
        rank=rank,
        world_size=world,
        round=round_,
        nonce=nonce,
        body_name=str(json.loads(match.group(6))),
        body_nbytes=int(match.group(7)),
    )
    _check_summary(summary)
    return summary


def read_header(path: Path) -> ImageHeader:
    try:
        return decode_header(path.read_bytes())
    except ImageFormatError as e:
        raise ImageFormatError(f"{path}: {e}") from e


class HeaderCache:
    """Summaries of headers already read, by path and file version: a header
    is only ever replaced whole, by rename (a new inode), so a file whose
    inode, modification time and size did not change still says the same.
    For a reader that lists a folder often (the agent, at each report)."""

    def __init__(self) -> None:
        self._known: dict[Path, tuple[tuple[int, int, int], ImageSummary]] = {}

    def read(self, path: Path) -> ImageSummary:
        stat = path.stat()
        version = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        known = self._known.get(path)
        if known is not None and known[0] == version:
            return known[1]
        try:
            summary = decode_summary(path.read_bytes())
        except ImageFormatError as e:
            raise ImageFormatError(f"{path}: {e}") from e
        self._known[path] = (version, summary)
        return summary

    def remember(self, path: Path, header: ImageSummary) -> None:
        """`header` is what the file at `path` now holds (its writer knows)."""
        stat = path.stat()
        self._known[path] = ((stat.st_ino, stat.st_mtime_ns, stat.st_size), header)


def replica_folders(own: Path) -> list[Path]:
    """The folders of the peers' replicas beside the node's own folder `own`."""
    replicas = own.parent / REPLICAS
    if not replicas.is_dir():
        return []
    return sorted(p for p in replicas.iterdir() if p.is_dir())


def list_images(directory: Path, rank: int | None = None) -> list[StoredImage]:
    """The complete images in `directory` (of one rank, or of all), by rank and step.

    A header that disappears while listing (its slot being reused) is skipped.
    """
    found = []
    for path in _header_paths(directory, rank):
        try:
            header = read_header(path)
        except FileNotFoundError:
            continue
        found.append(StoredImage(path, directory / header.body_name, header))
    return sorted(found, key=lambda image: (image.header.rank, image.header.step))


def list_summaries(
    directory: Path, rank: int | None = None, *, cache: HeaderCache
) -> list[StoredSummary]:
    """`list_images`, each image by its summary, read through `cache`."""
    found = []
    for path in _header_paths(directory, rank):
        try:
            summary = cache.read(path)
        except FileNotFoundError:
            continue
        found.append(StoredSummary(path, directory / summary.body_name, summary))
    return sorted(found, key=lambda image: (image.header.rank, image.header.step))


def _header_paths(directory: Path, rank: int | None) -> list[Path]:
    paths = []
    for path in sorted(directory.glob("rank-*.slot-*.header")):
        parsed = parse_name(path.name)
        if parsed is not None and (rank is None or parsed[0] == rank):
            paths.append(path)
    return paths


def newest_complete_step(headers: Iterable[ImageHeader]) -> int | None:
    """The newest step for which every rank 0..world_size-1 of its round has a header."""
    ranks: dict[tuple[int, int, int], set[int]] = {}
    for header in headers:
        ranks.setdefault((header.step, header.round, header.world_size), set()).add(header.rank)
    complete = [key[0] for key, held in ranks.items() if held >= set(range(key[2]))]
    return max(complete, default=None)


def check_body(header: ImageHeader, body: bytes | bytearray | memoryview | mmap.mmap) -> None:
    """Raise ImageFormatError unless `body` is the body `header` describes."""
    view = memoryview(body)
    if view.nbytes < header.body_nbytes:
        raise ImageFormatError(
            f"body of rank {header.rank} step {header.step} has {view.nbytes} bytes, "
            f"its header needs {header.body_nbytes}"
        )
    if bytes(view[:PREAMBLE_BYTES]) != preamble(header.nonce):
        raise ImageFormatError(
            f"body of rank {header.rank} step {header.step} belongs to another image"
        )


def digest(data: bytes | bytearray | memoryview) -> int:
    """The checksum of one piece of an item."""
    return xxhash.xxh3_64_intdigest(data)


def piece_digests(data: memoryview) -> tuple[int, ...]:
    """The checksums of an item's bytes, piece by piece."""
    return tuple(
        digest(data[at : at + DIGEST_PIECE_BYTES])
        for at in range(0, len(data) or 1, DIGEST_PIECE_BYTES)
    )


def verify_items(header: ImageHeader, body: bytes | bytearray | memoryview | mmap.mmap) -> None:
    """Raise ImageCorruptError, naming the first item whose bytes do not
    match their checksums (the body is `check_body`'s already)."""
    checker = BodyVerifier(header)
    checker.feed(memoryview(body)[: header.body_nbytes])
    checker.finish()


class BodyVerifier:
    """Checks a body's items as its bytes arrive in order (a replica streamed
    from a peer), so a damaged one is refused before it is kept."""

    def __init__(self, header: ImageHeader) -> None:
        self._header = header
        # (start, end, expected, item, piece index), by start.
        self._pieces = sorted(
            (
                item.offset + index * DIGEST_PIECE_BYTES,
                min(item.offset + item.length, item.offset + (index + 1) * DIGEST_PIECE_BYTES),
                expected,
                item,
                index,
            )
            for item in header.items
            for index, expected in enumerate(item.digests)
        )
        self._next = 0  # the first piece not yet checked
        self._at = 0  # bytes fed so far
        self._open: xxhash.xxh3_64 | None = None  # the piece being fed, part way

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        start_of_data, end_of_data = self._at, self._at + len(view)
        while self._next < len(self._pieces):
            start, end, expected, item, index = self._pieces[self._next]
            if start > end_of_data or (start == end_of_data and end > start):
                break
            lo, hi = max(start, start_of_data), min(end, end_of_data)
            chunk = view[lo - start_of_data : hi - start_of_data]
            if lo == start and hi == end:
                value = digest(chunk)  # the whole piece at once: the common case
            else:
                if self._open is None:
                    self._open = xxhash.xxh3_64()
                self._open.update(chunk)
                if hi < end:
                    break
                value, self._open = self._open.intdigest(), None
            if value != expected:
                self._corrupt(item, index, start, end)
            self._next += 1
        self._at = end_of_data

    def finish(self) -> None:
        """Raise ImageFormatError if the body ended before its last item."""
        if self._next < len(self._pieces):
            _, _, _, item, _ = self._pieces[self._next]
            header = self._header
            raise ImageFormatError(
                f"body of rank {header.rank} step {header.step} ended after {self._at} bytes, "
                f"within {item.fqn!r}"
            )

    def _corrupt(self, item: ItemRecord, index: int, start: int, end: int) -> None:
        header = self._header
        where = f" (piece {index + 1} of {len(item.digests)})" if len(item.digests) > 1 else ""
        raise ImageCorruptError(
            f"image of rank {header.rank} step {header.step}: {item.fqn!r}{where}, bytes "
            f"{start}..{end} of {header.body_name}, does not match its checksum"
        )


def read_image_bytes(header_path: Path) -> tuple[bytes, bytes]:
    """(header, body) of a local image, as bytes to ship to a peer.

    Raises ImageChangedError if a save reused the slot while it was read.
    """
    data, _, body = read_image(header_path)
    return data, body


def read_image(header_path: Path) -> tuple[bytes, ImageHeader, bytes]:
    """`read_image_bytes`, with the header decoded too."""
    data = header_path.read_bytes()
    header = decode_header(data)
    body_path = header_path.parent / header.body_name
    with body_path.open("rb") as f:
        body = f.read(header.body_nbytes)
        check_body(header, body)
        if os.pread(f.fileno(), PREAMBLE_BYTES, 0) != preamble(header.nonce):
            raise ImageChangedError(f"{body_path} was overwritten while it was read")
    return data, header, body


def _encode_item(item: ItemRecord) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "fqn": item.fqn,
        "kind": item.kind.value,
        "offset": item.offset,
        "length": item.length,
        "primary": item.primary,
    }
    if item.kind is not ItemKind.BYTES:
        doc.update(
            dtype=item.dtype,
            size=list(item.size),
            chunk_offsets=list(item.chunk_offsets),
            chunk_sizes=list(item.chunk_sizes),
            requires_grad=item.requires_grad,
        )
    if item.digests:
        doc["digests"] = list(item.digests)
    return doc


def _decode_item(doc: dict[str, Any]) -> ItemRecord:
    # Positional, without generators: the agent decodes a header per image
    # (tens a second when saves come every step), most of it here.
    kind = ItemKind(doc["kind"])
    digests = tuple(map(int, doc.get("digests", ())))
    fqn, offset, length, primary = (
        str(doc["fqn"]),
        int(doc["offset"]),
        int(doc["length"]),
        bool(doc["primary"]),
    )
    if kind is ItemKind.BYTES:
        return ItemRecord(fqn, kind, offset, length, primary, digests=digests)
    return ItemRecord(
        fqn,
        kind,
        offset,
        length,
        primary,
        str(doc["dtype"]),
        tuple(map(int, doc["size"])),
        tuple(map(int, doc["chunk_offsets"])),
        tuple(map(int, doc["chunk_sizes"])),
        bool(doc["requires_grad"]),
        digests,
    )


def _check_summary(header: ImageSummary) -> None:
    if not 0 <= header.rank < header.world_size:
        raise ImageFormatError(f"rank {header.rank} outside world size {header.world_size}")
    if header.body_nbytes < PREAMBLE_BYTES:
        raise ImageFormatError(f"body of {header.body_nbytes} bytes has no preamble")


def _check_header(header: ImageHeader) -> None:
    _check_summary(header)
    for item in header.items:
        if item.offset < PREAMBLE_BYTES or item.offset + item.length > header.body_nbytes:
            raise ImageFormatError(
                f"item {item.fqn!r} at bytes {item.offset}..{item.offset + item.length} "
                f"lies outside the body of {header.body_nbytes} bytes"
            )
        if item.digests and len(item.digests) != max(1, -(-item.length // DIGEST_PIECE_BYTES)):
            raise ImageFormatError(
                f"item {item.fqn!r} of {item.length} bytes has {len(item.digests)} checksums"
            )
