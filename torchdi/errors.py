"""Every error class torchdi raises (``torchdi.prep`` re-exports ``PreparationMismatchError`` beside ``Prep``)."""

from __future__ import annotations

import sys

__all__ = ["BackendUnavailableError", "PreparationMismatchError", "UnsupportedOperatorError"]


class PreparationMismatchError(ValueError):
    """A ``Prep`` was used with arguments it was not prepared for.

    The message has one line per argument (``ok`` or ``mismatch`` with expected and received),
    or names what changed the layout of ``f(x)`` the preparation holds.
    """


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
