"""``terngrad``: TernGrad (Wen et al., 2017), unbiased stochastic ternary
values {-1, 0, +1}·max|x|.

Wire format, 4·B + ceil(numel/4) bytes:
    [0:4·B]   float32 max |x| of each bucket (B = 1 unless ``bucket_size``)
    [4·B:]    one 2-bit code per element, q + 1 with q in {-1, 0, 1}, four
              per byte, most significant first
Element x is sent as sign(x) with probability |x|/max, else 0."""
from __future__ import annotations

from . import levels as lv
from .base import positive_int

__all__ = ["TernGradCompressor"]


class TernGradCompressor(lv.LevelsCompressor):
    """``terngrad``; the wire format is in this module's docstring."""

    name = "terngrad"
    unbiased = True
    randomized = True
    levels = 1  # codes -1, 0, +1
    norm = "max"

    def __init__(self, bucket_size: int | None = None, seed: int = 0):
        super().__init__(seed)
        if bucket_size is not None:
            positive_int(bucket_size, "terngrad: bucket_size")
        self.bucket_size = bucket_size

    def params(self):
        return {"bucket_size": self.bucket_size, **super().params()}

    def is_contraction(self) -> bool:
        # E||x - C(x)||² = sum |x_i|(m - |x_i|) for m = max|x|, which exceeds ||x||² for spread-out x
        return False
