"""``terngrad``: TernGrad (Wen et al., 2017), unbiased stochastic ternary
values {-1, 0, +1}·max|x|.

Wire format, 4·B + ceil(numel/4) bytes:
    [0:4·B]   float32 max |x| of each bucket (B = 1 unless ``bucket_size``)
    [4·B:]    one 2-bit code per element, q + 1 with q in {-1, 0, 1}, four
              per byte, most significant first
Element x is sent as sign(x) with probability |x|/max, else 0."""
from __future__ import annotations

from . import levels as lv
from .base import Compressor, positive_int


class TernGradCompressor(Compressor):
    """``terngrad``; the wire format is in this module's docstring."""

    name = "terngrad"
    unbiased = True
    randomized = True

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

    def payload_nbytes(self, numel):
        return lv.payload_nbytes(numel, 1, self.bucket_size)

    def _encode(self, flat, seed, shared=None):
        return lv.encode(flat, 1, self.bucket_size, "max", seed)

    def encodes_rows(self, device):
        return device.type != "cpu"  # on a CPU each chunk is already one compiled pass

    def _encode_rows(self, rows, seeds, shared=None):
        return lv.encode_rows(rows, 1, self.bucket_size, "max", seeds)

    def _decode(self, payload, numel, seed):
        return lv.decode(payload, numel, 1, self.bucket_size, self.name)
