"""Packing small unsigned codes (1, 2, 4 or 8 bits each) into bytes with torch
ops only, so it runs unchanged on CUDA. Codes are packed most significant
first: with 1-bit codes, element 0 is bit 7 of byte 0 (numpy.packbits order)."""
from __future__ import annotations

import torch

WIDTHS = (1, 2, 4, 8)


def packed_nbytes(numel: int, bits: int) -> int:
    return (numel * bits + 7) // 8


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    per_byte = 8 // bits
    return torch.arange(per_byte - 1, -1, -1, device=device, dtype=torch.uint8) * bits


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes, each < 2**bits, into ceil(n*bits/8) bytes."""
    if bits == 8:
        return codes.to(torch.uint8)
    per_byte = 8 // bits
    n = codes.numel()
    pad = (-n) % per_byte
    c = codes.to(torch.uint8)
    if pad:
        c = torch.cat([c, c.new_zeros(pad)])
    c = c.reshape(-1, per_byte) << _shifts(bits, c.device)
    out = c[:, 0].clone()
    for j in range(1, per_byte):
        out |= c[:, j]
    return out


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of ``pack``: the first ``numel`` codes, as uint8."""
    if bits == 8:
        return packed[:numel]
    mask = (1 << bits) - 1
    codes = (packed.unsqueeze(1) >> _shifts(bits, packed.device)) & mask
    return codes.reshape(-1)[:numel]
