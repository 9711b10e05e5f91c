"""``fp16``: IEEE half precision.

Wire format: ``numel`` float16 values, 2·numel bytes, no header. Values beyond
±65504 saturate to ±65504 rather than becoming inf; with error feedback the
excess is carried in the error memory instead of poisoning the average."""
from __future__ import annotations

import torch

from .cast import CastCompressor

__all__ = ["FP16Compressor"]


class FP16Compressor(CastCompressor):
    """``fp16``; the wire format is in this module's docstring."""

    name = "fp16"
    wire_dtype = torch.float16
    clamp = 65504.0
