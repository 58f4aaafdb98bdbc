"""The errors of finding and reading a model, shared by the loader and the registry (no imports)."""

from __future__ import annotations


class ModelNotFoundError(ValueError):
    """The model could not be found or is malformed; the message says what was looked for."""


class UnsupportedArchitectureError(ModelNotFoundError):
    """An architecture tinyvllm does not run; the message names it and lists the supported ones."""


class UnsupportedConfigError(ModelNotFoundError):
    """A config feature tinyvllm does not run (a rope scaling type, an attention variant), named."""
