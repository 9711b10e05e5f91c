"""``sign``: one bit per element plus one scale (1-bit SGD / scaled signSGD).

Wire format, 4 + ceil(numel/8) bytes:
    [0:4]   float32 scale s
    [4:]    sign bits, 1 = non-negative, element 0 in the most significant bit
            of the first byte (numpy.packbits order), zero padding at the end
Decoded value of element i: +s if its bit is 1, else -s. Zero counts as
non-negative, as in DeepSpeed's 1-bit backends.

Scale: ``"mean"`` (default) is mean(|v|), which minimises ||v - s·sign(v)||
and makes the operator a contraction; ``"rms"`` is ||v||/sqrt(numel), what
DeepSpeed's 1-bit Adam used."""
from __future__ import annotations

import math

import torch

from ..errors import ConfigError, PayloadError
from . import bitpack
from .base import Compressor, as_bytes, from_bytes

SCALES = ("mean", "rms")


class SignCompressor(Compressor):
    name = "sign"
    unbiased = False

    def __init__(self, scale: str = "mean", seed: int = 0):
        super().__init__(seed)
        if scale not in SCALES:
            raise ConfigError(f"sign: scale must be one of {SCALES}, got {scale!r}")
        self.scale = scale

    def params(self):
        return {"scale": self.scale, **super().params()}

    def payload_nbytes(self, numel: int) -> int:
        return 0 if numel == 0 else 4 + bitpack.packed_nbytes(numel, 1)

    def _encode(self, flat: torch.Tensor, seed):
        if self.scale == "mean":
            s = flat.abs().mean()
        else:
            s = flat.norm() / math.sqrt(flat.numel())
        bits = bitpack.pack((flat >= 0).to(torch.uint8), 1)
        return torch.cat([as_bytes(s.reshape(1)), bits])

    def _decode(self, payload, numel, seed):
        s = from_bytes(payload[:4], torch.float32)
        if not torch.isfinite(s).all():
            raise PayloadError("sign: scale in payload is not finite")
        bits = bitpack.unpack(payload[4:], 1, numel)
        return (bits.to(torch.float32) * 2 - 1) * s
