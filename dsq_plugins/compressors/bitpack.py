"""Packing small unsigned codes (1, 2, 4 or 8 bits each) into bytes with torch
ops only, so it runs unchanged on CUDA. Codes are packed most significant
first: with 1-bit codes, element 0 is bit 7 of byte 0 (numpy.packbits order)."""
from __future__ import annotations

import torch

from .kernels import FusedKernel, blocks

WIDTHS = (1, 2, 4, 8)


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that ``numel`` codes of ``bits`` bits pack into."""
    return (numel * bits + 7) // 8


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    per_byte = 8 // bits
    return torch.arange(per_byte - 1, -1, -1, device=device, dtype=torch.uint8) * bits


# 1-bit fast path. Packing: eight 0/1 bytes read as one little-endian int64 (byte k = element k),
# multiplied by _GATHER, carry element k's bit to bit 63-k: the top byte is the packed byte, element 0
# in its most significant bit. Unpacking: a byte x times the same constant is the sum of x << 9k,
# copies that never overlap, so bit 7-k of x (element k) lands on bit 8k+7, the top of byte k;
# shifting right by 7 and masking with _ONES leaves each byte 0 or 1. Each makes one int64 per 8
# elements and works on it in place; both rely on the signed multiply wrapping around.
_GATHER = 0x8040201008040201 - (1 << 64)  # as a signed int64
_ONES = 0x0101010101010101


def _pack_bits(flags: torch.Tensor) -> torch.Tensor:
    whole = flags.numel() // 8 * 8
    head = flags[:whole]
    head = head.view(torch.uint8) if head.dtype == torch.bool else head.to(torch.uint8)
    packed = (head.contiguous().view(torch.int64) * _GATHER).bitwise_right_shift_(56).to(torch.uint8)
    if whole == flags.numel():
        return packed
    return torch.cat([packed, _pack_slow(flags[whole:].to(torch.uint8), 1)])


def _unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    words = packed.to(torch.int64).mul_(_GATHER).bitwise_right_shift_(7).bitwise_and_(_ONES)
    return words.view(torch.uint8)[:numel]


def _nonnegative_bits(flat: torch.Tensor) -> torch.Tensor:
    """Block by block on a CPU, so the flags never leave the cache."""
    parts = blocks(flat)
    if len(parts) == 1:
        return _pack_bits(flat >= 0)
    out = torch.empty(flat.numel() // 8, dtype=torch.uint8, device=flat.device)
    for a, block in parts:  # blocks are whole bytes long
        out[a // 8: (a + block.numel()) // 8] = _pack_bits(block >= 0)
    return out


def _nonnegative_bits_fusable(flat: torch.Tensor) -> torch.Tensor:
    """The same bits as eight strided reads per byte: one pass when fused."""
    flags = (flat.view(-1, 8) >= 0).to(torch.int32)
    byte = flags[:, 0] << 7
    for j in range(1, 8):
        byte = byte | (flags[:, j] << (7 - j))
    return byte.to(torch.uint8)


# inductor's C++ for the strided form is slower than the blocked eager one on this project's CPU
_nonnegative_kernel = FusedKernel(_nonnegative_bits, _nonnegative_bits_fusable, compile_on_cpu=False)


def pack_nonnegative(flat: torch.Tensor) -> torch.Tensor:
    """``pack(flat >= 0, 1)``; whole bytes by one fused pass where compiled."""
    whole = flat.numel() // 8 * 8
    head = _nonnegative_kernel(flat[:whole], numel=whole) if whole else flat.new_empty(0, dtype=torch.uint8)
    if whole == flat.numel():
        return head
    return torch.cat([head, pack(flat[whole:] >= 0, 1)])


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


def byte_table(bits: int, device: torch.device) -> torch.Tensor:
    """(256, 8/bits) uint8: the codes packed in every possible byte, in
    ``pack``'s order; decoding is then one row lookup per byte (``kernels.lookup``)."""
    every_byte = torch.arange(256, device=device, dtype=torch.uint8)
    return (every_byte.unsqueeze(1) >> _shifts(bits, device)) & ((1 << bits) - 1)


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of ``pack``: the first ``numel`` codes, as uint8."""
    if bits == 8:
        return packed[:numel]
    if bits == 1:
        return _unpack_bits(packed, numel)
    mask = (1 << bits) - 1
    codes = (packed.unsqueeze(1) >> _shifts(bits, packed.device)) & mask
    return codes.reshape(-1)[:numel]
