"""The brain's errors. Bad input and unknown jobs or plans raise the shared
`InvalidArgument` / `NotFound` of `dlfleet.api.errors`; these cover the rest."""

from __future__ import annotations

from dlfleet.api.errors import DlfleetError, ErrorCode


class BrainError(DlfleetError):
    """Base of the brain's own errors."""


class DatabaseError(BrainError):
    """The database could not be reached or refused a statement; the
    operation changed nothing. The database's reason is chained."""

    code = ErrorCode.UNAVAILABLE


class SchemaError(BrainError):
    """The database's schema is not one this brain knows (for example a newer
    brain migrated it)."""

    code = ErrorCode.FAILED_PRECONDITION
