"""Errors a user causes by pointing the loader at the wrong thing.

Each message says what is wrong, where (the path, tensor or key) and what to do about it.
They are ValueErrors so callers that validate input generically still catch them.
"""

from __future__ import annotations


class LoadError(ValueError):
    """A checkpoint could not be loaded."""


class ModelNotFoundError(LoadError):
    """The model path names nothing the loader can read (or the embedded model is not installed)."""


class CorruptCheckpointError(LoadError):
    """The checkpoint is there but damaged: truncated, missing a shard, unreadable metadata."""


class UnsupportedCheckpointError(LoadError):
    """The checkpoint is well formed but uses something powertrain does not read yet."""
