"""Images held by other nodes: fetched from their agent's `Keeper` service."""

from __future__ import annotations

import grpc

from dlfleet.api.status import TOKEN_METADATA_KEY
from dlfleet.api.v1 import checkpoint_pb2, checkpoint_pb2_grpc
from dlfleet.worker.checkpoint.errors import CheckpointError

# Pieces are at most 2 MiB of body plus the header (first piece): allow more.
_MAX_MESSAGE = 64 << 20


def fetch_image(address: str, token: str, step: int, rank: int) -> tuple[bytes, bytes]:
    """(header, body) of rank `rank`'s image of `step`, from the Keeper at `address`."""
    with grpc.insecure_channel(
        address, options=[("grpc.max_receive_message_length", _MAX_MESSAGE)]
    ) as channel:
        stub = checkpoint_pb2_grpc.KeeperStub(channel)
        header = b""
        chunks: list[bytes] = []
        try:
            for piece in stub.Fetch(
                checkpoint_pb2.FetchRequest(step=step, rank=rank),
                metadata=((TOKEN_METADATA_KEY, token),),
                timeout=120.0,
            ):
                if piece.header:
                    header = piece.header
                chunks.append(piece.data)
        except grpc.RpcError as exc:
            why = f"{exc.code().name} {exc.details()}"
            raise CheckpointError(
                f"fetching rank {rank} step {step} from {address}: {why}"
            ) from None
    if not header:
        raise CheckpointError(f"{address} sent no image of rank {rank} step {step}")
    return header, b"".join(chunks)
