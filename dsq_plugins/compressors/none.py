"""``none``: no compression, the fp32 value of every element.

Wire format: ``numel`` little-endian float32 values, 4·numel bytes, no header.
Exact (decompress(compress(x)) == x in fp32)."""
from __future__ import annotations

import torch

from .cast import CastCompressor

__all__ = ["NoCompression"]


class NoCompression(CastCompressor):
    """``none``; the wire format is in this module's docstring."""

    name = "none"
    wire_dtype = torch.float32
    unbiased = True
    decodes_finite = True  # the vector itself
