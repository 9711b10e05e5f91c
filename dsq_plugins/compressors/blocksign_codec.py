"""Blocksign's payloads made and read on a GPU in Triton: each block's code
and kept magnitude in one launch, the scales' bytes in one more once torch
has summed the magnitudes, and the dense values with the payload's two
checks in one launch.

On a GPU these were inductor's kernels and torch's ops: the codes' pass
(two reductions per block), an ``abs``, the sum, a kernel that divided and
copied the codes beside the scale, and to read a payload a kernel that
formed positions and values, a fill of zeros and a scatter. Here a program
takes a tile of whole blocks (blocks, block's width rounded up to a power of
two), finds each block's first largest magnitude by two reductions along
its row, and writes the codes straight into the payload; the decode writes
each block's values, ±s at its kept position and +0.0 elsewhere, and sets a
row's flag where its scale is negative or not finite or a position lies
outside its block. The scales are still torch's sum of the kept magnitudes
(its rounding depends on its order of summation), taken between the two
launches of the encode.

The bytes and values are those of torch's path (``blocksign``'s encode and
row decode): the first of equal magnitudes kept, a short last block padded
with zeros, the scale the correctly rounded quotient clamped to the largest
float, a value (±1) times the scale. A block holding a NaN keeps its first
NaN, as eager ``argmax`` does (inductor's kernel, which keeps the block's
last position, may differ in that byte; the NaN scale is refused whatever it
is); a refused row's values are not torch's (its step fails on every rank).
Where Triton is missing, the first call's check on a GPU fails, or
``DSQ_OWN_KERNELS=torch`` says so, the functions return None and the
caller takes torch's path."""
from __future__ import annotations

import torch

from .kernels import device_constant
from .own_kernels import (MOST_ROWS, TORCH_REFERENCES, checked_per_device, fits_rows, ready, refused_scale,
                          rows_out, tl, triton, word_at)

__all__ = ["block_codes_rows", "blocksign_decoded", "blocksign_encoded", "codes_of", "decoded_rows", "encoded_rows",
           "encodes", "runs_on", "scales_into"]

_ELEMENTS = 4096  # a tile's values (its blocks times the block's width rounded up to a power of two)
_ROWS = 128  # rows' scales per program of the scales' launch
_LONGEST_ROW = 1 << 31  # a row's offsets are int32 in the kernels

if triton is not None:
    @triton.jit
    def codes_of(x, column, BLOCK: tl.constexpr, PADDED: tl.constexpr):
        """Blocksign's (code, |kept value|) of each row of the tile ``x`` (blocks, PADDED), whose ``column``s from
        ``BLOCK`` on are not the block's (a short block's missing values read as 0.0, as torch's padding): the
        first of the largest magnitudes, or the first NaN."""
        magnitude = tl.where(column < BLOCK, tl.abs(x), -1.0)
        largest = tl.max(magnitude, 1)  # a NaN is not the largest here: it is found on its own below
        first = tl.min(tl.where(magnitude == largest[:, None], column, PADDED), 1)
        first_nan = tl.min(tl.where((x != x) & (column < BLOCK), column, PADDED), 1)
        where = tl.where(first_nan < PADDED, first_nan, first)
        kept = tl.sum(tl.where(column == where[:, None], x, 0.0), 1)  # one value and zeros: its own, or +0.0
        return (where * 2 + (kept >= 0).to(tl.int32)).to(tl.uint8), tl.abs(kept)

    @triton.jit
    def _codes(rows_ptr, codes_ptr, kept_ptr, row_stride, codes_stride, size, blocks, BLOCK: tl.constexpr,
               PADDED: tl.constexpr, TILE: tl.constexpr):
        """Row ``program_id(1)``'s blocks [TILE · program_id(0), +TILE): their codes (at ``codes_ptr``, a row every
        ``codes_stride`` bytes) and kept magnitudes (``kept_ptr``, (count, blocks))."""
        row, block = tl.program_id(1).to(tl.int64), tl.program_id(0) * TILE + tl.arange(0, TILE)
        column = tl.arange(0, PADDED)[None, :]
        at = block[:, None] * BLOCK + column
        x = tl.load(rows_ptr + row * row_stride + at, mask=(column < BLOCK) & (at < size), other=0.0)
        codes, kept = codes_of(x, column, BLOCK, PADDED)
        tl.store(codes_ptr + row * codes_stride + block, codes, mask=block < blocks)
        tl.store(kept_ptr + row * blocks + block, kept, mask=block < blocks)

    @triton.jit
    def _scales(magnitudes_ptr, divisor_ptr, out_ptr, out_stride, count, ROWS: tl.constexpr):
        """Rows [ROWS · program_id(0), +ROWS): each one's scale, its magnitude over the divisor correctly rounded
        and clamped to the largest float (a NaN kept), as the payload's first four bytes."""
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        inside = row < count
        scale = tl.math.div_rn(tl.load(magnitudes_ptr + row, mask=inside, other=0.0), tl.load(divisor_ptr))
        word = tl.where(scale > 3.4028234663852886e38, 3.4028234663852886e38, scale).to(tl.int32, bitcast=True)
        quad = tl.arange(0, 4)
        at = out_ptr + row[:, None].to(tl.int64) * out_stride + quad[None, :]
        tl.store(at, ((word[:, None] >> (8 * quad[None, :])) & 255).to(tl.uint8), mask=inside[:, None])

    @triton.jit
    def _decode(payloads_ptr, out_ptr, bad_ptr, payload_stride, out_stride, numel, blocks, count,
                BLOCK: tl.constexpr, PADDED: tl.constexpr, TILE: tl.constexpr, FLAGS: tl.constexpr):
        """Row ``program_id(1)``'s blocks [TILE · program_id(0), +TILE) of values; with ``FLAGS``, a program that
        reads a refused scale sets ``bad[0, row]``, one that reads a position outside its block ``bad[1, row]``
        (``bad`` (2, count), zeroed before the launch; every writer writes 1)."""
        row, block = tl.program_id(1).to(tl.int64), tl.program_id(0) * TILE + tl.arange(0, TILE)
        payload = payloads_ptr + row * payload_stride
        scale = word_at(payload, True, 0).to(tl.float32, bitcast=True)
        code = tl.load(payload + 4 + block, mask=block < blocks, other=0).to(tl.int32)
        where = code >> 1
        column = tl.arange(0, PADDED)[None, :]
        at = block[:, None] * BLOCK + column
        value = tl.where((code & 1) != 0, 1.0, -1.0) * scale
        values = tl.where(column == where[:, None], value[:, None], 0.0)
        tl.store(out_ptr + row * out_stride + at, values, mask=(column < BLOCK) & (at < numel))
        if FLAGS:
            tl.store(bad_ptr + row, 1, mask=refused_scale(scale))
            outside = (block < blocks) & ((where >= BLOCK) | (block * BLOCK + where >= numel))
            tl.store(bad_ptr + count + row, 1, mask=tl.max(outside.to(tl.int32)) > 0)


