"""Packing small unsigned codes (1, 2, 4 or 8 bits each) into bytes with torch
ops only, so it runs unchanged on CUDA. Codes are packed most significant
first: with 1-bit codes, element 0 is bit 7 of byte 0 (numpy.packbits order)."""
from __future__ import annotations

import functools

import torch

from . import kernels
from .kernels import FusedKernel

__all__ = ["byte_table", "holds_code_above", "nonnegative_bits_and_l1", "nonnegative_bits_fusable", "pack",
    "pack_nonnegative", "packed_nbytes", "sign_units", "unpack", "WIDTHS"]

WIDTHS = (1, 2, 4, 8)


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that ``numel`` codes of ``bits`` bits pack into."""
    return (numel * bits + 7) // 8


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    per_byte = 8 // bits
    return torch.arange(per_byte - 1, -1, -1, device=device, dtype=torch.uint8) * bits


# Packing by multiplication. The 8/bits codes of one output byte, read as one little-endian word
# (int64 for 1 bit, int32 for 2, int16 for 4; code j in byte j), times _WORD_GATHER[bits], land in the
# word's top byte, code 0 in its most significant bits: code j (at bit 8j) is carried to bit
# 8·(per-1) + (per-1-j)·bits. Every other product lands above the word (dropped: the multiply wraps
# around) or, below its top byte, in bit slots that never overlap, so nothing carries into it. The
# top byte is read through a strided uint8 view: one multiply and one strided read per byte, where a
# shift and an or per code took a pass each, and a 64-bit right shift runs at a quarter of that speed
# on a CPU. Unpacking 1-bit codes: a byte x times _GATHER is the sum of x << 9k, copies that never
# overlap, so bit 7-k of x (element k) lands on bit 8k+7, the top of byte k; shifting right by 7 and
# masking with _ONES leaves each byte 0 or 1.
_GATHER = 0x8040201008040201 - (1 << 64)  # as a signed int64
_ONES = 0x0101010101010101
_WORD_TYPES = {1: torch.int64, 2: torch.int32, 4: torch.int16}
_WORD_GATHER = {1: _GATHER, 2: (1 << 30) + (1 << 20) + (1 << 10) + 1, 4: (1 << 12) + 1}  # each fits its word


def _top_bytes(words: torch.Tensor) -> torch.Tensor:
    """The top (packed) byte of each gathered word, as a strided uint8 view."""
    size = words.element_size()
    return words.view(torch.uint8)[size - 1::size]


def _pack_by_multiply(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    whole = codes.numel() // per * per
    head = codes[:whole]
    head = head.view(torch.uint8) if head.dtype == torch.bool else head.to(torch.uint8)
    top = _top_bytes(head.contiguous().view(_WORD_TYPES[bits]) * _WORD_GATHER[bits])
    packed = torch.empty(top.numel(), dtype=torch.uint8, device=codes.device).copy_(top)  # stride 1, even for one
    if whole == codes.numel():
        return packed
    return torch.cat([packed, _pack_slow(codes[whole:], bits)])


def _unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    words = packed.to(torch.int64).mul_(_GATHER).bitwise_right_shift_(7).bitwise_and_(_ONES)
    return words.view(torch.uint8)[:numel]


def _sweep_nonnegative(flat: torch.Tensor, with_l1: bool, header: int = 0
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``pack(flat >= 0, 1)`` of a CPU fp32 vector, and sum |flat| if asked, in one sweep
    of cache-sized blocks (``kernels.blocks``, so the L1 sums in the order ``kernels.l1_norm``
    does, to the same bits). torch's comparisons write booleans at a third of the speed of
    integer arithmetic, so a block's flags come from the sign bit of ``block + 0.0`` (which
    turns -0.0, non-negative, into +0.0): int32 ``>> 31`` gives -1 where negative, 1 once
    narrowed to a boolean; the packed bytes are then negated.
    The bits go after ``header`` bytes left unwritten, so a payload needs no second copy."""
    parts = kernels.blocks(flat)
    size = parts[0][1].numel()
    values = torch.empty(size, dtype=torch.float32)
    signs = torch.empty(size, dtype=torch.int32)
    flags = torch.empty(size + 7, dtype=torch.uint8)  # a last block's tail padded to whole words
    payload = torch.empty(header + packed_nbytes(flat.numel(), 1), dtype=torch.uint8)
    out = payload[header:]
    partial = torch.empty(len(parts), dtype=torch.float32) if with_l1 else None
    for i, (start, block) in enumerate(parts):
        m = block.numel()
        v = torch.add(block, 0.0, out=values[:m])
        torch.bitwise_right_shift(v.view(torch.int32), 31, out=signs[:m])
        words = (m + 7) // 8
        f = flags[: words * 8]
        f[:m].view(torch.bool).copy_(signs[:m])  # -1 -> 1
        if m % 8:  # a last block's padding counts as negative: its bits come out 0, as pack's
            f[m:].fill_(1)
        negative = f.view(torch.int64).mul_(_GATHER)
        torch.bitwise_not(_top_bytes(negative), out=out[start // 8: start // 8 + words])
        if partial is not None:
            torch.sum(v.abs_(), 0, out=partial[i])
    return payload, (partial.sum() if partial is not None else None)


def _nonnegative_bits(flat: torch.Tensor) -> torch.Tensor:
    if kernels.launch_bound(flat.device):
        return _pack_by_multiply(flat >= 0, 1)
    return _sweep_nonnegative(flat, with_l1=False)[0]


def nonnegative_bits_fusable(flat: torch.Tensor) -> torch.Tensor:
    """The same bits as eight strided reads per byte: one pass when fused."""
    flags = (flat.view(-1, 8) >= 0).to(torch.int32)
    byte = flags[:, 0] << 7
    for j in range(1, 8):
        byte = byte | (flags[:, j] << (7 - j))
    return byte.to(torch.uint8)


# one pass where compiled, on a CPU too: inductor's C++ (torch 2.13) packs faster than the blocked eager sweep,
# and it runs on every thread where the sweep's blocks run on one (bench.kernels, docs/results/kernels.md)
_nonnegative_kernel = FusedKernel(_nonnegative_bits, nonnegative_bits_fusable)


def pack_nonnegative(flat: torch.Tensor) -> torch.Tensor:
    """``pack(flat >= 0, 1)``; by one fused pass where compiled."""
    if not _nonnegative_kernel.uses_compiled(flat.numel(), flat.device):
        return _nonnegative_bits(flat)
    whole = flat.numel() // 8 * 8
    head = _nonnegative_kernel(flat[:whole], numel=whole) if whole else flat.new_empty(0, dtype=torch.uint8)
    if whole == flat.numel():
        return head
    return torch.cat([head, pack(flat[whole:] >= 0, 1)])


def nonnegative_bits_and_l1(flat: torch.Tensor, header: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(``header`` bytes left for the caller, then ``pack_nonnegative(flat)``; ``kernels.l1_norm(flat)``):
    sign's whole encode. Where the bits are not compiled (small vectors on a CPU, or compiling
    off), one sweep over memory, straight into the payload; where they are, the compiled bits
    and the blocked L1 read the vector twice, and are still the faster on a CPU."""
    if not kernels.launch_bound(flat.device) and not _nonnegative_kernel.uses_compiled(flat.numel(), flat.device):
        return _sweep_nonnegative(flat, with_l1=True, header=header)
    bits = pack_nonnegative(flat)
    return torch.cat([bits.new_empty(header), bits]), kernels.l1_norm(flat)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 (or bool, for 1 bit) codes, each < 2**bits, into ceil(n*bits/8) bytes."""
    if bits == 8:
        return codes.to(torch.uint8)
    return _pack_by_multiply(codes, bits)


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


@functools.lru_cache(maxsize=None)
def byte_table(bits: int, device: torch.device) -> torch.Tensor:
    """(256, 8/bits) uint8: the codes packed in every possible byte, in
    ``pack``'s order; decoding is then one row lookup per byte (``kernels.lookup``).
    Made once per device and shared (read it, never write it): a decode of a
    small tensor would otherwise spend a tenth of its time rebuilding it."""
    every_byte = torch.arange(256, device=device, dtype=torch.uint8)
    return (every_byte.unsqueeze(1) >> _shifts(bits, device)) & ((1 << bits) - 1)


@functools.lru_cache(maxsize=None)
def sign_units(device: torch.device) -> torch.Tensor:
    """(256, 8) float32: each bit of every possible byte as +1 (set) or -1,
    in ``pack``'s order; a sign payload's byte table is this times its
    scale, one op (made once per device; read it, never write it)."""
    return torch.where(byte_table(1, device).bool(), 1.0, -1.0)


# Lanes of one byte that hold every other packed code, and the bit just above each lane's code
_LANES = {2: (0x33, 0x11, 0x44), 4: (0x0F, 0x01, 0x10)}


def holds_code_above(packed: torch.Tensor, bits: int, top: int) -> torch.Tensor:
    """0-d boolean: whether a code of ``bits`` bits in ``packed`` exceeds
    ``top``. Each byte's codes are checked at once: every other code is
    masked into its lane with a spare bit above it, (2**bits - 1 - top) is
    added to every lane, and a code above ``top`` carries into the spare bit.
    A few byte-wide passes, where a per-byte table lookup costs a gather."""
    if top >= (1 << bits) - 1:
        return torch.zeros((), dtype=torch.bool, device=packed.device)
    if bits == 8:
        return packed.max() > top if packed.numel() else torch.zeros((), dtype=torch.bool, device=packed.device)
    mask, ones, carry = _LANES[bits]
    add = ones * ((1 << bits) - 1 - top)
    even = (packed & mask).add_(add).bitwise_and_(carry)
    odd = (packed >> bits).bitwise_and_(mask).add_(add).bitwise_and_(carry)
    return even.bitwise_or_(odd).any()


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of ``pack``: the first ``numel`` codes, as uint8."""
    if bits == 8:
        return packed[:numel]
    if bits == 1:
        return _unpack_bits(packed, numel)
    mask = (1 << bits) - 1
    codes = (packed.unsqueeze(1) >> _shifts(bits, packed.device)) & mask
    return codes.reshape(-1)[:numel]
