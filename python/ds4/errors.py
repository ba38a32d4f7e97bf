"""The ds4 exception hierarchy.

Every error ds4 raises on purpose is a :class:`Ds4Error`. Errors about bad input are also
``ValueError`` so code that already catches ``ValueError`` keeps working. A missing file is
the built-in ``FileNotFoundError``.
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "BackendUnavailable",
    "ContextOverflowError",
    "DraftMismatchError",
    "Ds4Error",
    "GGUFError",
    "UnsupportedModelError",
]


class Ds4Error(Exception):
    """Base class of every ds4 error."""


class GGUFError(Ds4Error, ValueError):
    """A GGUF file is malformed: bad magic, unsupported version, truncated data, overflowing
    counts or shapes, offsets out of bounds or misaligned, unknown types, duplicate names."""


class UnsupportedModelError(Ds4Error, ValueError):
    """A well-formed file that ds4 cannot run: an unsupported tensor type or architecture."""


class ContextOverflowError(Ds4Error, ValueError):
    """More tokens than the session's context holds. Nothing was evaluated."""


class DraftMismatchError(Ds4Error, ValueError):
    """A drafter (MTP or DSpark support weights) that does not fit the target model: the
    message names what differs (vocabulary, hidden size, target layers, noise token...)."""


class BackendUnavailable(Ds4Error, RuntimeError):
    """The requested compute backend cannot run here: no GPU, no driver, or not built in."""


class BackendError(Ds4Error, RuntimeError):
    """A compute backend failed while running (a driver or kernel error)."""
