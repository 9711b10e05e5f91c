"""``bf16``: bfloat16 (fp32's range, 8 bits of mantissa).

Wire format: ``numel`` bfloat16 values, 2·numel bytes, no header. Rounding is
round-to-nearest-even, as torch's cast does."""
from __future__ import annotations

import torch

from .cast import CastCompressor

__all__ = ["BF16Compressor"]


class BF16Compressor(CastCompressor):
    """``bf16``; the wire format is in this module's docstring."""

    name = "bf16"
    wire_dtype = torch.bfloat16
