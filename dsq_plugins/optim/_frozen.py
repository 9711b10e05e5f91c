"""What stays fixed after ``CompressedAdam``'s variance froze: each
parameter's denominator (floored, ``optim._kernel``) and where its frozen
variance is zero, where the momentum is kept at zero. Made once, at the
first step after the freeze (or a load), then only read."""
from __future__ import annotations

import torch

from ..compressors.kernels import launch_bound

__all__ = ["FrozenDenominators", "ZeroVariance"]

#: a CPU zeroes by index where fewer than 1 in this many coordinates have no variance (an index costs more than a
#: mask's multiply per coordinate, but the mask's pass covers every coordinate)
SPARSE_FROM = 16


class FrozenDenominators:
    """Each parameter's frozen denominator, floored, and a 0/1 mask of where
    its frozen variance is nonzero, for the parameters that have a zero
    (most have none: one host read, once, finds them). Both are constant
    after the freeze, so a step divides and masks a group in one
    multi-tensor op each, where recomputing them took a few ops per tensor."""

    def __init__(self, denominators: list[torch.Tensor], variances: list[torch.Tensor]):
        self.denominators = denominators
        if not variances:
            self.masked: list[int] = []
        else:
            has_zero = torch.stack([(v == 0).any() for v in variances]).tolist()
            self.masked = [i for i, zero in enumerate(has_zero) if zero]
        self.masks = {i: (variances[i] != 0).to(denominators[i].dtype) for i in self.masked}
        self._flat: tuple[torch.Tensor, ZeroVariance | None] | None = None

    def flat(self) -> tuple[torch.Tensor, "ZeroVariance | None"]:
        """The denominators laid end to end, and where the variance is zero
        over that vector, or None where no tensor has a zero: made once."""
        if self._flat is None:
            denominator = torch.cat([d.reshape(-1) for d in self.denominators])
            mask = torch.cat([self.masks[i].reshape(-1) if i in self.masks else torch.ones_like(d.reshape(-1))
                              for i, d in enumerate(self.denominators)]) if self.masked else None
            numels = [d.numel() for d in self.denominators]  # the tensors become views: D is held once
            self.denominators = [piece.view_as(d) for piece, d in zip(denominator.split(numels), self.denominators)]
            self._flat = (denominator, None if mask is None else ZeroVariance(mask))
        return self._flat

    def mask_(self, tensors: list[torch.Tensor], at: slice) -> None:
        """Zero each of ``tensors`` (the parameters of ``at``) where its frozen variance is zero, in place."""
        first = at.start or 0
        masked = [i for i in self.masked if first <= i < at.stop]
        if masked:
            torch._foreach_mul_([tensors[i - first] for i in masked], [self.masks[i] for i in masked])


class ZeroVariance:
    """Where a flat vector's frozen variance is zero, from its 0/1 ``mask``:
    ``apply_`` multiplies a vector by the mask there, as ``x.mul_(mask)`` does
    (x·0 keeps a zero's sign and a NaN). A GPU multiplies by the whole mask,
    one launch; a CPU, which pays for every coordinate a pass covers,
    multiplies only the few coordinates by index (one host read, once, finds
    them) where they are few, as a model's rarely seen embedding rows are."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask
        self.index: torch.Tensor | None = None
        if not launch_bound(mask.device):
            zeros = (mask == 0).nonzero().reshape(-1)
            if zeros.numel() * SPARSE_FROM < mask.numel():
                self.index = zeros

    def apply_(self, x: torch.Tensor) -> torch.Tensor:
        """``x.mul_(mask)``, in place (the same bits either way)."""
        if self.index is None:
            return x.mul_(self.mask)
        return x.index_copy_(0, self.index, x.index_select(0, self.index).mul_(0.0))
