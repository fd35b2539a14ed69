"""Errors raised by torchdi besides ``PreparationMismatchError`` (which lives with ``Prep``)."""

from __future__ import annotations

import sys

__all__ = ["BackendUnavailableError", "UnsupportedOperatorError"]


class BackendUnavailableError(RuntimeError):
    """The backend cannot run here: its package is not installed or its device is absent."""


class UnsupportedOperatorError(NotImplementedError):
    """This backend cannot compute this operator; the message names backends that can."""


def user_stacklevel() -> int:
    """The ``warnings.warn`` ``stacklevel`` that points at the first frame outside torchdi (the
    user's call, however deep the operator's path), for a warning issued by the caller."""
    frame, level = sys._getframe(1), 1
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("torchdi."):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level
