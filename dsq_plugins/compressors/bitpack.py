"""Packing small unsigned codes (1, 2, 4 or 8 bits each) into bytes with torch
ops only, so it runs unchanged on CUDA. Codes are packed most significant
first: with 1-bit codes, element 0 is bit 7 of byte 0 (numpy.packbits order)."""
from __future__ import annotations

import torch

WIDTHS = (1, 2, 4, 8)


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that ``numel`` codes of ``bits`` bits pack into."""
    return (numel * bits + 7) // 8


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    per_byte = 8 // bits
    return torch.arange(per_byte - 1, -1, -1, device=device, dtype=torch.uint8) * bits


# 1-bit fast path: eight 0/1 bytes read as one little-endian int64 (byte k = element k) are gathered
# into one byte, element 0 in the most significant bit, by one multiplication; unpacking spreads a byte
# back with the inverse multiply-and-mask. Two int64 passes over n/8 words instead of 8 strided ones.
_GATHER = 0x8040201008040201 - (1 << 64)  # as a signed int64
_SPREAD = 0x0101010101010101
_SELECT = 0x0102040810204080  # byte k keeps bit 7-k


def _pack_bits(flags: torch.Tensor) -> torch.Tensor:
    whole = flags.numel() // 8 * 8
    words = flags[:whole].to(torch.uint8).contiguous().view(torch.int64)
    packed = ((words * _GATHER) >> 56).to(torch.uint8)
    if whole == flags.numel():
        return packed
    return torch.cat([packed, _pack_slow(flags[whole:].to(torch.uint8), 1)])


def _unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    spread = (packed.to(torch.int64) * _SPREAD) & _SELECT
    return (spread.view(torch.uint8) != 0).to(torch.uint8)[:numel]


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 (or bool, for 1 bit) codes, each < 2**bits, into ceil(n*bits/8) bytes."""
    if bits == 8:
        return codes.to(torch.uint8)
    if bits == 1:
        return _pack_bits(codes)
    return _pack_slow(codes, bits)


def _pack_slow(codes: torch.Tensor, bits: int) -> torch.Tensor:
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
    if bits == 1:
        return _unpack_bits(packed, numel)
    mask = (1 << bits) - 1
    codes = (packed.unsqueeze(1) >> _shifts(bits, packed.device)) & mask
    return codes.reshape(-1)[:numel]
