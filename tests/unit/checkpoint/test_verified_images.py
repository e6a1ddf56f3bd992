"""Every image carries a checksum per piece of each item, computed by the
writer as it copies; a damaged image is refused where it is read (a restore
opening it, a node receiving it as a replica), naming the item."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from unit.checkpoint.states import training_state

from dlfleet.api.client import MasterClient
from dlfleet.api.v1 import checkpoint_pb2
from dlfleet.worker.agent.keeper import ImageKeeper
from dlfleet.worker.checkpoint import files
from dlfleet.worker.checkpoint.errors import CheckpointError, ImageCorruptError, ImageFormatError
from dlfleet.worker.checkpoint.image import BytesImage, ImageWriter, LocalImage


def flip(path: Path, offset: int) -> None:
    """Flip one bit of a file in place, as a bad DIMM or a stray write would."""
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def item(header: files.ImageHeader, fqn: str) -> files.ItemRecord:
    return next(i for i in header.items if i.fqn == fqn)


def test_every_item_carries_checksums_that_verify(tmp_path: Path) -> None:
    with ImageWriter(tmp_path, rank=0) as writer:
        saved = writer.write(3, training_state(0), round=1, world_size=1, protect=None)
    header = files.read_header(saved.header_path)
    assert header.items and all(len(i.digests) == 1 for i in header.items)
    LocalImage(saved.header_path)  # verifies
    files.verify_items(header, saved.body_path.read_bytes())


def test_a_bit_flipped_in_a_shared_memory_image_names_the_tensor(tmp_path: Path) -> None:
    with ImageWriter(tmp_path, rank=0) as writer:
        saved = writer.write(3, training_state(0), round=1, world_size=1, protect=None)
    header = files.read_header(saved.header_path)
    damaged = item(header, "model.2.weight")
    flip(saved.body_path, damaged.offset + damaged.length // 2)
    with pytest.raises(ImageCorruptError, match=r"'model\.2\.weight'.*does not match its checksum"):
        LocalImage(saved.header_path)
    raw_header, body = files.read_image_bytes(saved.header_path)  # shipping does not verify
    with pytest.raises(ImageCorruptError, match=r"rank 0 step 3: 'model\.2\.weight'"):
        BytesImage(raw_header, body)


@pytest.mark.parametrize("threads", [1, 3])
def test_a_large_tensor_is_summed_piece_by_piece_and_the_damaged_piece_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    monkeypatch.setattr(files, "DIGEST_PIECE_BYTES", 4096)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    state = {"big": torch.arange(5000, dtype=torch.float32), "small": torch.ones(3)}
    with ImageWriter(tmp_path, rank=0) as writer:
        saved = writer.write(1, state, round=0, world_size=1, protect=None)
    header = files.read_header(saved.header_path)
    big = item(header, "big")
    assert len(big.digests) == 5  # 20,000 bytes in pieces of 4,096
    assert LocalImage(saved.header_path).tensor(big).equal(state["big"])
    flip(saved.body_path, big.offset + 3 * 4096 + 7)
    with pytest.raises(ImageCorruptError, match=r"'big' \(piece 4 of 5\)"):
        LocalImage(saved.header_path)


@pytest.mark.parametrize("size", [1, 977, 4096, 1 << 20])
def test_a_body_fed_in_pieces_of_any_size_verifies_the_same(tmp_path: Path, size: int) -> None:
    with ImageWriter(tmp_path, rank=0) as writer:
        saved = writer.write(3, training_state(0), round=1, world_size=1, protect=None)
    header = files.read_header(saved.header_path)
    body = saved.body_path.read_bytes()[: header.body_nbytes]

    def feed(data: bytes) -> None:
        verifier = files.BodyVerifier(header)
        for at in range(0, len(data), size):
            verifier.feed(data[at : at + size])
        verifier.finish()

    feed(body)
    damaged = bytearray(body)
    last = header.items[-1]
    damaged[last.offset] ^= 1
    with pytest.raises(ImageCorruptError, match=repr(last.fqn).replace(".", r"\.")):
        feed(bytes(damaged))
    with pytest.raises(ImageFormatError, match="ended after"):
        feed(body[: last.offset + last.length - 1])


def test_a_node_refuses_a_damaged_replica_and_keeps_nothing_of_it(tmp_path: Path) -> None:
    with ImageWriter(tmp_path / "sender", rank=1) as writer:
        saved = writer.write(5, training_state(1), round=2, world_size=2, protect=None)
    raw_header, body = files.read_image_bytes(saved.header_path)
    header = files.decode_header(raw_header)
    damaged = bytearray(body)
    damaged[item(header, "model.0.bias").offset] ^= 0x01
    # The master is never called for a refused replica: nothing listens here.
    client = MasterClient("127.0.0.1:1", token="t", timeout_s=0.1)
    keeper = ImageKeeper(
        tmp_path / "receiver",
        client=client,
        token="t",
        node_id="b#1",
        incarnation=1,
        address="127.0.0.1:2",
    )
    try:
        pieces = [
            checkpoint_pb2.ImagePiece(
                step=5,
                rank=1,
                round=2,
                world_size=2,
                origin_node="a#1",
                header=raw_header if at == 0 else b"",
                total_bytes=len(damaged) if at == 0 else 0,
                offset=at,
                data=bytes(damaged[at : at + 1000]),
            )
            for at in range(0, len(damaged), 1000)
        ]
        with pytest.raises(CheckpointError, match=r"'model\.0\.bias'.*checksum"):
            keeper.receive(iter(pieces))
        assert not list((tmp_path / "receiver" / "replicas").rglob("rank-*"))
    finally:
        keeper.close()
        client.close()
