"""Restore a state dict from images, resharding like torch.distributed.checkpoint.

The headers of the given images become one DCP `Metadata`, as if the images
were one checkpoint on disk; DCP's `DefaultLoadPlanner` then plans the reads of
this rank (resharding included) and this module executes them, copying from the
images' zero-copy views. No collective runs: each rank restores alone.

Replicas: a chunk or value held by several images is read from one, chosen as
- tensors: this rank's own image when the world size is unchanged, else an
  image in a local file, else any;
- bytes items: this rank's own image when the world size is unchanged, else
  rank 0's.
"""

from __future__ import annotations

import io
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem
from torch.distributed.checkpoint.stateful import Stateful

from dlfleet.worker.checkpoint.errors import RestoreError, TemplateRequiredError
from dlfleet.worker.checkpoint.files import ItemKind, ItemRecord, ObjectPath
from dlfleet.worker.checkpoint.image import ImageSource, dtype_of
from dlfleet.worker.checkpoint.structure import reshape

_Location = tuple[ImageSource, ItemRecord]


@dataclass(frozen=True)
class Catalog:
    """The images of one step seen as one DCP checkpoint, and where each stored item is."""

    metadata: Metadata
    tensors: Mapping[tuple[str, tuple[int, ...]], _Location]  # (fqn, chunk offsets)
    blobs: Mapping[str, _Location]
    sharded: tuple[str, ...]  # keys of DTensor items
    sources: tuple[ImageSource, ...]


def restore_into(
    state_dict: dict[str, Any], sources: Sequence[ImageSource], *, rank: int, world_size: int
) -> None:
    """Load the images' step into `state_dict` in place, resharding to this rank's chunks."""
    catalog = build_catalog(sources, rank=rank, world_size=world_size)
    load_with_planner(state_dict, catalog.metadata, rank, _ImageReads(catalog).run)


def load_full(sources: Sequence[ImageSource], *, rank: int, world_size: int) -> dict[str, Any]:
    """The saved nested state dict, rebuilt without a template (nothing may be sharded)."""
    catalog = build_catalog(sources, rank=rank, world_size=world_size)
    if catalog.sharded:
        raise TemplateRequiredError(
            f"the images hold sharded tensors (DTensor), e.g. {catalog.sharded[0]!r}: "
            "pass a template state dict (e.g. from get_state_dict) to restore_into instead"
        )
    state_dict = empty_state_dict(catalog.metadata)
    load_with_planner(state_dict, catalog.metadata, rank, _ImageReads(catalog).run)
    return reshape(state_dict)


def build_catalog(sources: Sequence[ImageSource], *, rank: int, world_size: int) -> Catalog:
    """One DCP Metadata for the images of one save, each stored item read from one image."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    chosen = _one_per_rank(sources)
    saved_world = chosen[0].header.world_size
    same_world = saved_world == world_size

    def own(source: ImageSource) -> bool:
        return same_world and source.header.rank == rank

    by_tensor_preference = sorted(chosen, key=lambda s: (not own(s), not s.local, s.header.rank))
    by_bytes_preference = sorted(chosen, key=lambda s: (not own(s), s.header.rank, not s.local))

    md: dict[str, STORAGE_TYPES] = {}
    tensors: dict[tuple[str, tuple[int, ...]], _Location] = {}
    blobs: dict[str, _Location] = {}
    sharded: list[str] = []
    for source in by_tensor_preference:
        for item in source.header.items:
            if item.kind is not ItemKind.BYTES:
                _add_chunk(md, tensors, source, item)
                if item.kind is ItemKind.SHARD and item.fqn not in sharded:
                    sharded.append(item.fqn)
    for source in by_bytes_preference:
        for item in source.header.items:
            if item.kind is ItemKind.BYTES:
                if isinstance(
                    md.setdefault(item.fqn, BytesStorageMetadata()), TensorStorageMetadata
                ):
                    raise RestoreError(f"{item.fqn!r} is a tensor in one image, bytes in another")
                blobs.setdefault(item.fqn, (source, item))
    _check_coverage(md, chosen)
    paths: dict[str, ObjectPath] = {}
    for source in chosen:
        paths.update(source.header.paths)
    return Catalog(
        metadata=Metadata(state_dict_metadata=md, planner_data=paths),
        tensors=tensors,
        blobs=blobs,
        sharded=tuple(sharded),
        sources=tuple(chosen),
    )


def load_with_planner(
    state_dict: dict[str, Any],
    metadata: Metadata,
    rank: int,
    read: Callable[[LoadPlanner, list[ReadItem]], None],
) -> None:
    """dcp.load's steps without its collectives: Stateful values, planning, reads."""
    keys = list(state_dict)
    work = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}
    planner = DefaultLoadPlanner()
    planner.set_up_planner(work, metadata, is_coordinator=rank == 0)
    try:
        plan = planner.create_local_plan()
    except (RuntimeError, ValueError) as e:
        raise RestoreError(f"the checkpoint does not fit the state dict: {e}") from e
    read(planner, plan.items)
    for key in keys:
        value = state_dict[key]
        if isinstance(value, Stateful):
            value.load_state_dict(work[key])
        else:
            state_dict[key] = work[key]


