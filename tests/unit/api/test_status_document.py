"""The job status document (`dlmaster status --json`, `/api/v1/status`) and its
committed JSON Schema stay in step with job.proto."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from dlfleet.api.status_document import SCHEMA_PATH, status_document
from dlfleet.api.v1 import checkpoint_pb2, job_pb2, nodecheck_pb2, rendezvous_pb2

# The schema's $defs: each names a message of one of these modules.
DEFINED = {
    "NodeStatus": job_pb2,
    "NodeMetrics": rendezvous_pb2,
    "DatasetProgress": job_pb2,
    "FailureReport": rendezvous_pb2,
    "CheckpointStatus": checkpoint_pb2,
    "NodeCheckVerdict": nodecheck_pb2,
    "PairMeasurement": nodecheck_pb2,
}


def schema() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(SCHEMA_PATH.read_text())
    return data


def full_status() -> job_pb2.JobStatus:
    """Every field set, as the job's supervisor fills it."""
    return job_pb2.JobStatus(
        job_name="job",
        phase="running",
        round=3,
        world_size=4,
        target_nodes=2,
        nodes=[
            job_pb2.NodeStatus(
                name="node-0",
                state="running",
                pid=123,
                relaunches=1,
                node_id="node-0#2",
                metrics=rendezvous_pb2.NodeMetrics(
                    cpu_percent=150.0,
                    rss_bytes=1 << 30,
                    peak_rss_bytes=1 << 31,
                    memory_limit_bytes=1 << 33,
                    steps_per_second=2.5,
                    samples_per_second=80.0,
                    step_time_ms=400.0,
                    steps=1000,
                ),
                detail="",
                memory_bytes=1 << 33,
                check=nodecheck_pb2.NodeCheckVerdict(
                    node_id="node-0#2",
                    faulty=True,
                    rule="compute_slow",
                    reason="matmul 30.0 ms, 3.0x the median 10.0 ms of the other nodes",
                    slow_factor=2.0,
                    compute_ms=30.0,
                    compute_reference_ms=10.0,
                    pairs=[
                        nodecheck_pb2.PairMeasurement(
                            peer="node-1#1", outcome="good", allreduce_ms=5.0
                        )
                    ],
                    pair_reference_ms=5.0,
                    took_ms=4_000,
                    at_ms=1_800_000_000_000,
                ),
            )
        ],
        datasets=[
            job_pb2.DatasetProgress(
                name="data",
                epoch=1,
                epochs=2,
                records_per_epoch=100,
                records_done=150,
                records_total=200,
                failed_shards=0,
            )
        ],
        samples_per_second=80.0,
        eta_seconds=0.6,
        last_failure=rendezvous_pb2.FailureReport(
            node_id="node-0#1", incarnation=1, round=2, exit_code=1, signal="SIGKILL"
        ),
        reason="",
        master_pid=99,
        master_restarts=0,
        master_up=True,
        last_plan="scale to 2 nodes",
        http_url="http://127.0.0.1:9100",
        checkpoints=checkpoint_pb2.CheckpointStatus(
            committed_step=10, restorable_step=10, bytes_held=1 << 20, persisted_step=-1
        ),
    )


def test_a_full_status_and_an_empty_one_match_the_schema() -> None:
    jsonschema.validate(status_document(full_status()), schema())
    jsonschema.validate(status_document(job_pb2.JobStatus()), schema())


def test_64_bit_integers_are_json_numbers_and_unset_messages_absent() -> None:
    document = status_document(full_status())
    assert document["round"] == 3
    assert document["nodes"][0]["memory_bytes"] == 1 << 33
    assert document["nodes"][0]["metrics"]["rss_bytes"] == 1 << 30
    assert document["nodes"][0]["check"]["at_ms"] == 1_800_000_000_000
    assert document["datasets"][0]["records_done"] == 150
    assert document["checkpoints"]["committed_step"] == 10
    assert document["checkpoints"]["persisted_step"] == -1
    assert '"round": 3,' in json.dumps(document)
    empty = status_document(job_pb2.JobStatus(round=7))
    assert empty["round"] == 7
    assert "last_failure" not in empty
    assert "checkpoints" not in empty


def test_the_schema_types_every_integer_of_the_proto_as_a_json_integer() -> None:
    integers = {
        FieldDescriptor.CPPTYPE_INT32,
        FieldDescriptor.CPPTYPE_INT64,
        FieldDescriptor.CPPTYPE_UINT32,
        FieldDescriptor.CPPTYPE_UINT64,
    }
    definitions = schema()["$defs"]
    for part, descriptor in [(schema(), job_pb2.JobStatus.DESCRIPTOR)] + [
        (definitions[name], getattr(module, name).DESCRIPTOR) for name, module in DEFINED.items()
    ]:
        for field in descriptor.fields:
            if field.cpp_type not in integers:
                continue
            spec = part["properties"][field.name]
            declared = spec["items"]["type"] if field.is_repeated else spec["type"]
            assert declared == "integer", f"{descriptor.name}.{field.name}"


def test_a_document_with_an_unknown_field_is_refused() -> None:
    document = status_document(full_status())
    document["surprise"] = 1
    with pytest.raises(jsonschema.ValidationError, match="surprise"):
        jsonschema.validate(document, schema())


@pytest.mark.parametrize(
    ("definition", "descriptor"),
    [
        (None, job_pb2.JobStatus.DESCRIPTOR),
        ("NodeStatus", job_pb2.NodeStatus.DESCRIPTOR),
        ("NodeMetrics", rendezvous_pb2.NodeMetrics.DESCRIPTOR),
        ("DatasetProgress", job_pb2.DatasetProgress.DESCRIPTOR),
        ("FailureReport", rendezvous_pb2.FailureReport.DESCRIPTOR),
        ("CheckpointStatus", checkpoint_pb2.CheckpointStatus.DESCRIPTOR),
        ("NodeCheckVerdict", nodecheck_pb2.NodeCheckVerdict.DESCRIPTOR),
        ("PairMeasurement", nodecheck_pb2.PairMeasurement.DESCRIPTOR),
    ],
)
def test_the_schema_names_every_field_of_the_proto(
    definition: str | None, descriptor: Descriptor
) -> None:
    part = schema() if definition is None else schema()["$defs"][definition]
    assert set(part["properties"]) == {field.name for field in descriptor.fields}
    for name, spec in part["properties"].items():
        assert spec.get("description") or "$ref" in spec or spec["type"] == "array", name
