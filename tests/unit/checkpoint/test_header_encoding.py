"""A header's items are formatted by hand (files._item_json): byte for byte
what json writes, and read back as they were, whatever the record holds."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dlfleet.worker.checkpoint import files
from dlfleet.worker.checkpoint.errors import ImageFormatError
from dlfleet.worker.checkpoint.files import ImageHeader, ItemKind, ItemRecord

ints = st.tuples(*[st.integers(0, 2**40)] * 2) | st.just(()) | st.tuples(st.integers(0, 9))
records = st.builds(
    ItemRecord,
    fqn=st.text(max_size=12),  # quotes, backslashes, control and non-ASCII characters
    kind=st.sampled_from(list(ItemKind)),
    offset=st.integers(0, 2**50),
    length=st.integers(0, 2**40),
    primary=st.booleans(),
    dtype=st.sampled_from(["", "float32", "bfloat16"]),
    size=ints,
    chunk_offsets=ints,
    chunk_sizes=ints,
    requires_grad=st.booleans(),
    digests=st.lists(st.integers(0, 2**64 - 1), max_size=3).map(tuple),
)


@given(records)
def test_an_item_is_written_as_json_writes_it(item: ItemRecord) -> None:
    # Twice, and with other checksums: the second time from the formatted fields kept.
    for record in (item, item, replace(item, digests=(*item.digests, 7))):
        want = json.dumps(files._encode_item(record), separators=(",", ":"))
        assert files._item_json(record) == want


@given(st.lists(records, max_size=4, unique_by=lambda r: r.fqn), st.integers(0, 2**40))
def test_a_header_reads_back_as_written(drawn: list[ItemRecord], step: int) -> None:
    # Records the reader accepts: inside the body, one checksum per piece.
    items = [
        replace(
            r,
            offset=files.PREAMBLE_BYTES + r.offset % 1000,
            length=r.length % 1000,
            digests=r.digests[:1],
        )
        for r in drawn
    ]
    header = ImageHeader(
        step=step,
        rank=1,
        world_size=2,
        round=3,
        nonce=5,
        body_name="b",
        body_nbytes=files.PREAMBLE_BYTES + 2000,
        items=tuple(items),
        paths={"a.b": ("a", "b")},
    )
    decoded = files.decode_header(files.encode_header(header))
    for got, item in zip(decoded.items, items, strict=True):
        want = item
        if item.kind is ItemKind.BYTES:  # a blob's record holds no tensor metadata
            want = ItemRecord(
                item.fqn, item.kind, item.offset, item.length, item.primary, digests=item.digests
            )
        assert got == want
    assert (decoded.step, decoded.paths) == (step, header.paths)


@given(records, st.lists(st.integers(0, 2**64 - 1), max_size=3).map(tuple))
def test_with_digests_changes_only_the_digests(item: ItemRecord, digests: tuple[int, ...]) -> None:
    assert files.with_digests(item, digests) == replace(item, digests=digests)


def summary_of(header: ImageHeader) -> files.ImageSummary:
    return files.ImageSummary(
        header.step,
        header.rank,
        header.world_size,
        header.round,
        header.nonce,
        header.body_name,
        header.body_nbytes,
    )


@given(
    st.integers(0, 2**62),
    st.integers(0, 7),
    st.integers(0, 2**40),
    st.text(max_size=12),  # quotes, backslashes, control and non-ASCII characters
    st.booleans(),
)
def test_a_summary_read_from_the_head_is_the_headers_own(
    step: int, rank: int, nonce: int, name: str, reordered: bool
) -> None:
    header = ImageHeader(
        step=step,
        rank=rank,
        world_size=8,
        round=3,
        nonce=nonce,
        body_name=name,
        body_nbytes=files.PREAMBLE_BYTES + 64,
        items=(ItemRecord("a", ItemKind.BYTES, files.PREAMBLE_BYTES, 8, True, digests=(1,)),),
        paths={"a": ("a",)},
    )
    data = files.encode_header(header)
    if reordered:  # a header of another writer's key order: read whole
        doc = json.loads(data)
        data = json.dumps(dict(reversed(list(doc.items())))).encode()
    assert files.decode_summary(data) == summary_of(header)


def test_a_summary_of_a_header_that_is_not_one_is_refused() -> None:
    good = ImageHeader(1, 0, 1, 0, 5, "b", files.PREAMBLE_BYTES, (), {})
    data = files.encode_header(good)
    for bad in (data[:-2], data.replace(b'"rank":0', b'"rank":3'), b"{}", b"not json"):
        with pytest.raises(ImageFormatError):
            files.decode_summary(bad)
