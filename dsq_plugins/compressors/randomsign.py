"""``randomsign``: the signs of a seeded random fraction of the elements,
one scale. Below one bit per element and still a dense step over a few
steps: 1/``ratio`` · 32 fewer bytes than fp32 (64x at the default 0.5).

Wire format, 4 + ceil(k/8) bytes, k = max(1, round(ratio · numel)):
    [0:4]   float32 scale s
    [4:]    k sign bits, 1 = non-negative, in the order the positions were
            drawn, the first in the most significant bit of the first byte
            (numpy.packbits order), zero padding at the end
Decoded: ±s at the k positions, zeros elsewhere.

Positions are not sent: both ends derive them from the packet's seed.
The compressor asks the reducer for *shared draws* (``shared_draw``): every
sender and the chunk's owner encode chunk k at a step with one seed, so the
workers' payloads cover the same positions and the server pass squeezes what
arrived rather than a fresh subset of it. An element not drawn waits in the
error memories: error feedback is what makes the step dense over time.

Each step draws a fresh subset (random-k's positions,
``randomk.random_positions``), so an element waits 1/ratio steps on average.
(A fixed cycle that sends each element exactly once per 1/ratio steps was
measured and trained worse on the LM: 2.1300 against 2.1042 at ratio 1/3,
docs/results.md.)

Scale: ``"mean"`` (default) is mean(|v|) over the drawn elements, which makes
the operator a contraction (||v - C(v)||² = ||v||² - k·s²); ``"rms"`` their
root mean square, what 1-bit Adam uses for the momentum (``CompressedAdam``'s
default for this operator, as for ``sign``). Like sign's, the RMS scale is a
contraction on spread-out inputs, not on a few large elements among zeros.
"""
from __future__ import annotations

import math

import torch

from ..errors import ConfigError
from . import bitpack, kernels
from .base import Compressor, as_bytes, from_bytes, ratio_in_unit_interval, refuse_if_any
from .randomk import random_positions

SCALES = ("mean", "rms")
_FLOAT32_MAX = torch.finfo(torch.float32).max


class RandomSignCompressor(Compressor):
    """``randomsign``; the wire format is in this module's docstring."""

    name = "randomsign"
    randomized = True
    unbiased = False
    sparse = True
    shared_draw = True

    def __init__(self, ratio: float = 0.5, scale: str = "mean", seed: int = 0):
        super().__init__(seed)
        self.ratio = ratio_in_unit_interval(ratio, "randomsign: ratio")
        if scale not in SCALES:
            raise ConfigError(f"randomsign: scale must be one of {SCALES}, got {scale!r}")
        self.scale = scale

    def params(self):
        return {"ratio": self.ratio, "scale": self.scale, **super().params()}

    def positions(self, numel: int, seed: int, device: torch.device) -> torch.Tensor:
        """The positions whose signs the packet with ``seed`` carries, in wire order."""
        return random_positions(numel, self.kept(numel), seed, device)

    def kept(self, numel: int) -> int:
        """How many elements a chunk of ``numel`` sends the sign of."""
        return 0 if numel == 0 else min(numel, max(1, round(self.ratio * numel)))

    def payload_nbytes(self, numel: int) -> int:
        k = self.kept(numel)
        return 0 if k == 0 else 4 + bitpack.packed_nbytes(k, 1)

    def _encode(self, flat: torch.Tensor, seed, shared=None):
        k = self.kept(flat.numel())
        values = flat.to(torch.float32)[self.positions(flat.numel(), seed, flat.device)]
        if self.scale == "mean":
            s = kernels.l1_norm(values) / k
        else:
            s = values.norm() / math.sqrt(k)
        return torch.cat([as_bytes(s.clamp(max=_FLOAT32_MAX).reshape(1)), bitpack.pack_nonnegative(values)])

    def _decode_sparse(self, payload, numel, seed):
        k = self.kept(numel)
        s = from_bytes(payload[:4], torch.float32)
        refuse_if_any((~torch.isfinite(s) | (s < 0), "randomsign: scale in payload is negative or not finite"))
        signs = torch.where(bitpack.byte_table(1, payload.device).bool(), s, -s)  # what each byte stands for
        return self.positions(numel, seed, payload.device), kernels.lookup(signs, payload[4:], k)
