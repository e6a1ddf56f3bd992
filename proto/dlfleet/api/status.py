"""The one table between dlfleet's error codes and gRPC status codes."""

from __future__ import annotations

import grpc

from dlfleet.api.errors import ERROR_CLASSES, DlfleetError, ErrorCode

# The metadata key that carries the job token on every RPC.
TOKEN_METADATA_KEY = "x-dlfleet-token"

GRPC_STATUS: dict[ErrorCode, grpc.StatusCode] = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.UNIMPLEMENTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
}

_ERROR_CODE: dict[grpc.StatusCode, ErrorCode] = {v: k for k, v in GRPC_STATUS.items()}


def status_of(error: DlfleetError) -> grpc.StatusCode:
    return GRPC_STATUS[error.code]


def status_number(error: DlfleetError) -> int:
    """`status_of` as the number a stream message carries (`StreamError.code`);
    `error_from_code` reads it back."""
    number: int = GRPC_STATUS[error.code].value[0]
    return number


def error_from_status(status: grpc.StatusCode, details: str) -> DlfleetError:
    """The domain error a client raises for a failed RPC."""
    code = _ERROR_CODE.get(status, ErrorCode.INTERNAL)
    return ERROR_CLASSES[code](details or status.name)


_BY_NUMBER: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def error_from_code(number: int, details: str) -> DlfleetError:
    """The domain error for a status code carried inside a message (streams)."""
    return error_from_status(_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN), details)