def _shape(block: int) -> tuple[int, int]:
    """(the block's width rounded up to a power of two, blocks per program)."""
    padded = triton.next_power_of_2(block)
    return padded, max(1, _ELEMENTS // padded)


def block_codes_rows(rows: torch.Tensor, block: int, codes: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's block codes, (count, ceil(size / block)) uint8, written into ``codes`` where given (a view of
    the payloads' columns from 4: unit stride along a row); the kept magnitudes, (count, blocks) float32).
    ``rows``: float32 (count, size), unit stride along a row. Needs Triton."""
    count, size = rows.shape
    blocks = -(-size // block)
    if rows.dtype != torch.float32 or (size > 1 and rows.stride(1) != 1) or not 2 <= block <= 128:
        raise ValueError(f"blocksign_codec: wants float32 rows of unit stride and a block from 2 to 128, got "
                         f"{rows.dtype} rows {tuple(rows.shape)}, strides {rows.stride()}, block {block}")
    if codes is None:
        codes = torch.empty(count, blocks, dtype=torch.uint8, device=rows.device)
    elif codes.dtype != torch.uint8 or tuple(codes.shape) != (count, blocks) or (blocks > 1 and codes.stride(1) != 1):
        raise ValueError(f"blocksign_codec: codes must be uint8 ({count}, {blocks}) of unit stride, got "
                         f"{codes.dtype} {tuple(codes.shape)}")
    kept = torch.empty(count, blocks, dtype=torch.float32, device=rows.device)
    if count and blocks:
        padded, tile = _shape(block)
        _codes[(triton.cdiv(blocks, tile), count)](rows, codes, kept, rows.stride(0), codes.stride(0), size, blocks,
                                                   BLOCK=block, PADDED=padded, TILE=tile)
    return codes, kept


def scales_into(payloads: torch.Tensor, magnitudes: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """``payloads`` with each row's first four bytes its scale, ``magnitudes / divisor`` correctly rounded and
    clamped to the largest float. Needs Triton."""
    count = payloads.shape[0]
    if count:
        _scales[(triton.cdiv(count, _ROWS),)](magnitudes.float().contiguous(), divisor.float().reshape(1), payloads,
                                             payloads.stride(0), count, ROWS=_ROWS)
    return payloads


def encoded_rows(rows: torch.Tensor, block: int) -> torch.Tensor:
    """(count, 4 + ceil(size / block)) uint8: each row's payload, its scale (the mean kept magnitude, clamped to
    the largest float), then a code per block. ``rows``: float32 (count, size), unit stride along a row. Three
    launches: the codes with the kept magnitudes, torch's sum of them, the scales' bytes. Needs Triton."""
    count, size = rows.shape
    blocks = -(-size // block)
    payloads = torch.empty(count, 4 + blocks if size else 0, dtype=torch.uint8, device=rows.device)
    if not size:
        return payloads
    _, kept = block_codes_rows(rows, block, payloads[:, 4:])
    return scales_into(payloads, kept.sum(dim=1), device_constant(float(blocks), rows.device))


def decoded_rows(payloads: torch.Tensor, numel: int, block: int, out: torch.Tensor | None = None, flags: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(each row's ``numel`` values, (count, numel) float32, written into ``out`` where given; with ``flags``,
    (2, count) bool: whether a row's scale is negative or not finite, and whether a position lies outside its
    block, else None). ``payloads``: (count, 4 + ceil(numel / block)) uint8, unit stride along a row. Needs
    Triton."""
    count, width = payloads.shape
    blocks = -(-numel // block)
    if payloads.dtype != torch.uint8 or (width > 1 and payloads.stride(1) != 1) or width != 4 + blocks \
            or not 2 <= block <= 128:
        raise ValueError(f"blocksign_codec.decoded_rows: wants uint8 payload rows of unit stride of {4 + blocks} "
                         f"bytes for {numel} values in blocks of {block}, got {payloads.dtype} "
                         f"{tuple(payloads.shape)}, strides {payloads.stride()}")
    out = rows_out(out, count, numel, payloads.device, "blocksign_codec.decoded_rows")
    bad = torch.zeros(2, count, dtype=torch.bool, device=payloads.device) if flags else None
    if count and numel:
        padded, tile = _shape(block)
        _decode[(triton.cdiv(blocks, tile), count)](
            payloads, out, bad if flags else out, payloads.stride(0), out.stride(0), numel, blocks, count,
            BLOCK=block, PADDED=padded, TILE=tile, FLAGS=flags)
    return out, bad


def runs_on(device: torch.device) -> bool:
    """Whether this codec may run on ``device`` at all (a row decoder's question, before it has rows): our
    kernels chosen on this GPU (``own_kernels.chosen_on``) and checked against torch's path on it."""
    return ready(device, _works_on)


def _taken(tensor: torch.Tensor, count: int, size: int) -> bool:
    """Whether this codec runs for ``count`` rows of ``size`` values on ``tensor``'s device: ``runs_on`` it,
    within a grid and int32 offsets."""
    return count <= MOST_ROWS and size < _LONGEST_ROW and ready(tensor, _works_on)


def encodes(rows: torch.Tensor) -> bool:
    """Whether this codec encodes the (count, size) ``rows``."""
    return rows.dtype == torch.float32 and (rows.shape[1] <= 1 or rows.stride(1) == 1) \
        and _taken(rows, *rows.shape)


def blocksign_encoded(rows: torch.Tensor, block: int) -> torch.Tensor | None:
    """``encoded_rows`` where this codec runs (``encodes``); None where torch's path encodes."""
    return encoded_rows(rows, block) if encodes(rows) else None


def blocksign_decoded(payloads: torch.Tensor, numel: int, block: int, out: torch.Tensor | None = None,
                      flags: bool = True) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``decoded_rows`` where this codec runs, into ``out`` where it is a (count, numel) float32 buffer of unit
    stride along a row; None where torch's path decodes."""
    if payloads.dtype != torch.uint8 or payloads.dim() != 2 or payloads.stride(-1) != 1 \
            or not _taken(payloads, payloads.shape[0], numel):
        return None
    return decoded_rows(payloads, numel, block, out if fits_rows(out, payloads.shape[0], numel) else None, flags)


def _agrees_with_torch(device: torch.device) -> bool:
    """On fixed rows (signed zeros, ties, infinities, an all-zero block, a short last block, a block of a width
    that is not a power of two, a magnitude that overflows), this codec's bytes, values and flags are those of
    torch's path (the references ``blocksign`` registers), a refused scale's and an outside position's flags
    too."""
    encode, decode = TORCH_REFERENCES["blocksign_payloads"], TORCH_REFERENCES["blocksign_decoded"]
    gen = torch.Generator(device=device).manual_seed(0)
    for block, size in ((32, 3 * _ELEMENTS + 40), (24, 1001), (128, 257)):
        rows = torch.randn(3, size, generator=gen, device=device)
        rows[0, :8] = torch.tensor([0.0, -0.0, 1.0, -1.0, 1.0, float("inf"), 3e38, -3e38], device=device)
        rows[1, :block] = 0.0
        got, want = encoded_rows(rows, block), encode(rows, block)
        if not torch.equal(got, want):
            return False
        got[1, :4] = torch.tensor([0, 0, 128, 191], dtype=torch.uint8, device=device)  # -1.0: refused
        values, bad = decoded_rows(got, size, block)
        want_values, want_bad = decode(got, size, block)
        if not (torch.equal(values, want_values) and torch.equal(bad, want_bad)):
            return False
        got[2, -1] = 255  # a position outside the last block: the row's values are not compared
        if not torch.equal(decoded_rows(got, size, block)[1], decode(got, size, block)[1]):
            return False
    return True


_works_on = checked_per_device("blocksign's Triton codec", _agrees_with_torch)
