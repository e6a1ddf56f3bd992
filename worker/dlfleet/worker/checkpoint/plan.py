"""How an image lays out a state dict: the plan of its items, and the caches
that keep a save of an unchanged structure off DCP's planner.

The state dict is planned with DCP's own `DefaultSavePlanner`, locally and
with no collective (see `dlfleet.worker.checkpoint.image`). Planning is most
of a small state's save, and a training loop saves the same structure every
time: the same keys, tensors of the same shapes, plain values that mostly do
not change. So the last plan is kept (`PlanCache`) with the shape of the
nested state it was made from; a save whose nested state has that shape
takes its values by the same paths and reuses the layout, and a plain value
equal to the last one reuses its serialized bytes (`BlobCache`).
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from dlfleet.worker.checkpoint import files
from dlfleet.worker.checkpoint.errors import CheckpointError
from dlfleet.worker.checkpoint.files import ItemKind, ItemRecord
from dlfleet.worker.checkpoint.structure import SKELETON_KEY, with_skeleton

StateDict = dict[str, Any]

# A plain tensor this large is cut among the ranks of a node when striping.
STRIPE_MIN_BYTES = 1 << 20


def materialize(state_dict: Mapping[str, Any]) -> StateDict:
    """A shallow copy with each Stateful value replaced by its state_dict(), as dcp.save does."""
    return {
        k: v if type(v) in _NOT_STATEFUL else v.state_dict() if isinstance(v, Stateful) else v
        for k, v in state_dict.items()
    }


# Stateful is a runtime protocol, slow to test against: the usual values of a
# state dict are known not to be (a dict is not: it has no load_state_dict).
_NOT_STATEFUL = frozenset({dict, list, tuple, int, float, bool, str, bytes, type(None)})


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
class Planned:
    """One item of the plan, with the data to copy and its place in the body."""

    record: ItemRecord
    data: torch.Tensor | memoryview


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
    state's save. A DTensor or ShardedTensor anywhere: always planned anew.
    `nested` is the shape of the nested state that layout was made from:
    a save whose state has that shape skips DCP's flattening too."""

    def __init__(self) -> None:
        self.layout: _Layout | None = None
        self.nested: _Nested | None = None


@dataclass(frozen=True)
class _Nested:
    key: tuple[Any, ...]  # rank, stripe, and the nested state's shape (`_shape`)
    values: tuple[tuple[str, tuple[Any, ...]], ...]  # each flat fqn, the path to its value
    skeleton: str  # the state's skeleton (`structure.with_skeleton`)


class _Unplannable(Exception):
    """A value whose layout DCP computes each time (DTensor, ShardedTensor)."""


def plan_state(
    state_dict: Mapping[str, Any],
    rank: int,
    stripe: Stripe | None = None,
    blobs: BlobCache | None = None,
    cache: PlanCache | None = None,
) -> tuple[list[Planned], dict[str, files.ObjectPath]]:
    """The items of an image of `state_dict` (its Stateful values as their
    state dicts, and its skeleton), laid out in a body: from `cache` when
    the nested state has the shape of the last one planned, else by DCP."""
    state = materialize(state_dict)
    key = _nested_key(state, rank, stripe) if cache is not None else None
    if cache is not None and key is not None:
        nested, layout = cache.nested, cache.layout
        if nested is not None and layout is not None and nested.key == key:
            flat = {fqn: _value_at(state, path) for fqn, path in nested.values}
            flat[SKELETON_KEY] = nested.skeleton
            return _replan(layout, flat, blobs), layout.paths
    full = with_skeleton(state)
    planned, paths, mappings = _plan(full, rank, stripe, blobs, cache)
    if cache is not None:
        cache.nested = None
        if key is not None and cache.layout is not None:
            values = _original_paths(state, mappings)
            if values is not None:
                cache.nested = _Nested(key, values, full[SKELETON_KEY])
    return planned, paths


def _nested_key(state: StateDict, rank: int, stripe: Stripe | None) -> tuple[Any, ...] | None:
    try:
        return (rank, stripe, _shape(state))
    except _Unplannable:
        return None


def _shape(value: Any) -> Any:
    """What DCP's flattening and planning of `value` depend on: containers
    with their keys (and the keys' types), the type of each leaf, and each
    tensor's shape, dtype, device, layout and requires_grad."""
    kind = type(value)
    if isinstance(value, torch.Tensor):
        if not _is_plain_tensor(value):
            raise _Unplannable
        return (kind, value.shape, value.dtype, value.device, value.layout, value.requires_grad)
    if isinstance(value, Mapping):
        return (kind, tuple((type(k), k, _shape(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return (kind, tuple(_shape(v) for v in value))
    return kind


def _original_paths(
    state: StateDict, mappings: Mapping[str, Any]
) -> tuple[tuple[str, tuple[Any, ...]], ...] | None:
    """Each flat fqn (but the skeleton's) with the path to its value in
    `state` by the original keys (DCP's paths hold dict keys as strings);
    None when two keys of one dict print alike."""
    by_dcp: dict[tuple[Any, ...], tuple[Any, ...]] = {}

    def visit(value: Any, dcp: tuple[Any, ...], original: tuple[Any, ...]) -> bool:
        if dcp in by_dcp:
            return False
        by_dcp[dcp] = original
        if isinstance(value, Mapping):
            return all(visit(v, (*dcp, str(k)), (*original, k)) for k, v in value.items())
        if isinstance(value, list | tuple):
            return all(visit(v, (*dcp, i), (*original, i)) for i, v in enumerate(value))
        return True

    if not all(visit(v, (str(k),), (k,)) for k, v in state.items()):
        return None
    values = []
    for fqn, path in mappings.items():
        if fqn == SKELETON_KEY:
            continue
        original = by_dcp.get(tuple(path))
        if original is None:
            return None
        values.append((fqn, original))
    return tuple(values)


def _value_at(state: StateDict, path: tuple[Any, ...]) -> Any:
    value: Any = state
    for part in path:
        value = value[part]
    return value


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
) -> tuple[list[Planned], dict[str, files.ObjectPath], Mapping[str, Any]]:
    """DCP's local save plan of `state_dict`, laid out in a body: tensors
    first, then blobs (serialized again only when they changed, with `blobs`;
    the layout reused while the structure is the same, with `cache`)."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, storage_meta=None, is_coordinator=rank == 0)
    flat: StateDict = planner.state_dict
    key = _structure(flat, planner.mappings, rank, stripe) if cache is not None else None
    layout = cache.layout if cache is not None else None
    if layout is not None and key is not None and layout.key == key:
        return _replan(layout, flat, blobs), layout.paths, planner.mappings
    plan = planner.create_local_plan()
    planned: list[Planned] = []
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
        planned.append(Planned(record, data))
        offset = round_up(offset + record.length, files.ALIGNMENT)
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
    return planned, paths, planner.mappings


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


def _replan(layout: _Layout, flat: StateDict, blobs: BlobCache | None) -> list[Planned]:
    planned = [
        Planned(record, flat[fqn] if span is None else flat[fqn].narrow(0, *span))
        for fqn, record, span in layout.tensors
    ]
    offset = layout.blob_offset
    for fqn, primary in layout.blobs:
        data = _serialized(fqn, flat[fqn], blobs)
        record = ItemRecord(
            fqn=fqn, kind=ItemKind.BYTES, offset=offset, length=len(data), primary=primary
        )
        planned.append(Planned(record, data))
        offset = round_up(offset + len(data), files.ALIGNMENT)
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


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to
