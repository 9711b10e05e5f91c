"""``topk``: the k elements of largest magnitude, with their positions.

Wire format, 8·k bytes:
    [0:4k]    float32 values, in the order torch.topk returned them
    [4k:8k]   int32 positions (0 <= position < numel)
k is ``k`` if given, else max(1, round(ratio·numel)), never above numel; the
receiver derives it from numel the same way, so k itself is not sent.
Biased, a contraction: ||x - C(x)||² <= (1 - k/n)·||x||²."""
from __future__ import annotations

import torch

from ..errors import PayloadError
from .base import SparseCompressor, as_bytes, from_bytes


class TopKCompressor(SparseCompressor):
    """``topk``; the wire format is in this module's docstring."""

    name = "topk"
    unbiased = False

    def payload_nbytes(self, numel: int) -> int:
        return 8 * self.count(numel)

    def _encode(self, flat, seed, shared=None):
        k = self.count(flat.numel())
        idx = torch.topk(flat.abs(), k, sorted=False).indices
        return torch.cat([as_bytes(flat[idx]), as_bytes(idx.to(torch.int32))])

    def _decode(self, payload, numel, seed):
        k = self.count(numel)
        values = from_bytes(payload[: 4 * k], torch.float32)
        idx = from_bytes(payload[4 * k:], torch.int32).to(torch.int64)
        if bool(((idx < 0) | (idx >= numel)).any()):
            raise PayloadError(f"topk: payload holds positions outside [0, {numel})")
        out = torch.zeros(numel, dtype=torch.float32, device=payload.device)
        return out.index_copy_(0, idx, values)
