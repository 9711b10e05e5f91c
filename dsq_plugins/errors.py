"""Exceptions the engine raises. Each names what is wrong and, where a peer is
to blame, which rank, so that a user reading any rank's log knows the cause."""
from __future__ import annotations

__all__ = ["AdamCompressionWarning", "CollectiveMismatchError", "ConfigError", "DSQError", "ErrorFeedbackWarning",
    "LayoutError", "NonFiniteGradientError", "PayloadError", "PeerFailedError", "PeerStatusError", "StateError"]


class DSQError(RuntimeError):
    """Base class of every error raised by dsq-plugins."""


class ConfigError(DSQError, ValueError):
    """A bad compressor name, parameter, or reducer/config option."""


class StateError(DSQError, ValueError):
    """Saved state that does not fit: a checkpoint from another rank, world
    size or set of parameters, or an error memory whose tensor changed size."""


class LayoutError(DSQError, ValueError):
    """Tensors that cannot be laid out into buckets (a name given twice)."""


class ErrorFeedbackWarning(UserWarning):
    """Error feedback was asked for on a pass whose operator is not a
    contraction: its residual can grow until training diverges."""


class AdamCompressionWarning(UserWarning):
    """Gradient compression with error feedback feeds an Adam-family
    optimizer: it trains worse than compressing Adam's momentum instead
    (``CompressedAdam``)."""


class PayloadError(DSQError):
    """A payload that cannot be decoded: wrong length, dtype, or content.

    ``rank`` is the peer that sent it when known, else ``None``."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class NonFiniteGradientError(DSQError, FloatingPointError):
    """A gradient (or compensated gradient) held NaN or Inf on some rank.

    Raised on every rank, before any error-feedback state is changed."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


class CollectiveMismatchError(DSQError):
    """Ranks entered one collective with different tensors (name or size):
    a programming error that would otherwise average unrelated data or hang."""


class PeerFailedError(DSQError):
    """Another rank failed inside a collective, or could not take part in it;
    this rank stops too. ``ranks`` are the ranks that failed, when known."""

    def __init__(self, message: str, ranks: list[int] | None = None):
        super().__init__(message)
        self.ranks = ranks or []


class PeerStatusError(DSQError):
    """Some rank entered a collective with a non-zero header status; every
    rank raises it with the same ``statuses`` ({rank: code}, see
    ``dsq_plugins.comm.header``), and the caller turns it into the error it means."""

    def __init__(self, statuses: dict[int, int]):
        super().__init__(f"ranks reported non-zero status: {statuses}")
        self.statuses = statuses
