"""Errors raised by torchdi besides ``PreparationMismatchError`` (which lives with ``Prep``)."""

from __future__ import annotations

__all__ = ["BackendUnavailableError", "UnsupportedOperatorError"]


class BackendUnavailableError(RuntimeError):
    """The backend cannot run here: its package is not installed or its device is absent."""


class UnsupportedOperatorError(NotImplementedError):
    """This backend cannot compute this operator; the message names backends that can."""
