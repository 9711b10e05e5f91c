"""Stochastic rounding onto 2s+1 evenly spaced levels in [-scale, scale],
per bucket of elements: the common core of QSGD (scale = L2 norm of the
bucket, s levels) and TernGrad (scale = max |x| of the bucket, s = 1).

Element x with scale c is sent as an integer q in [-s, s] with
P(|q| = l+1) = r - l for r = s·|x|/c and l = floor(r), so E[q·c/s] = x.
On the wire q + s is a (2s+1)-valued code packed at 2, 4 or 8 bits."""
from __future__ import annotations

import torch

from ..errors import PayloadError
from . import bitpack
from .base import as_bytes, from_bytes

MAX_LEVELS = {2: 1, 4: 7, 8: 127}


def code_bits(levels: int) -> int:
    """Smallest of 2, 4, 8 bits that holds the 2*levels+1 codes."""
    for bits in (2, 4, 8):
        if levels <= MAX_LEVELS[bits]:
            return bits
    raise ValueError(f"at most {MAX_LEVELS[8]} levels are supported, got {levels}")


def nbuckets(numel: int, bucket: int | None) -> int:
    """How many scales a payload carries."""
    if numel == 0:
        return 0
    return 1 if bucket is None else -(-numel // bucket)


def payload_nbytes(numel: int, levels: int, bucket: int | None) -> int:
    """Wire size: one fp32 scale per bucket plus the packed codes."""
    if numel == 0:
        return 0
    return 4 * nbuckets(numel, bucket) + bitpack.packed_nbytes(numel, code_bits(levels))


def _as_rows(flat: torch.Tensor, bucket: int | None) -> torch.Tensor:
    n = flat.numel()
    width = n if bucket is None else bucket
    pad = (-n) % width
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.reshape(-1, width)


def encode(flat: torch.Tensor, levels: int, bucket: int | None, norm: str, seed: int) -> torch.Tensor:
    """Scales (``norm``: "l2" or "max" per bucket) then stochastically rounded codes."""
    rows = _as_rows(flat, bucket)
    scale = rows.norm(dim=1) if norm == "l2" else rows.abs().amax(dim=1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    r = rows.abs() / safe.unsqueeze(1) * levels
    lower = r.floor()
    gen = torch.Generator(device=flat.device).manual_seed(seed)
    noise = torch.rand(r.shape, generator=gen, device=flat.device)
    mag = (lower + (noise < (r - lower)).to(r.dtype)).clamp_(max=levels)
    q = torch.where(rows < 0, -mag, mag).reshape(-1)[: flat.numel()]
    codes = (q + levels).to(torch.uint8)
    return torch.cat([as_bytes(scale), bitpack.pack(codes, code_bits(levels))])


def decode(payload: torch.Tensor, numel: int, levels: int, bucket: int | None, what: str) -> torch.Tensor:
    """Inverse of ``encode``, refusing negative or non-finite scales and out-of-range codes."""
    nb = nbuckets(numel, bucket)
    scale = from_bytes(payload[: 4 * nb], torch.float32)
    if not torch.isfinite(scale).all() or bool((scale < 0).any()):
        raise PayloadError(f"{what}: bucket scales in payload are negative or not finite")
    codes = bitpack.unpack(payload[4 * nb:], code_bits(levels), numel).to(torch.float32)
    if bool((codes > 2 * levels).any()):
        raise PayloadError(f"{what}: payload holds codes above {2 * levels}")
    width = numel if bucket is None else bucket
    per_elem = scale.repeat_interleave(width)[:numel]
    return (codes - levels) * (per_elem / levels)
