"""``topk``: the k elements of largest magnitude, with their positions.

Wire format, 8·k bytes:
    [0:4k]    float32 values, in the order of their positions
    [4k:8k]   int32 positions, strictly increasing (0 <= position < numel)
k is ``k`` if given, else max(1, round(ratio·numel)), never above numel; the
receiver derives it from numel the same way, so k itself is not sent.
Biased, a contraction: ||x - C(x)||² <= (1 - k/n)·||x||²."""
from __future__ import annotations

import torch

from ..errors import PayloadError
from .base import SparseCompressor, as_bytes, from_bytes
from .kernels import CPU_BLOCK, FusedKernel, blocks


# below this many elements torch.topk is as fast as anything cleverer
_SAMPLED_FROM = 1 << 16
_SAMPLE = 1 << 16


def top_magnitudes(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k elements of largest |value|: the exact set, found
    without a selection over all n elements when n is large.

    A fixed-seed sample estimates a threshold that about 2k elements pass;
    every element above the k-th largest magnitude passes any threshold at or
    below it, so torch.topk over the passing candidates returns the exact
    top-k. If the estimate was too high (fewer than k pass), the full
    torch.topk runs instead: the result is exact either way, only the time
    differs."""
    n = flat.numel()
    if n < _SAMPLED_FROM or 4 * k >= n:
        return torch.topk(flat.abs(), k, sorted=False).indices
    gen = torch.Generator(device=flat.device).manual_seed(0)
    sample = flat[torch.randint(n, (_SAMPLE,), generator=gen, device=flat.device)].abs()
    passing = max(1, min(_SAMPLE, -(-2 * k * _SAMPLE // n)))
    threshold = torch.topk(sample, passing, sorted=False).values.min()
    candidates = torch.nonzero(_at_least(flat, threshold, numel=n)).squeeze(1)
    if candidates.numel() < k:
        return torch.topk(flat.abs(), k, sorted=False).indices
    return candidates[torch.topk(flat[candidates].abs(), k, sorted=False).indices]


def _at_least_eager(flat: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """|flat| >= threshold; block by block on a CPU, without a full-size |flat|."""
    parts = blocks(flat)
    if len(parts) == 1:
        return flat.abs() >= threshold
    scratch = torch.empty(CPU_BLOCK, dtype=flat.dtype, device=flat.device)
    out = torch.empty(flat.numel(), dtype=torch.bool, device=flat.device)
    for a, block in parts:
        m = block.numel()
        torch.ge(torch.abs(block, out=scratch[:m]), threshold, out=out[a: a + m])
    return out


def _at_least_fusable(flat: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    return flat.abs() >= threshold


# inductor's C++ for a boolean output is slower than the blocked eager form on this project's CPU
_at_least = FusedKernel(_at_least_eager, _at_least_fusable, compile_on_cpu=False)


class TopKCompressor(SparseCompressor):
    """``topk``; the wire format is in this module's docstring."""

    name = "topk"
    unbiased = False
    sparse = True

    def payload_nbytes(self, numel: int) -> int:
        return 8 * self.count(numel)

    def _encode(self, flat, seed, shared=None):
        k = self.count(flat.numel())
        # sorted once here, so that every receiver checks the positions are distinct in one pass
        idx = top_magnitudes(flat, k).sort().values
        return torch.cat([as_bytes(flat[idx]), as_bytes(idx.to(torch.int32))])

    def _decode_sparse(self, payload, numel, seed):
        k = self.count(numel)
        values = from_bytes(payload[: 4 * k], torch.float32)
        idx = from_bytes(payload[4 * k:], torch.int32).to(torch.int64)
        if bool(((idx < 0) | (idx >= numel)).any()):
            raise PayloadError(f"topk: payload holds positions outside [0, {numel})")
        # increasing, hence distinct: a repeated position would make the decoded value depend on scatter order
        if k > 1 and bool((idx.diff() <= 0).any()):
            raise PayloadError("topk: payload positions are not strictly increasing (repeated or out of order)")
        return idx, values
