"""Stochastic rounding onto 2s+1 evenly spaced levels in [-scale, scale],
per bucket of elements: the common core of QSGD (scale = L2 norm of the
bucket, s levels) and TernGrad (scale = max |x| of the bucket, s = 1).

Element x with scale c is sent as an integer q in [-s, s] with
P(|q| = l+1) = r - l for r = s·|x|/c and l = floor(r), so E[q·c/s] = x.
On the wire q + s is a (2s+1)-valued code packed at 2, 4 or 8 bits. The
noise u comes from ``noise`` (a hash of the seed and the element's index,
computed inside the compiled rounding pass), not from a generator's stream."""
from __future__ import annotations

import torch

from ..errors import ConfigError
from . import bitpack, kernels, noise
from .base import as_bytes, from_bytes, refuse_if_any

MAX_LEVELS = {2: 1, 4: 7, 8: 127}


def code_bits(levels: int) -> int:
    """Smallest of 2, 4, 8 bits that holds the 2*levels+1 codes."""
    for bits in (2, 4, 8):
        if levels <= MAX_LEVELS[bits]:
            return bits
    raise ConfigError(f"at most {MAX_LEVELS[8]} levels are supported, got {levels}")


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


def _rows(flat: torch.Tensor, width: int) -> list[torch.Tensor]:
    """Views of ``flat`` as whole buckets (a 2-D view) and the short last
    bucket (one row), without copying it into a padded matrix."""
    full, rem = divmod(flat.numel(), width)
    parts = [flat[: full * width].view(full, width)] if full else []
    if rem:
        parts.append(flat[full * width:].view(1, rem))
    return parts


def _with_bucket_values(flat: torch.Tensor, width: int, values: torch.Tensor):
    """(rows, the per-bucket ``values`` of those rows as a column) for each view of ``_rows``."""
    start = 0
    for part in _rows(flat, width):
        yield part, values[start: start + part.shape[0]].unsqueeze(1)
        start += part.shape[0]


def _quantize(x: torch.Tensor, scale: torch.Tensor, first: int, low: int, high: int, levels: int) -> torch.Tensor:
    """Codes q + levels of the rows ``x`` (bucket scales ``scale``, a column),
    whose elements are numbered from ``first`` in the noise of the seed words
    (``low``, ``high``). floor(r + u) with u ~ U[0, 1) is l + 1 with
    probability r - l: the same rounding as comparing u with r - l, in place."""
    u = noise.uniform_into(torch.empty(x.shape, device=x.device), first, low, high)
    # divide, then multiply: levels / scale overflows for tiny scales, |x| / scale never exceeds 1
    r = x.abs().div_(scale).mul_(levels)
    mag = r.add_(u).floor_().clamp_(max=levels)
    return mag.copysign_(x).add_(levels).to(torch.uint8)  # -0.0 + levels is levels


def _quantize_fusable(x: torch.Tensor, scale: torch.Tensor, first: int, low: int, high: int, levels: int
                      ) -> torch.Tensor:
    u = noise.uniform_at(torch.arange(x.numel(), device=x.device).view(x.shape) + first, low, high)
    mag = (x.abs() / scale * levels + u).floor().clamp(max=levels)
    return (mag.copysign(x) + levels).to(torch.uint8)


_quantize_kernel = kernels.FusedKernel(_quantize, _quantize_fusable)


def encode(flat: torch.Tensor, levels: int, bucket: int | None, norm: str, seed: int) -> torch.Tensor:
    """Scales (``norm``: "l2" or "max" per bucket) then stochastically rounded
    codes, element i rounded with ``noise.uniform``'s element i for ``seed``."""
    numel = flat.numel()
    width = numel if bucket is None else bucket
    scale = torch.cat([part.norm(dim=1) if norm == "l2" else torch.maximum(part.amax(dim=1), -part.amin(dim=1))
                       for part in _rows(flat, width)]).clamp_(max=torch.finfo(torch.float32).max)  # see sign.py
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    low, high = noise.seed_words(seed)
    codes, first = [], 0
    for part, bucket_scale in _with_bucket_values(flat, width, safe):
        codes.append(_quantize_kernel(part, bucket_scale, first, low, high, levels, numel=part.numel()).reshape(-1))
        first += part.numel()
    return torch.cat([as_bytes(scale), bitpack.pack(torch.cat(codes) if len(codes) > 1 else codes[0],
                                                    code_bits(levels))])


def decode(payload: torch.Tensor, numel: int, levels: int, bucket: int | None, what: str) -> torch.Tensor:
    """Inverse of ``encode``, refusing negative or non-finite scales and out-of-range codes."""
    nb = nbuckets(numel, bucket)
    scale = from_bytes(payload[: 4 * nb], torch.float32)
    bits = code_bits(levels)
    packed = payload[4 * nb:]
    bad_scale = (~torch.isfinite(scale) | (scale < 0), f"{what}: bucket scales in payload are negative or not finite")
    step = scale / scale.new_full((), levels)  # a device tensor: CUDA divides by a host number as by its reciprocal
    if bits == 8:  # one code per byte: convert, no table
        refuse_if_any(bad_scale, (packed.max() > 2 * levels, f"{what}: payload holds codes above {2 * levels}"))
        out = packed.to(torch.float32).sub_(levels)
    else:
        codes, rows = bitpack.byte_table(bits, payload.device), packed.to(torch.int32)
        refuse_if_any(bad_scale, (_holds_bad_code(codes, levels).index_select(0, rows),
                                  f"{what}: payload holds codes above {2 * levels}"))
        values = codes.to(torch.float32).sub_(levels)  # what each byte stands for, before the bucket's step
        if bucket is None:
            return kernels.lookup(values.mul_(step), rows, numel)
        out = kernels.lookup(values, rows, numel)
    for part, bucket_step in _with_bucket_values(out, numel if bucket is None else bucket, step):
        part.mul_(bucket_step)
    return out


def _holds_bad_code(codes: torch.Tensor, levels: int) -> torch.Tensor:
    """For each byte value, whether one of the codes packed in it is above 2·levels."""
    return (codes > 2 * levels).any(dim=1)
