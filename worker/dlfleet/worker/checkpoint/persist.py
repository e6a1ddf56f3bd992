"""Persist images to disk in the standard torch.distributed.checkpoint folder format.

Layout: `<root>/step-<step:010d>/`, DCP's own: `__<rank>_0.distcp` files written
by DCP's `FileSystemWriter`, and `.metadata`. Plain `dcp.load` and
`format_utils.dcp_to_torch_save` read the folder.

No collective runs. Each rank writes its part from its image (only its primary
copies: rank 0 keeps replicated values, the first replica keeps each DTensor
shard) into `<root>/step-<step:010d>.partial/`, and records its write results
and the checksums of the files it wrote in a small part file; the finishing
rank (rank 0) waits, for a bounded time, for the parts of every rank of the
saving world, writes the manifest (`.dlfleet-manifest`: each data file's size
and xxh3 checksum) and `.metadata`, fsyncs, and renames the folder to its
final name. Invariants: a folder under its final name is complete (it has
`.metadata`), so the newest one is never half written whenever a writer
died; a `.partial` folder is never loaded; a process finishes one folder at a
time (its persister and its SIGTERM handler may both finish the same one),
and a folder found complete, even by another process's finish, is done.

A restore verifies a folder against its manifest before it reads it
(`verify_folder`): a file truncated or damaged on disk is named, and the
restore falls back to an older folder.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import json
import logging
import math
import os
import pickle
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from dlfleet.worker.checkpoint import files, presence
from dlfleet.worker.checkpoint.errors import (
    CheckpointError,
    PersistCorruptError,
    PersistError,
    PersistTimeoutError,
    TemplateRequiredError,
)
from dlfleet.worker.checkpoint.files import (
    DIGEST_PIECE_BYTES,
    ImageHeader,
    ItemKind,
    ItemRecord,
    ObjectPath,
    decode_header,
    digest,
    encode_header,
)
from dlfleet.worker.checkpoint.image import ImageSource, LocalImage, dtype_of
from dlfleet.worker.checkpoint.restore import empty_state_dict, load_with_planner
from dlfleet.worker.checkpoint.structure import reshape

_log = logging.getLogger("dlfleet.checkpoint")

# DCP's name for a checkpoint's metadata file (torch's filesystem._metadata_fn, private).
METADATA = ".metadata"
# Which tensors of a dlfleet folder are DTensor shards (the others, even in
# several chunks, are plain tensors cut among a node's ranks: see image.Stripe).
SHARDED = ".dlfleet-sharded"
# Each data file of the folder: its size and checksums (see `verify_folder`).
MANIFEST = ".dlfleet-manifest"
MANIFEST_FORMAT = "dlfleet-manifest/1"
_PREFIX = "step-"
_PARTIAL = ".partial"


class Absent(enum.Enum):
    """Why a stand-in does not write a missing part (see `finish_newest`)."""

    COMING = "coming"  # its rank may still write it: wait for it
    NEVER = "never"  # its rank is gone and no image of it is at hand


# (step, round, rank) of a part not written yet -> the image to write it from
# (its rank is gone: nobody else will write it), or why there is none.
StandIn = Callable[[int, int, int], "ImageSource | Absent"]

# One finish at a time in this process: two finishes of one folder would
# write its manifest and .metadata at once, and one would fail on a folder
# the other had just renamed (or leave a truncated file in it, if killed).
_FINISHING = threading.Lock()


def step_folder(root: Path, step: int) -> Path:
    """Where step `step` is, once complete."""
    return root / f"{_PREFIX}{step:010d}"


def partial_folder(folder: Path) -> Path:
    """Where the ranks write the parts of `folder` until it is complete."""
    return folder.with_name(folder.name + _PARTIAL)


def persist(
    source: ImageSource, root: Path, *, timeout: float = 300.0, sync_files: bool = True
) -> Path:
    """Write this rank's part of the image's step; rank 0 also finishes the folder."""
    folder = write_part(source, root, sync_files=sync_files)
    header = source.header
    if header.rank == 0:
        finish(folder, world_size=header.world_size, round=header.round, timeout=timeout)
    return folder


def write_part(
    source: ImageSource, root: Path, *, sync_files: bool = True, prefix: str | None = None
) -> Path:
    """Write the primary items of one rank's image and its part file; return the folder.

    `prefix` names its data files (DCP's `__<rank>_` by default): a stand-in
    writing a part its rank might write too writes files of its own, so
    neither tears the other's; the part file, replaced whole, names one set.

    Raises ImageChangedError (and records no part) if the image was overwritten meanwhile.
    """
    header = source.header
    folder = step_folder(root, header.step)
    if (folder / METADATA).is_file():
        return folder  # persisted already: a complete folder is never rewritten
    partial = partial_folder(folder)
    writer = FileSystemWriter(partial, sync_files=sync_files, overwrite=True)
    writer.set_up_storage_writer(header.rank == 0, rank=header.rank, use_collectives=False)
    records = [item for item in header.items if item.primary]
    plan = writer.prepare_local_plan(SavePlan([_write_item(item) for item in records]))
    if prefix is not None:
        plan = dataclasses.replace(plan, storage_data=type(plan.storage_data)(prefix))
    results = writer.write_data(plan, _ImagePlanner(source, records)).wait()
    # A save that reused the slot meanwhile tore what was written: no part, no folder.
    source.check_unchanged()
    written = sorted({str(result.storage_data.relative_path) for result in results})
    sums = {name: file_sums(partial / name) for name in written}
    part = _part_path(partial, header.rank)
    tmp = part.with_name(part.name + ".tmp")
    data = {"header": encode_header(header), "results": results, "files": sums}
    tmp.write_bytes(pickle.dumps(data))
    tmp.replace(part)
    return folder


def finish(
    folder: Path,
    *,
    world_size: int,
    round: int,
    timeout: float,
    poll: float = 0.05,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Path:
    """Wait for the parts of ranks 0..world_size-1 of `round`, then write `.metadata`."""
    done = finish_newest(
        [(folder, world_size, round)], timeout=timeout, poll=poll, clock=clock, sleep=sleep
    )
    if done is None:
        partial = partial_folder(folder)
        missing = _missing(_read_parts(partial, world_size, round), world_size)
        raise PersistTimeoutError(
            f"{folder}: waited {timeout:.0f}s for the parts of ranks {missing} "
            f"of round {round}; the folder stays incomplete ({partial.name})"
        )
    return done


def finish_newest(
    folders: list[tuple[Path, int, int]],
    *,
    timeout: float,
    poll: float = 0.05,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    stand_in: StandIn | None = None,
) -> Path | None:
    """Of `folders` (folder, world size, round; newest step first), finish
    the newest whose parts all come within `timeout`, and return it (None if
    none did). An older folder found whole is finished at once, so that a
    kill while the newer one is waited for loses no more than that.

    With `stand_in`, a missing part is written from the image it gives (its
    rank is gone), and a folder with a part that will never come
    (`Absent.NEVER`) is not waited for: no wait outlasts what can still
    come."""
    deadline = clock() + timeout
    newest: Path | None = None
    waiting = list(folders)
    while waiting:
        kept = []
        for entry in waiting:
            folder, world_size, round = entry
            if stand_in is not None and not write_stand_ins(folder, world_size, round, stand_in):
                continue  # it can never be whole
            if _finish_if_whole(folder, world_size, round):
                newest = folder
                break  # the older ones are not needed any more
            kept.append(entry)
        waiting = kept
        if not waiting or clock() >= deadline:
            return newest
        sleep(poll)
    return newest


def node_stand_in(directory: Path, step: int, round: int, rank: int) -> ImageSource | Absent:
    """A `StandIn` over a node's image folder, which its ranks share: when
    rank `rank` is gone (its part never comes), its image of `step` to write
    the part from, or `Absent.NEVER` if this node holds none; else
    `Absent.COMING` (the rank lives, or nothing is known of it here).

    Gone means either of two things (see `presence`). A rank of this node:
    no process holds its presence, and the folder holds an image of it from
    `round` (a presence left by an earlier round, when the rank was on this
    node, says nothing of the rank now: after the ranks were numbered anew
    it may live on another node); its image is the one in the folder. A
    rank of another node: the agent wrote it down as dead in `round`; its
    image is the replica this node keeps of it."""
    state = presence.rank_state(directory, rank)
    if state is presence.RankState.GONE:
        this_round = [s for s in files.list_images(directory, rank) if s.header.round == round]
        if not this_round:
            return Absent.COMING
        return _image_of(this_round, step, rank, "image")
    if state is presence.RankState.UNKNOWN and rank in presence.gone_ranks(directory, round):
        replicas = [
            stored
            for folder in files.replica_folders(directory)
            for stored in files.list_images(folder, rank)
            if stored.header.round == round
        ]
        return _image_of(replicas, step, rank, "replica")
    return Absent.COMING


def _image_of(
    stored: list[files.StoredImage], step: int, rank: int, what: str
) -> ImageSource | Absent:
    """Gone rank `rank`'s image of `step` among `stored`, or `Absent.NEVER`."""
    for image in stored:
        if image.header.step != step:
            continue
        try:
            source = LocalImage(image.header_path)
        except (OSError, CheckpointError) as exc:
            _log.warning("rank %d is gone, and its %s is unreadable: %s", rank, what, exc)
            return Absent.NEVER
        _log.warning("rank %d is gone; writing its part of step %d from its %s", rank, step, what)
        return source
    return Absent.NEVER


def write_stand_ins(folder: Path, world_size: int, round: int, stand_in: StandIn) -> bool:
    """Write the missing parts of `folder` that `stand_in` gives images for;
    False if one of them will never be written."""
    if (folder / METADATA).is_file():
        return True
    step = int(folder.name.removeprefix(_PREFIX))
    parts = _read_parts(partial_folder(folder), world_size, round)
    for rank in _missing(parts, world_size):
        found = stand_in(step, round, rank)
        if found is Absent.NEVER:
            return False
        if isinstance(found, Absent):
            continue
        h = found.header
        if (h.step, h.round, h.world_size, h.rank) != (step, round, world_size, rank):
            raise PersistError(
                f"{folder}: the image given for rank {rank} of round {round} is rank "
                f"{h.rank}'s of step {h.step}, round {h.round}"
            )
        try:
            write_part(found, folder.parent, prefix=f"__{rank}_stand_in_")
        except (OSError, CheckpointError) as exc:
            _log.warning(
                "%s: rank %d's part could not be written from its image: %s", folder, rank, exc
            )
            return False
    return True


def _finish_if_whole(folder: Path, world_size: int, round: int) -> bool:
    """Finish `folder` if every rank's part is there; whether it is complete."""
    with _FINISHING:
        if (folder / METADATA).is_file():
            return True
        parts = _read_parts(partial_folder(folder), world_size, round)
        if _missing(parts, world_size):
            return False
        try:
            _finish_parts(folder, parts, world_size)
        except FileNotFoundError:
            # Another process finished it meanwhile (renamed the .partial folder).
            if (folder / METADATA).is_file():
                return True
            raise
        return True


def _finish_parts(folder: Path, parts: dict[int, _Part], world_size: int) -> Path:
    """Write the manifest and `.metadata` of a `.partial` folder with every
    rank's part, and give it its final name."""
    partial = partial_folder(folder)
    headers = [parts[r].header for r in range(world_size)]
    metadata = _metadata(headers, folder)
    sharded = sorted({i.fqn for h in headers for i in h.items if i.kind is ItemKind.SHARD})
    _write_synced(partial / SHARDED, json.dumps(sharded).encode())
    files: dict[str, dict[str, Any]] = {}
    for rank in range(world_size):
        files.update(parts[rank].files)
    manifest = {"format": MANIFEST_FORMAT, "piece_bytes": DIGEST_PIECE_BYTES, "files": files}
    _write_synced(partial / MANIFEST, json.dumps(manifest, sort_keys=True).encode())
    writer = FileSystemWriter(partial)  # fsyncs .metadata
    writer.set_up_storage_writer(True)
    writer.finish(metadata, [parts[r].results for r in range(world_size)])
    for rank in range(world_size):
        _part_path(partial, rank).unlink(missing_ok=True)
    _fsync_dir(partial)
    partial.rename(folder)
    _fsync_dir(folder.parent)
    return folder


def file_sums(path: Path) -> dict[str, Any]:
    """The size of a file and the checksum of each DIGEST_PIECE_BYTES of it."""
    sums = []
    size = 0
    with path.open("rb") as f:
        while piece := f.read(DIGEST_PIECE_BYTES):
            sums.append(digest(piece))
            size += len(piece)
    return {"bytes": size, "xxh3": sums}


def verify_folder(folder: Path) -> None:
    """Raise PersistCorruptError naming the first file of a complete folder
    that is missing, of another size, or does not match its checksum. A
    folder without a manifest (written by plain DCP, or by an older dlfleet)
    has nothing to check against and passes."""
    try:
        manifest = json.loads((folder / MANIFEST).read_bytes())
    except FileNotFoundError:
        return
    except ValueError as e:
        raise PersistCorruptError(f"{folder / MANIFEST} is not a manifest: {e}") from e
    if manifest.get("format") != MANIFEST_FORMAT or manifest.get("piece_bytes") != (
        DIGEST_PIECE_BYTES
    ):
        raise PersistCorruptError(f"{folder / MANIFEST}: not a {MANIFEST_FORMAT} manifest")
    for name, expected in sorted(manifest["files"].items()):
        path = folder / name
        try:
            found = file_sums(path)
        except FileNotFoundError:
            raise PersistCorruptError(f"{path} is missing") from None
        if found["bytes"] != expected["bytes"]:
            raise PersistCorruptError(
                f"{path} has {found['bytes']} bytes, its manifest says {expected['bytes']}"
            )
        if found["xxh3"] != expected["xxh3"]:
            raise PersistCorruptError(f"{path} does not match its checksum")


def _write_synced(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def missing_parts(folder: Path, *, world_size: int, round: int) -> list[int]:
    """The ranks of `round` whose part of `folder` is not written yet (none
    once the folder is complete)."""
    if (folder / METADATA).is_file():
        return []
    return _missing(_read_parts(partial_folder(folder), world_size, round), world_size)


def _missing(parts: dict[int, Any], world_size: int) -> list[int]:
    return sorted(set(range(world_size)) - set(parts))


def newest_persisted(root: Path) -> tuple[int, Path] | None:
    """The newest complete step folder under `root`, with its step."""
    return max(complete_folders(root), default=None)


def complete_folders(root: Path) -> list[tuple[int, Path]]:
    """Every complete step folder under `root`, with its step, oldest first."""
    return [(step, path) for step, path in _step_folders(root) if (path / METADATA).is_file()]


def load_persisted(state_dict: dict[str, Any], path: Path) -> None:
    """Load a persisted folder into `state_dict` in place, resharding; no collective runs."""
    reader, metadata = _open(path)

    def read(planner: LoadPlanner, items: list[ReadItem]) -> None:
        reader.read_data(reader.prepare_local_plan(LoadPlan(items)), planner).wait()

    load_with_planner(state_dict, metadata, 0, read)


def load_persisted_full(path: Path) -> dict[str, Any]:
    """The saved nested state dict of a persisted folder, when no tensor in it is sharded."""
    _, metadata = _open(path)
    try:
        sharded: set[str] | None = set(json.loads((path / SHARDED).read_text()))
    except (OSError, ValueError):
        sharded = None  # not written by dlfleet: every chunked tensor may be a shard
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata) or _whole(md):
            continue
        if sharded is None or fqn in sharded:
            raise TemplateRequiredError(
                f"{path}: {fqn!r} is stored in {len(md.chunks)} shards: pass a template "
                "state dict (e.g. from get_state_dict) to load_persisted instead"
            )
    state_dict = empty_state_dict(metadata)
    load_persisted(state_dict, path)
    return reshape(state_dict)


def prune(root: Path, keep: int) -> list[Path]:
    """Remove all but the newest `keep` complete folders, and incomplete ones older than them.

    An incomplete folder newer than every complete one may be in progress: it stays.
    """
    if keep < 1:
        raise ValueError(f"prune must keep at least one complete checkpoint, got keep={keep}")
    folders = _step_folders(root, partial=True)
    complete = [step for step, path in folders if (path / METADATA).is_file()]
    kept = set(sorted(complete)[-keep:])
    newest = max(complete, default=-1)
    removed = []
    for step, path in folders:
        if step not in kept and step < newest:
            shutil.rmtree(path)
            removed.append(path)
    return removed


class _ImagePlanner(DefaultSavePlanner):
    """Gives DCP's writer the data of each write item, straight from an image."""

    def __init__(self, source: ImageSource, records: list[ItemRecord]) -> None:
        super().__init__()
        self._source = source
        self._records = {
            (r.fqn, r.chunk_offsets if r.kind is not ItemKind.BYTES else None): r for r in records
        }

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        fqn = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self._source.blob(self._records[(fqn, None)]))
        offsets = tuple(write_item.index.offset or ())
        return self._source.tensor(self._records[(fqn, offsets)])