def empty_state_dict(metadata: Metadata) -> dict[str, Any]:
    """A nested template for `metadata`: empty tensors, None for bytes items."""
    root: dict[str, Any] = {}
    paths: Mapping[str, ObjectPath] = metadata.planner_data or {}
    for fqn, md in metadata.state_dict_metadata.items():
        value = (
            torch.empty(md.size, dtype=md.properties.dtype)
            if isinstance(md, TensorStorageMetadata)
            else None
        )
        _set_path(root, paths.get(fqn, (fqn,)), value)
    return root


def narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        tensor = tensor.narrow(dim, offset, length)
    return tensor


class _ImageReads:
    """Executes a load plan against the images of a catalog."""

    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog

    def run(self, planner: LoadPlanner, items: list[ReadItem]) -> None:
        for read in items:
            fqn = read.storage_index.fqn
            if read.type == LoadItemType.BYTE_IO:
                source, item = self._catalog.blobs[fqn]
                planner.load_bytes(read, io.BytesIO(source.blob(item)))
                continue
            offsets = tuple(read.storage_index.offset or ())
            source, item = self._catalog.tensors[(fqn, offsets)]
            data = narrow(source.tensor(item), read.storage_offsets, read.lengths)
            target = planner.resolve_tensor(read).detach()
            if target.shape != data.shape:
                raise RestoreError(
                    f"{fqn}: a read of shape {tuple(data.shape)} does not fit its target "
                    f"of shape {tuple(target.shape)}"
                )
            target.copy_(data)
            planner.commit_tensor(read, target)
        for source in self._catalog.sources:
            source.check_unchanged()


def _one_per_rank(sources: Sequence[ImageSource]) -> list[ImageSource]:
    if not sources:
        raise RestoreError("no images to restore from")
    saves = {(s.header.step, s.header.round, s.header.world_size) for s in sources}
    if len(saves) > 1:
        described = ", ".join(f"step {s} round {r} world {w}" for s, r, w in sorted(saves))
        raise RestoreError(f"the images come from different saves: {described}")
    chosen: dict[int, ImageSource] = {}
    for source in sources:
        held = chosen.get(source.header.rank)
        if held is None or (source.local and not held.local):
            chosen[source.header.rank] = source  # a local copy beats a fetched one
    return [chosen[r] for r in sorted(chosen)]


def _add_chunk(
    md: dict[str, STORAGE_TYPES],
    tensors: dict[tuple[str, tuple[int, ...]], _Location],
    source: ImageSource,
    item: ItemRecord,
) -> None:
    entry = md.setdefault(
        item.fqn,
        TensorStorageMetadata(
            properties=TensorProperties(
                dtype=dtype_of(item.dtype), requires_grad=item.requires_grad
            ),
            size=torch.Size(item.size),
            chunks=[],
        ),
    )
    if not isinstance(entry, TensorStorageMetadata):
        raise RestoreError(f"{item.fqn!r} is a tensor in one image, bytes in another")
    if tuple(entry.size) != item.size or entry.properties.dtype != dtype_of(item.dtype):
        raise RestoreError(
            f"{item.fqn!r} differs between images: {tuple(entry.size)} "
            f"{entry.properties.dtype} vs {item.size} {item.dtype}"
        )
    key = (item.fqn, item.chunk_offsets)
    # Replicas share their offsets; an empty chunk holds nothing to read.
    if key in tensors or math.prod(item.chunk_sizes) == 0:
        return
    tensors[key] = (source, item)
    entry.chunks.append(
        ChunkStorageMetadata(
            offsets=torch.Size(item.chunk_offsets), sizes=torch.Size(item.chunk_sizes)
        )
    )


def _check_coverage(md: Mapping[str, STORAGE_TYPES], chosen: Sequence[ImageSource]) -> None:
    for fqn, entry in md.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        held = sum(math.prod(chunk.sizes) for chunk in entry.chunks)
        if held != math.prod(entry.size):
            ranks = sorted(s.header.rank for s in chosen)
            world = chosen[0].header.world_size
            raise RestoreError(
                f"{fqn}: the images of ranks {ranks} hold {held} of its "
                f"{math.prod(entry.size)} elements; the images of every rank of the "
                f"saving world of {world} are needed"
            )


def _set_path(root: dict[str, Any], path: ObjectPath, value: object) -> None:
    """Put `value` at `path` (dict keys and list indices), creating containers on the way."""
    node: Any = root
    for key, next_key in itertools.pairwise(path):
        fresh: Any = [] if isinstance(next_key, int) else {}
        if isinstance(node, list):
            assert isinstance(key, int)
            node.extend([None] * (key + 1 - len(node)))
            if node[key] is None:
                node[key] = fresh
            node = node[key]
        else:
            node = node.setdefault(key, fresh)
    last = path[-1]
    if isinstance(node, list):
        assert isinstance(last, int)
        node.extend([None] * (last + 1 - len(node)))
    node[last] = value
