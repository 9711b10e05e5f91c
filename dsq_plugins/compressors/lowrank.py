"""``lowrank``: a rank-r approximation by power iteration, as PowerSGD
(Vogels et al., NeurIPS 2019) makes it, for one chunk.

The chunk's L elements are laid out row by row as an n x m matrix M with
n = ceil(sqrt(L)) and m = ceil(L / n) (zeros fill the last row). With
r' = min(rank, n, m) and a seeded Gaussian start Q0 (m x r'), each of
``iterations`` power steps makes P = orthonormal(M Q) and Q = M^T P; the
approximation is P Q^T, the projection of M's rows onto span(P), so it is a
contraction (error feedback suits it) and biased.

Wire format: P (n·r' values, row-major) then Q (m·r' values), each value
in ``factors`` ("fp32", the default, or "bf16" / "fp16": half the bytes,
below PowerSGD's fp32 factors at the same rank), b·r'·(n + m) bytes with
b = 4 or 2, no header; a payload of another length is refused, and the
receiver needs no seed. For a chunk of 235K elements (n = 485) rank 1 is
3,880 bytes in fp32, 1/243 of fp32 values.

This first version starts every power iteration afresh from its seed;
PowerSGD's warm start (last step's Q as the next start) needs state per
chunk that changes only with whole steps, which the reducer does not keep
for its operators yet, so ``iterations`` (more power steps) is the
substitute for now. 1-D tensors go through it like any other chunk.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import ConfigError, PayloadError
from .base import Compressor, as_bytes, from_bytes, positive_int


FACTOR_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def shape_of(numel: int) -> tuple[int, int]:
    """The (rows, columns) a chunk of ``numel`` elements is laid out as."""
    if numel == 0:
        return 0, 0
    n = math.isqrt(numel - 1) + 1  # ceil(sqrt(numel))
    return n, -(-numel // n)


class LowRankCompressor(Compressor):
    """``lowrank``; the wire format is in this module's docstring."""

    name = "lowrank"

    def __init__(self, rank: int = 4, iterations: int = 1, factors: str = "fp32", seed: int = 0):
        super().__init__(seed)
        self.rank = positive_int(rank, "lowrank: rank")
        self.iterations = positive_int(iterations, "lowrank: iterations")
        if factors not in FACTOR_DTYPES:
            raise ConfigError(f"lowrank: factors must be one of {', '.join(FACTOR_DTYPES)}, got {factors!r}")
        self.factors = factors
        self._dtype = FACTOR_DTYPES[factors]

    def params(self) -> dict[str, Any]:
        return {"rank": self.rank, "iterations": self.iterations, "factors": self.factors}

    def is_contraction(self) -> bool:
        return True

    def _rank_for(self, numel: int) -> int:
        n, m = shape_of(numel)
        return min(self.rank, n, m)

    def payload_nbytes(self, numel: int) -> int:
        n, m = shape_of(numel)
        return self._dtype.itemsize * self._rank_for(numel) * (n + m)

    def _encode(self, flat: torch.Tensor, seed: int | None, shared: Any = None) -> torch.Tensor:
        numel = flat.numel()
        n, m = shape_of(numel)
        r = self._rank_for(numel)
        matrix = torch.nn.functional.pad(flat, (0, n * m - numel)).view(n, m)
        generator = torch.Generator().manual_seed((seed if seed is not None else self.seed) % 2**63)
        q = torch.randn(m, r, generator=generator).to(flat.device)
        for _ in range(self.iterations):
            p = torch.linalg.qr(matrix @ q).Q  # reduced: n x r, orthonormal columns
            q = matrix.T @ p
        return as_bytes(torch.cat([p.reshape(-1), q.reshape(-1)]).to(self._dtype))

    def _decode(self, payload: torch.Tensor, numel: int, seed: int | None) -> torch.Tensor:
        n, m = shape_of(numel)
        r = self._rank_for(numel)
        values = from_bytes(payload, self._dtype).to(torch.float32)  # its length is checked by the caller
        if values.numel() != r * (n + m):
            raise PayloadError(f"lowrank: payload holds {values.numel()} values, expected {r * (n + m)}")
        p, q = values[: n * r].view(n, r), values[n * r:].view(m, r)
        return (p @ q.T).reshape(-1)[:numel]
