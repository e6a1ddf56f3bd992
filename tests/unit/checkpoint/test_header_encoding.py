"""A header's items are formatted by hand (files._item_json): byte for byte
what json writes, and read back as they were, whatever the record holds."""

from __future__ import annotations

import json
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from dlfleet.worker.checkpoint import files
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
