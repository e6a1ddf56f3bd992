"""The job's status as a JSON document: what `dlmaster status --json` prints
and the master's `/api/v1/status` answers, one rendering for both.

It is `JobStatus` in protobuf's canonical JSON mapping, with field names as
in the .proto and every scalar present (zero values included). So 64-bit
integers are strings, as that mapping says; a message field (a node's
`metrics`, `last_failure`, `checkpoints`) is absent when unset.
`job_status.schema.json` beside the .proto files is its JSON Schema.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict

from dlfleet.api.v1 import job_pb2

SCHEMA_PATH = Path(__file__).parent / "v1" / "job_status.schema.json"


def status_document(status: job_pb2.JobStatus) -> dict[str, Any]:
    return MessageToDict(
        status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
