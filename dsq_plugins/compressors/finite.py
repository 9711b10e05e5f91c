"""A cheap test for NaN/Inf in large tensors.

``torch.isfinite(t).all()`` makes a full boolean temporary and two passes; on
a 12M-element gradient that was a quarter of a whole DoubleSqueeze reduce on
CPU. Any NaN or Inf makes the sum non-finite (Inf - Inf is NaN), so a finite
sum proves the tensor finite in one reduction; only a non-finite sum (a real
NaN/Inf, or finite values whose sum overflows) pays for the exact test."""
from __future__ import annotations

import torch

__all__ = ["all_finite", "extremes_not_finite", "extremes_not_finite_fusable", "NONFINITE_WORDS", "status_of"]

#: how a payload that decodes to NaN or Inf is refused, in words, whichever test finds it
NONFINITE_WORDS = "decodes to non-finite values"


def all_finite(t: torch.Tensor) -> bool:
    """True iff every element of ``t`` is finite; exact, never a false answer."""
    if t.numel() == 0:
        return True
    if bool(torch.isfinite(t.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(t).all())


def extremes_not_finite(t: torch.Tensor, dim: int | None) -> torch.Tensor:
    """A device bool (per row along ``dim``): whether ``t`` holds a NaN or an
    Inf, from its extremes, with no host read. NaN propagates into the minimum
    and maximum and an Inf is one of them; zero times either is zero unless
    it is NaN or infinite, and the sum of two zeros cannot overflow."""
    low, high = torch.aminmax(t, dim=dim)
    return (low * 0 + high * 0) != 0


def extremes_not_finite_fusable(t: torch.Tensor, dim: int | None) -> torch.Tensor:
    """``extremes_not_finite`` for a compiler, which may fold x * 0 into 0: the extremes tested as they are."""
    low, high = torch.aminmax(t, dim=dim)
    return ~(torch.isfinite(low) & torch.isfinite(high))


def status_of(not_finite: torch.Tensor) -> torch.Tensor:
    """A header's status word from a device bool "not finite": 1 (``header.NONFINITE``) or 0 (OK), as int64."""
    return not_finite.to(torch.int64)
