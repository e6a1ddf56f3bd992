"""The errors of the checkpoint package, one hierarchy for every module.

This module imports no torch: the node agent catches these too.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base of every checkpoint error."""


class ImageFormatError(CheckpointError):
    """A header or body is not a complete dlfleet image (corrupt, truncated, foreign)."""


class ImageCorruptError(ImageFormatError):
    """An item's bytes do not match the checksum its writer computed: the
    image was damaged in memory, on disk or on the way."""


class ImageChangedError(CheckpointError):
    """An image was overwritten by a newer save while it was being read."""


class SlotError(CheckpointError):
    """No image slot may take a save (each one holds the protected step)."""


class RestoreError(CheckpointError):
    """The given images cannot restore the given state (missing ranks, keys, shapes)."""


class TemplateRequiredError(RestoreError):
    """The checkpoint holds sharded tensors: only a template state dict can receive them."""


class PersistError(CheckpointError):
    """A persisted checkpoint folder could not be written or read."""


class PersistCorruptError(PersistError):
    """A complete folder's file is missing, or does not match its manifest."""


class PersistTimeoutError(PersistError):
    """The finishing rank waited too long for the parts of the other ranks."""


class UnsharedLocationError(PersistError):
    """Some host cannot see what rank 0 writes into the persist location: a
    folder persisted there could never be whole (see location.py)."""
