"""A decoded payload that stays sparse where the operator keeps few elements.

Top-k, random-k and blocksign decode to a vector that is zero outside k
positions. Materialising it (zeros, a scatter) only to add it to a sum or
subtract it from a residual costs two passes over the whole chunk for k
useful elements. ``Decoded`` keeps ``values`` at ``positions`` instead, and
its arithmetic touches only those positions.

Bits: adding or subtracting zero leaves every other element as it was, so
``add_to_`` and ``subtract_from_`` give the same values as the dense
``out + dense()`` and ``out - dense()``, element for element (``-0.0`` may
come out as ``+0.0`` or back, which compares equal). Positions must be
distinct, which every sparse decoder checks or has by construction.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels
from .finite import all_finite

__all__ = ["Decoded"]


@dataclass
class Decoded:
    """``values`` at ``positions`` in a vector of ``numel`` zeros, or, when
    ``positions`` is None, the dense vector ``values`` itself (fp32, flat)."""

    values: torch.Tensor
    numel: int
    positions: torch.Tensor | None = None
    #: the positions increase (top-k and blocksign payloads): a range of them is found by bisection
    increasing: bool = False

    @property
    def is_sparse(self) -> bool:
        return self.positions is not None

    def dense(self) -> torch.Tensor:
        """The whole vector (the dense ``values`` themselves, not a copy)."""
        if self.positions is None:
            return self.values
        out = torch.zeros(self.numel, dtype=self.values.dtype, device=self.values.device)
        return out.index_copy_(0, self.positions, self.values)

    def is_finite(self) -> bool:
        """Whether every element is finite (only the kept ones can fail to be)."""
        return all_finite(self.values)

    def write_to_(self, out: torch.Tensor) -> torch.Tensor:
        """``out[:] = self`` (cast to ``out``'s dtype), without a temporary of ``out``'s size."""
        if self.positions is None:
            return out.copy_(self.values)
        return out.zero_().index_copy_(0, self.positions, self.values.to(out.dtype))

    def section(self, start: int, end: int) -> "Decoded":
        """Elements ``[start, end)`` of the vector, as a ``Decoded`` of their own."""
        if self.positions is None:
            return Decoded(self.values[start:end], end - start)
        inside = (self.positions >= start) & (self.positions < end)
        return Decoded(self.values[inside], end - start, self.positions[inside] - start, self.increasing)

    def write_range_to_(self, out: torch.Tensor, start: int) -> torch.Tensor:
        """``out[:] = self[start: start + out.numel()]`` (a bucket's tensor
        written from the chunk that covers it), with no host read on a GPU.
        ``section`` selects by a mask, whose size the host must read; here a
        CPU bisects increasing positions (reading two numbers is free there),
        and otherwise every kept element is added into zeros, those outside
        the range as a zero at a clamped position (adding zero changes
        nothing; the positions inside are distinct)."""
        if self.positions is None:
            return out.copy_(self.values[start: start + out.numel()])
        end = start + out.numel()
        if self.increasing and not kernels.launch_bound(self.positions.device):
            lo, hi = torch.searchsorted(self.positions, torch.tensor([start, end])).tolist()
            at = (self.positions[lo:hi] - start).clamp_(0, max(out.numel() - 1, 0))  # in range for any bytes
            return out.zero_().index_copy_(0, at, self.values[lo:hi].to(out.dtype))
        inside = (self.positions >= start) & (self.positions < end)
        at = (self.positions - start).clamp_(0, max(out.numel() - 1, 0))
        return out.zero_().index_add_(0, at, torch.where(inside, self.values, 0.0).to(out.dtype))

    def add_to_(self, out: torch.Tensor) -> torch.Tensor:
        """``out += self`` in place."""
        if self.positions is None:
            return out.add_(self.values)
        # positions are distinct, so each element takes one addition: exact and deterministic on every
        # device (CUDA's atomic adds never meet), and one pass where a gather and a scatter take two
        return out.index_add_(0, self.positions, self.values)

    def subtract_from_(self, out: torch.Tensor) -> torch.Tensor:
        """``out -= self`` in place."""
        if self.positions is None:
            return out.sub_(self.values)
        return out.index_add_(0, self.positions, self.values, alpha=-1)  # x + (-v) is x - v, exactly
