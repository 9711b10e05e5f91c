"""``randomk``: k elements at positions drawn from a seed both ends know.

Wire format, 4·k bytes: the float32 values at the chosen positions, in the
order the positions were drawn. Positions are not sent: sender and receiver
derive them from the packet seed (in the reducer: from the bucket, step,
chunk and sender, which every rank knows).

Positions: p_j = (o + j·s) mod n for j < k, with offset o uniform in [0, n)
and a step s coprime to n, both drawn from the seed. Each element is chosen
with probability exactly k/n, the positions are distinct, and drawing them
costs O(k), not a permutation of n.

``unbiased=True`` (default) scales the kept values by n/k so that
E[C(x)] = x, the classic random-k of the literature. ``unbiased=False`` sends
them unscaled: biased, but a contraction, which is what error feedback wants
at small ratios (the scaled version's error grows by ~n/k per step there)."""
from __future__ import annotations

import math
import random

import torch

from . import kernels
from .base import SparseCompressor, as_bytes, from_bytes, host_values

__all__ = ["random_positions", "RandomKCompressor"]


def _offset_and_step(numel: int, seed: int) -> tuple[int, int]:
    """The walk's start and its step, coprime to ``numel``, for ``seed``."""
    rng = random.Random(seed)
    offset = rng.randrange(numel)
    step = rng.randrange(1, numel) if numel > 1 else 1
    while math.gcd(step, numel) != 1:
        step += 1
    return offset, step


def random_positions(numel: int, k: int, seed: int, device: torch.device) -> torch.Tensor:
    """The k distinct positions for ``seed`` (same on every device)."""
    offset, step = _offset_and_step(numel, seed)
    return (offset + torch.arange(k, device=device, dtype=torch.int64) * step) % numel


class RandomKCompressor(SparseCompressor):
    """``randomk``; the wire format is in this module's docstring."""

    name = "randomk"
    randomized = True
    sparse = True

    def __init__(self, ratio: float = 0.01, k: int | None = None, unbiased: bool = True, seed: int = 0):
        super().__init__(ratio, k, seed)
        self.unbiased = bool(unbiased)

    def params(self):
        return {**super().params(), "unbiased": self.unbiased}

    def is_contraction(self) -> bool:
        # unbiased: E||x - C(x)||² = (n/k - 1)||x||², at least ||x||² once k <= n/2
        return not self.unbiased

    def payload_nbytes(self, numel: int) -> int:
        return 4 * self.count(numel)

    def _gain(self, numel: int) -> float:
        return numel / self.count(numel) if self.unbiased else 1.0

    def _encode(self, flat, seed, shared=None):
        n = flat.numel()
        idx = random_positions(n, self.count(n), seed, flat.device)
        return as_bytes(flat[idx] * self._gain(n))

    def encodes_rows(self, device: torch.device) -> bool:
        # on a CPU a gather per chunk costs what one over all of them does
        return kernels.launch_bound(device)

    def _encode_rows(self, rows, seeds, shared=None):
        count, n = rows.shape
        walks = host_values([_offset_and_step(n, seed) for seed in seeds], torch.int64, rows.device)
        steps = torch.arange(self.count(n), device=rows.device, dtype=torch.int64)
        positions = (walks[:, :1] + steps * walks[:, 1:]) % n
        return (rows.gather(1, positions) * self._gain(n)).view(torch.uint8)

    def _decode_sparse(self, payload, numel, seed, refusals):
        return random_positions(numel, self.count(numel), seed, payload.device), from_bytes(payload, torch.float32)
