"""The job's status as a JSON document: what `dlmaster status --json` prints
and the master's `/api/v1/status` answers, one rendering for both.

It is `JobStatus` in protobuf's canonical JSON mapping, with field names as
in the .proto and every scalar present (zero values included), except that
64-bit integers are JSON numbers: the mapping writes them as strings (for
JavaScript, whose numbers hold 53 bits exactly), but the document's are
rounds, counts, steps, bytes and milliseconds, far below 2**53, and a reader
of `"round": 3` beside `"pid": 123` expects a number in both. A message
field (a node's `metrics`, `last_failure`, `checkpoints`) is absent when
unset. `job_status.schema.json` beside the .proto files is its JSON Schema.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.json_format import MessageToDict

from dlfleet.api.v1 import job_pb2

SCHEMA_PATH = Path(__file__).parent / "v1" / "job_status.schema.json"

_INT64 = (FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64)


def status_document(status: job_pb2.JobStatus) -> dict[str, Any]:
    document = MessageToDict(
        status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    _int64_as_numbers(document, status.DESCRIPTOR)
    return document


def _int64_as_numbers(document: dict[str, Any], descriptor: Descriptor) -> None:
    """Turn the 64-bit integers of `document` (a message of type `descriptor`
    as MessageToDict gave it) back into numbers, in place, by the fields'
    declared types: a string field holding digits stays a string."""
    for field in descriptor.fields:
        if field.name not in document:
            continue
        value = document[field.name]
        message = field.message_type
        if message is not None and message.GetOptions().map_entry:
            entry = message.fields_by_name["value"]
            document[field.name] = {key: _converted(entry, item) for key, item in value.items()}
        elif field.is_repeated:
            document[field.name] = [_converted(field, item) for item in value]
        else:
            document[field.name] = _converted(field, value)


def _converted(field: FieldDescriptor, value: Any) -> Any:
    if field.message_type is not None:
        if isinstance(value, dict):  # a well-known type renders as a string: kept
            _int64_as_numbers(value, field.message_type)
        return value
    if field.cpp_type in _INT64:
        return int(value)
    return value


def samples_per_second(nodes: Iterable[job_pb2.NodeStatus]) -> float:
    """The job's rate: the sum of its nodes' latest rates (each node's over
    its ranks, over its last heartbeat), which is what the training script
    measures too. One rule for the master's status and the supervisor's."""
    return sum(node.metrics.samples_per_second for node in nodes if node.HasField("metrics"))