def _write_item(item: ItemRecord) -> WriteItem:
    if item.kind is ItemKind.BYTES:
        return WriteItem(index=MetadataIndex(item.fqn), type=WriteItemType.BYTE_IO)
    offsets = torch.Size(item.chunk_offsets)
    return WriteItem(
        index=MetadataIndex(item.fqn, offsets),
        type=WriteItemType.SHARD if item.kind is ItemKind.SHARD else WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(item.chunk_sizes)),
            properties=_properties(item),
            size=torch.Size(item.size),
        ),
    )


def _properties(item: ItemRecord) -> TensorProperties:
    return TensorProperties(dtype=dtype_of(item.dtype), requires_grad=item.requires_grad)


def _metadata(headers: list[ImageHeader], folder: Path) -> Metadata:
    md: dict[str, STORAGE_TYPES] = {}
    paths: dict[str, ObjectPath] = {}
    for header in headers:
        paths.update(header.paths)
        for item in header.items:
            if not item.primary:
                continue
            if item.kind is ItemKind.BYTES:
                md.setdefault(item.fqn, BytesStorageMetadata())
                continue
            entry = md.setdefault(
                item.fqn,
                TensorStorageMetadata(_properties(item), torch.Size(item.size), chunks=[]),
            )
            assert isinstance(entry, TensorStorageMetadata)
            chunk = ChunkStorageMetadata(
                torch.Size(item.chunk_offsets), torch.Size(item.chunk_sizes)
            )
            if chunk not in entry.chunks:
                entry.chunks.append(chunk)
    for fqn, entry in md.items():
        if isinstance(entry, TensorStorageMetadata):
            held = sum(math.prod(c.sizes) for c in entry.chunks)
            if held != math.prod(entry.size):
                raise PersistError(
                    f"{folder}: the parts hold {held} of the {math.prod(entry.size)} elements "
                    f"of {fqn!r}; no rank wrote the rest"
                )
    return Metadata(state_dict_metadata=md, planner_data=paths)


