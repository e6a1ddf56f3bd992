"""Benchmark driver for DLRover's master (dlrover 0.6.1), run by bench/_harness.py
under the DLRover benchmark environment (.bench-venv-dlrover).

One pair is DLRover's own worker-side sequence, through its own gRPC client
(`dlrover.python.elastic_agent.master_client.GrpcMasterClient`, the class its
ShardingClient uses): `get_task(dataset)` and then
`report_task_result(dataset, task_id, "")` (empty error message: success).

DLRover sizes a shard as `batch_size * num_minibatches_per_shard` records; the
geometry is mapped so the shard has the same number of records as dlfleet's. A
dataset with more than 50,000 shards is cut by DLRover into sub-epochs of 50,000
shards that it creates when the previous one runs out (the first one at the
first `get_task`, which is in the warm-up).

`get_task` on an exhausted dataset returns a task with an empty shard (type WAIT
while other tasks are still out, else nothing): that is an error here, never a
pair, and the benchmark registers a dataset far larger than any run consumes.
"""

from __future__ import annotations

import json
from typing import Any


def _client(target: str, node_id: int) -> Any:
    from dlrover.python.elastic_agent.master_client import (  # type: ignore[import-not-found]
        GrpcMasterClient,
    )

    # The constructor builds a fresh client with its own gRPC channel; the
    # singleton is only `GrpcMasterClient.singleton_instance()`, unused here.
    return GrpcMasterClient(target, node_id, "worker", 5)


def _node_id(client_id: str) -> int:
    proc, _, thread = client_id.partition("-")
    return int(proc) * 10_000 + int(thread)


class DlroverDriver:
    def __init__(self, target: str, dataset: str, client_id: str) -> None:
        self._target = target
        self._dataset = dataset
        self._node_id = _node_id(client_id)
        self._client: Any = None

    def setup(self) -> None:
        self._client = _client(self._target, self._node_id)
        if self._client._stub is None or self._client._channel is None:
            raise RuntimeError(f"DLRover client could not connect to {self._target}")

    def lease_and_ack(self) -> None:
        ok, task = self._client.get_task(self._dataset)
        if not ok or not task.shard.name:
            raise RuntimeError(f"get_task gave no shard: success={ok} task={task}")
        self._client.report_task_result(self._dataset, task.task_id, "")

    def close(self) -> None:
        if self._client is not None and self._client._channel is not None:
            self._client._channel.close()
            self._client._channel = None


def make_driver(
    target: str, dataset: str, client_id: str, options: dict[str, str]
) -> DlroverDriver:
    return DlroverDriver(target, dataset, client_id)


def register(
    target: str, dataset: str, geometry: dict[str, int], options: dict[str, str]
) -> dict[str, Any]:
    batch_size = geometry["batch_size"]
    shard_size = geometry["shard_size"]
    if shard_size % batch_size:
        raise SystemExit("DLRover shards are whole batches: shard size must be a multiple")
    client = _client(target, 999_999)
    response = client.report_dataset_shard_params(
        batch_size=batch_size,
        num_epochs=1,
        dataset_size=geometry["size"],
        shuffle=True,
        num_minibatches_per_shard=shard_size // batch_size,
        dataset_name=dataset,
    )
    client._channel.close()
    if not response.success:
        raise RuntimeError(f"DLRover refused the dataset: {response}")
    return {"created": True}


def inspect(target: str, dataset: str, options: dict[str, str]) -> dict[str, Any]:
    """Shards DLRover still has out (`doing`) and still to hand out (`todo`),
    from its shard checkpoint."""
    client = _client(target, 999_998)
    content = client.get_shard_checkpoint(dataset)
    client._channel.close()
    checkpoint = json.loads(content)
    return {"outstanding": len(checkpoint["doing"]), "todo": len(checkpoint["todo"])}
