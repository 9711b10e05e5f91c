"""``qsgd``: QSGD (Alistarh et al., 2017), unbiased stochastic quantisation
to ``levels`` levels per sign, with one L2 norm per bucket of elements.

Wire format, 4·ceil(numel/bucket) + ceil(numel·b/8) bytes:
    [0:4·B]   float32 L2 norm of each bucket (B buckets of ``bucket_size``)
    [4·B:]    one code per element, q + levels with q in [-levels, levels],
              packed b bits each, most significant first, where b is the
              smallest of 2, 4, 8 with 2·levels + 1 <= 2**b
Defaults (127 levels, buckets of 512) send 8 bits + 1/16 of a float per
element; ``levels=7`` gives 4 bits. Decoded value: q/levels·norm."""
from __future__ import annotations

from ..errors import ConfigError
from . import levels as lv
from .base import positive_int

__all__ = ["QSGDCompressor"]


class QSGDCompressor(lv.LevelsCompressor):
    """``qsgd``; the wire format is in this module's docstring."""

    name = "qsgd"
    unbiased = True
    randomized = True
    norm = "l2"

    def __init__(self, levels: int = 127, bucket_size: int | None = 512, seed: int = 0):
        super().__init__(seed)
        positive_int(levels, "qsgd: levels")
        if levels > lv.MAX_LEVELS[8]:
            raise ConfigError(f"qsgd: levels must be at most {lv.MAX_LEVELS[8]}, got {levels}")
        if bucket_size is not None:
            positive_int(bucket_size, "qsgd: bucket_size")
        self.levels = levels
        self.bucket_size = bucket_size

    def params(self):
        return {"levels": self.levels, "bucket_size": self.bucket_size, **super().params()}

    def is_contraction(self) -> bool:
        # QSGD's variance bound is min(d/s², sqrt(d)/s)·||x||² for buckets of d elements and s levels;
        # without buckets d is the whole chunk, unbounded
        if self.bucket_size is None:
            return False
        d, s = self.bucket_size, self.levels
        return min(d / s**2, d**0.5 / s) < 1
