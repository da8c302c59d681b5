"""The one error hierarchy of shardsmith.

Every class inherits the builtin a caller would naturally catch, so
``except FileNotFoundError`` still works for a missing checkpoint. Messages say
what was wrong, where (file, field, rank) and what to do.
"""

from __future__ import annotations


class ShardsmithError(Exception):
    """Base class of every error shardsmith raises on purpose."""


class ConfigError(ShardsmithError, ValueError):
    """A configuration value is out of range or inconsistent with another."""


class LayoutError(ShardsmithError, ValueError):
    """A parallel layout does not divide the model (names the dimension and what would work)."""


class CheckpointError(ShardsmithError):
    """Base class of problems with a checkpoint on storage."""


class TargetCommitted(CheckpointError, FileExistsError):
    """A write target (reshard, conversion, import) is already a committed checkpoint step."""


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    """No committed checkpoint where one was asked for."""


class ManifestError(CheckpointError, ValueError):
    """A manifest is malformed, of an unknown version, or inconsistent (names field and file)."""


class IntegrityError(CheckpointError, ValueError):
    """Bytes on storage do not match the manifest's size or checksum (names the file)."""


class StorageError(ShardsmithError, OSError):
    """A storage operation failed after retries, or failed permanently (names the URL)."""


class StorageNotFound(StorageError, FileNotFoundError):
    """An object, prefix or bucket does not exist (names the URL and the server's reason)."""


class BucketNotFound(StorageNotFound):
    """The bucket itself does not exist: no key under it can be found (never read as an
    empty prefix or an uncommitted step)."""


class StorageAccessDenied(StorageError, PermissionError):
    """The storage refused the credentials or the operation (names the URL; check credentials)."""


class SaveError(CheckpointError, RuntimeError):
    """A checkpoint save failed. The message says whether the step was committed (it is
    not, unless a failure came after the manifest was written; `shardsmith ls` tells)."""


class SaveNotCommitted(SaveError):
    """A save that every rank of it saw fail before its commit (the outcome is broadcast):
    nothing was committed, and every rank raises this same error at the same point."""


class TrainingDiverged(ShardsmithError, RuntimeError):
    """Bad steps could not be recovered from (no checkpoint, or too many rollbacks)."""


class SilentDataCorruption(ShardsmithError, RuntimeError):
    """A replayed step's gradients differ from the original's on some rank (``--on-sdc stop``;
    names the ranks and tensors)."""


class CheckpointMismatch(CheckpointError, ValueError):
    """A checkpoint does not fit the job that loads it: another model shape, missing or
    unexpected tensors, no optimizer state for a resume, or another run's root (names every
    difference and the way forward)."""
