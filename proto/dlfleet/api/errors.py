"""dlfleet's domain errors, shared by every component, and their wire codes.

Each error class names one `ErrorCode`; `dlfleet.api.status` maps those codes to
gRPC status codes in its one table, both ways. This module imports no grpc, so
the pure cores can raise these errors.
"""

from __future__ import annotations

import enum
from typing import ClassVar


class ErrorCode(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"
    FAILED_PRECONDITION = "failed_precondition"
    NOT_FOUND = "not_found"
    UNAUTHENTICATED = "unauthenticated"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    UNIMPLEMENTED = "unimplemented"
    INTERNAL = "internal"


class DlfleetError(Exception):
    """Base of every error dlfleet raises on purpose."""

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL


class InvalidArgument(DlfleetError):
    """The request itself is wrong: a bad field, a conflicting registration."""

    code = ErrorCode.INVALID_ARGUMENT


# How the master's refusal of a join begins once a round ended with every
# member's workers finished: the training is done, and a node that comes up
# after that (a replacement that was still starting) exits as one whose work
# is done instead of training a fresh model on a finished dataset.
TRAINING_DONE_REFUSAL = "training done:"


class TrainingDone(DlfleetError):
    """The job's training finished: no round forms any more."""

    code = ErrorCode.FAILED_PRECONDITION


class StaleError(DlfleetError):
    """The request refers to a lease, round or incarnation that is no longer
    current. It was rejected and changed nothing."""

    code = ErrorCode.FAILED_PRECONDITION


class NotFound(DlfleetError):
    code = ErrorCode.NOT_FOUND


class Unauthenticated(DlfleetError):
    code = ErrorCode.UNAUTHENTICATED


class ResourceExhausted(DlfleetError):
    code = ErrorCode.RESOURCE_EXHAUSTED


class Unavailable(DlfleetError):
    """The master could not be reached, or gave up, within the retry budget."""

    code = ErrorCode.UNAVAILABLE


class Unimplemented(DlfleetError):
    """The server does not serve this call: another kind of server (a master
    started without a job supervisor asked for the job's status), or an
    older one."""

    code = ErrorCode.UNIMPLEMENTED


ERROR_CLASSES: dict[ErrorCode, type[DlfleetError]] = {
    ErrorCode.INVALID_ARGUMENT: InvalidArgument,
    ErrorCode.FAILED_PRECONDITION: StaleError,
    ErrorCode.NOT_FOUND: NotFound,
    ErrorCode.UNAUTHENTICATED: Unauthenticated,
    ErrorCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    ErrorCode.UNAVAILABLE: Unavailable,
    ErrorCode.UNIMPLEMENTED: Unimplemented,
    ErrorCode.INTERNAL: DlfleetError,
}
