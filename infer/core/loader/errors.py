"""What can go wrong when loading a model. Every message names the problem and the fix."""

from __future__ import annotations


class LoaderError(ValueError):
    """A model could not be loaded; the message says why and what to do."""


class ModelNotFoundError(LoaderError, FileNotFoundError):
    """No file, directory or alias by that name."""


class UnsupportedArchitectureError(LoaderError):
    """The checkpoint is an architecture infer has no graph builder for."""


class CorruptCheckpointError(LoaderError):
    """A weight file is truncated, malformed, or disagrees with its index."""


class PickledCheckpointError(LoaderError):
    """A .bin/.pt checkpoint: loading it would mean unpickling, which runs arbitrary code."""
