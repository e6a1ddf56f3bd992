"""Benchmark driver for dlfleet's master, run by bench/_harness.py under the
interpreter that runs the bench (the one dlfleet is installed in).

Two modes (option `mode`):

* `stream` (what dlfleet's loaders do): a `LeaseSession` on the LeaseStream RPC;
  one pair is one message each way that reports the previous shard DONE and
  leases the next (`session.lease(..., done=[previous])`); `close()` reports the
  last one. Every shard is leased once and acknowledged once, durably.
* `unary`: `MasterClient.lease(...)` then `MasterClient.report_done(...)`, two
  unary calls per pair, the same shape as DLRover's client.

Any outcome other than a shard (wait, end of epoch, end of dataset) is an error
here, never a pair; the benchmark registers a dataset far larger than any run
consumes.
"""

from __future__ import annotations

import os
from typing import Any

from dlfleet.api.client import LeaseSession, MasterClient
from dlfleet.api.v1 import shards_pb2


def _client(target: str, options: dict[str, str]) -> MasterClient:
    return MasterClient(target, token=options["token"])


class DlfleetDriver:
    def __init__(self, target: str, dataset: str, client_id: str, options: dict[str, str]) -> None:
        self._target = target
        self._dataset = dataset
        self._options = options
        self._node_id = f"bench-{os.getpid()}-{client_id}"
        self._stream = options.get("mode", "stream") == "stream"
        self._client: MasterClient | None = None
        self._session: LeaseSession | None = None
        self._held: list[int] = []

    def setup(self) -> None:
        self._client = _client(self._target, self._options)
        if self._stream:
            self._session = self._client.lease_session()

    def lease_and_ack(self) -> None:
        client = self._client
        assert client is not None, "setup() first"
        if self._session is not None:
            response = self._session.lease(
                self._dataset, node_id=self._node_id, rank=0, done=self._held
            )
        else:
            response = client.lease(self._dataset, node_id=self._node_id, rank=0)
        outcome = response.WhichOneof("outcome")
        if outcome != "shard":
            raise RuntimeError(f"lease gave {outcome}, not a shard: {response}")
        if self._session is not None:
            self._held = [response.shard.lease_id]
        else:
            client.report_done(self._dataset, response.shard.lease_id)

    def close(self) -> None:
        if self._client is not None:
            for lease_id in self._held:
                self._client.report_done(self._dataset, lease_id)
            self._held = []
            if self._session is not None:
                self._session.close()
                self._session = None
            self._client.close()
            self._client = None


def make_driver(
    target: str, dataset: str, client_id: str, options: dict[str, str]
) -> DlfleetDriver:
    return DlfleetDriver(target, dataset, client_id, options)


def register(
    target: str, dataset: str, geometry: dict[str, int], options: dict[str, str]
) -> dict[str, Any]:
    client = _client(target, options)
    try:
        response = client.register_dataset(
            shards_pb2.DatasetSpec(
                name=dataset,
                size=geometry["size"],
                batch_size=geometry["batch_size"],
                shard_size=geometry["shard_size"],
                epochs=1,
                shuffle=True,
                seed=1,
            )
        )
    finally:
        client.close()
    return {"created": bool(getattr(response, "created", True))}


def inspect(target: str, dataset: str, options: dict[str, str]) -> dict[str, Any]:
    """Leases the master still counts as out, and records it counts as done."""
    client = _client(target, options)
    try:
        status = client.dataset_status(dataset)
    finally:
        client.close()
    return {"outstanding": status.leases_active, "records_done": status.records_done}
