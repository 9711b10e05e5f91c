"""Shared base of the dense compressors that only change the float format."""
from __future__ import annotations

from typing import ClassVar

import torch

from .base import Compressor, Refusals, as_bytes, from_bytes

__all__ = ["CastCompressor"]


class CastCompressor(Compressor):
    """Sends every element as ``wire_dtype``: deterministic, no header."""

    wire_dtype: ClassVar[torch.dtype] = torch.float32
    #: saturate to the wire format's finite range instead of overflowing to inf
    clamp: ClassVar[float | None] = None
    unbiased = False

    def payload_nbytes(self, numel: int) -> int:
        return numel * torch.empty((), dtype=self.wire_dtype).element_size()

    def _encode(self, flat: torch.Tensor, seed: int | None, shared=None) -> torch.Tensor:
        if self.clamp is not None:
            flat = flat.clamp(-self.clamp, self.clamp)
        # copy=True: the payload must never alias the caller's tensor
        return as_bytes(flat.to(self.wire_dtype, copy=True))

    def encodes_rows(self, device: torch.device) -> bool:
        return True  # chunks of a cast are the cast's slices: one cast for all of them

    def _encode_rows(self, rows: torch.Tensor, seeds, shared=None) -> torch.Tensor:
        return self._encode(rows.reshape(-1), None).view(rows.shape[0], -1)

    def _decode(self, payload: torch.Tensor, numel: int, seed: int | None, refusals: Refusals) -> torch.Tensor:
        return from_bytes(payload, self.wire_dtype).to(torch.float32)