def _part_path(folder: Path, rank: int) -> Path:
    return folder / f"__{rank}.dlfleet-part"


@dataclass(frozen=True)
class _Part:
    """What one rank wrote of a folder: its image's header, DCP's write
    results and the checksums of its files."""

    header: ImageHeader
    results: list[WriteResult]
    files: dict[str, dict[str, Any]]


def _read_parts(folder: Path, world_size: int, round: int) -> dict[int, _Part]:
    parts = {}
    for rank in range(world_size):
        try:
            data = pickle.loads(_part_path(folder, rank).read_bytes())
        except FileNotFoundError:
            continue
        header = decode_header(data["header"])
        # A part of another round (an earlier, failed attempt) is stale: its rank writes again.
        if header.round == round and header.world_size == world_size:
            parts[rank] = _Part(header, data["results"], data["files"])
    return parts


def _step_folders(root: Path, *, partial: bool = False) -> list[tuple[int, Path]]:
    """The step folders under `root` (with `partial`, the unfinished ones too)."""
    if not root.is_dir():
        return []
    folders = []
    for path in root.iterdir():
        suffix = path.name.removeprefix(_PREFIX)
        if partial:
            suffix = suffix.removesuffix(_PARTIAL)
        if path.is_dir() and path.name.startswith(_PREFIX) and suffix.isdigit():
            folders.append((int(suffix), path))
    return sorted(folders)


def _open(path: Path) -> tuple[FileSystemReader, Metadata]:
    if not (path / METADATA).is_file():
        raise PersistError(f"{path} is not a complete checkpoint: it has no {METADATA}")
    reader = FileSystemReader(path)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    return reader, metadata


def _whole(md: TensorStorageMetadata) -> bool:
    return len(md.chunks) == 1 and tuple(md.chunks[0].sizes) == tuple(md.size)
