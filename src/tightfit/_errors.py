"""Exception and warning types that tightfit raises (public through ``tightfit``)."""

from __future__ import annotations

__all__ = ["FallbackWarning", "StrictModeError", "BackendConflictError"]


class FallbackWarning(UserWarning):
    """A slower path ran: the reference kernel, or the op on the CPU instead of its device."""


class StrictModeError(RuntimeError):
    """Raised in strict mode where tightfit would otherwise fall back and warn."""


class BackendConflictError(RuntimeError):
    """Two backend plugins claim the same torch device type."""
