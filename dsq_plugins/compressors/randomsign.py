"""``randomsign``: the signs of a seeded random fraction of the elements,
one scale. Below one bit per element and still a dense step over a few
steps: 1/``ratio`` · 32 fewer bytes than fp32 (64x at the default 0.5).

Wire format, 4 + ceil(k/8) bytes, k = max(1, round(ratio · numel)) (or ``k``):
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
measured and trained worse on the LM: docs/results/lm-front.md.)

Scale: ``"mean"`` (default) is mean(|v|) over the drawn elements, which makes
the operator a contraction (||v - C(v)||² = ||v||² - k·s²); ``"rms"`` their
root mean square, what 1-bit Adam uses for the momentum (``CompressedAdam``'s
default for this operator, as for ``sign``). Like sign's, the RMS scale is a
contraction on spread-out inputs, not on a few large elements among zeros.
"""
from __future__ import annotations

from ..errors import ConfigError
from . import bitpack
from .base import SparseCompressor
from .randomk import random_positions
from .sign import SCALES, magnitude, signs_decoded, signs_payload

__all__ = ["RandomSignCompressor"]


class RandomSignCompressor(SparseCompressor):
    """``randomsign``; the wire format is in this module's docstring. k is
    ``k`` if given, else max(1, round(ratio · numel)), as top-k's and random-k's."""

    name = "randomsign"
    randomized = True
    unbiased = False
    sparse = True
    shared_draw = True

    def __init__(self, ratio: float = 0.5, k: int | None = None, scale: str = "mean", seed: int = 0):
        super().__init__(ratio, k, seed)
        if scale not in SCALES:
            raise ConfigError(f"randomsign: scale must be one of {SCALES}, got {scale!r}")
        self.scale = scale

    def params(self):
        return {**super().params(), "scale": self.scale}

    def payload_nbytes(self, numel: int) -> int:
        k = self.count(numel)
        return 0 if k == 0 else 4 + bitpack.packed_nbytes(k, 1)

    def _encode(self, flat, seed, shared=None):
        values = flat[random_positions(flat.numel(), self.count(flat.numel()), seed, flat.device)]
        return signs_payload(values, magnitude(values, self.scale))

    def _decode_sparse(self, payload, numel, seed, refusals):
        k = self.count(numel)
        return random_positions(numel, k, seed, payload.device), signs_decoded(payload, k, "randomsign", refusals)
