"""Sign's payloads of a bucket's chunks and the int8 codes of their
residual, on a GPU in one Triton launch: the vector read once, the
payloads, codes and block scales written once.

``_payloads_and_residual``'s sign kernel (``_signs_and_residual``) was
inductor's code on a GPU, which read a byte's values as eight strided
loads and each int8 block's values again for its scale. Here a program
takes whole int8 blocks of the bucket's vector as one tile (blocks, bytes,
8): each byte's eight values are a row of it, so the bits are shifts and a
sum along that row, and each block's largest residual a reduction over its
tile. A chunk's values start on a byte (a chunk's size is a multiple of 8),
so each byte belongs to one chunk: its chunk's scale is computed per byte,
and the first byte of a chunk writes the scale's four bytes in front of
its bits. An int8 block may span two chunks, as in torch's path.

The same bits as torch's path (``int8_codes`` of ``v - ±s``): the scale is
the correctly rounded quotient of the chunk's magnitude and its divisor,
clamped to the largest float; the residual one subtraction; a block's
scale its largest magnitude divided by the levels; a code the quotient
rounded half to even (the float trick of adding and subtracting 1.5 · 2^23,
exact below 2^22, where every code lies), clamped to the levels. Where this
path is not taken (no Triton, a CPU's tensors, ``DSQ_SIGN_CODEC=torch``, a
first-call check that disagrees), ``signs_with_residual`` returns None and
the caller runs torch's kernel."""
from __future__ import annotations

import sys

import torch

from ..compressors import sign_codec
from ..compressors._triton import checked_per_device, device_index, tl, triton
from ..state.compact import BLOCK, LEVELS

__all__ = ["signs_with_residual", "signs_and_residual_rows"]

_BLOCKS = 8  # int8 blocks per program: 2,048 values
_LONGEST = 1 << 31  # offsets into the vector are int32 in the kernel

if triton is not None:
    @triton.jit
    def _signs_and_residual(v_ptr, magnitudes_ptr, divisor_ptr, levels_ptr, payloads_ptr, codes_ptr, scales_ptr,
                            numel, row_bytes, payload_stride, blocks, BLOCKS: tl.constexpr, BLOCK: tl.constexpr):
        """Int8 blocks [BLOCKS · program_id(0), +BLOCKS) of the vector: their codes and scales, the payload bytes
        of their values, and the scale bytes of each chunk that starts among them."""
        block = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
        nbyte = tl.arange(0, BLOCK // 8)
        lane = tl.arange(0, 8)
        byte = block[:, None] * (BLOCK // 8) + nbyte[None, :]  # (blocks, bytes): the vector's byte index
        at = byte[:, :, None] * 8 + lane[None, None, :]  # (blocks, bytes, 8): the vector's element index
        inside = at < numel
        byte_inside = byte * 8 < numel
        x = tl.load(v_ptr + at, mask=inside, other=0.0)
        row = byte // row_bytes
        column = byte - row * row_bytes
        scale = tl.math.div_rn(tl.load(magnitudes_ptr + row, mask=byte_inside, other=0.0), tl.load(divisor_ptr))
        scale = tl.where(scale > 3.4028234663852886e38, 3.4028234663852886e38, scale)  # NaN kept, as clamp does
        nonnegative = x >= 0
        sent = scale[:, :, None]
        residual = tl.where(inside, x - tl.where(nonnegative, sent, -sent), 0.0)  # zeros pad the last block
        payload = payloads_ptr + row.to(tl.int64) * payload_stride
        bits = tl.sum(nonnegative.to(tl.int32) << (7 - lane)[None, None, :], 2)
        tl.store(payload + 4 + column, bits.to(tl.uint8), mask=byte_inside)
        word = scale.to(tl.int32, bitcast=True)
        starts = byte_inside & (column == 0)
        for q in tl.static_range(4):
            tl.store(payload + q, ((word >> (8 * q)) & 255).to(tl.uint8), mask=starts)
        largest = tl.max(tl.max(tl.abs(residual), 2), 1)
        block_scale = tl.math.div_rn(largest, tl.load(levels_ptr))
        tl.store(scales_ptr + block, block_scale, mask=block < blocks)
        divisor = tl.where(block_scale == 0, 1.0, block_scale)[:, None, None]
        quotient = tl.math.div_rn(residual, divisor)
        rounded = (quotient + 12582912.0) - 12582912.0  # to the nearest integer, half to even
        codes = tl.minimum(tl.maximum(rounded, -127.0), 127.0).to(tl.int8)
        tl.store(codes_ptr + at, codes, mask=block[:, None, None] < blocks)


def signs_and_residual_rows(rows: torch.Tensor, magnitudes: torch.Tensor, divisor: torch.Tensor,
                            levels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each row's sign payload, (count, 4 + size/8) uint8; the int8 codes of the rows less ±their scales,
    flat and padded with zeros to whole blocks; each block's scale), as ``_payloads_and_residual``'s
    ``_signs_and_residual`` gives them. ``rows``: contiguous float32 (count, size), size a multiple of 8;
    ``magnitudes``: (count,); ``divisor`` and ``levels``: 0-d. Needs Triton."""
    count, size = rows.shape
    if rows.dtype != torch.float32 or not rows.is_contiguous() or size % 8 or not size \
            or magnitudes.shape != (count,) or rows.numel() >= _LONGEST:
        raise ValueError(f"signs_and_residual_rows: wants contiguous float32 rows whose length is a positive "
                         f"multiple of 8 and a magnitude per row, got {rows.dtype} {tuple(rows.shape)}, strides "
                         f"{rows.stride()}, magnitudes {tuple(magnitudes.shape)}")
    blocks = -(-rows.numel() // BLOCK)
    payloads = torch.empty(count, 4 + size // 8, dtype=torch.uint8, device=rows.device)
    codes = torch.empty(blocks * BLOCK, dtype=torch.int8, device=rows.device)
    scales = torch.empty(blocks, dtype=torch.float32, device=rows.device)
    _signs_and_residual[(triton.cdiv(blocks, _BLOCKS),)](
        rows, magnitudes.float().contiguous(), divisor.float().reshape(1), levels.float().reshape(1), payloads,
        codes, scales, rows.numel(), size // 8, payloads.stride(0), blocks, BLOCKS=_BLOCKS, BLOCK=BLOCK)
    return payloads, codes, scales


def signs_with_residual(rows: torch.Tensor, magnitudes: torch.Tensor, divisor: torch.Tensor, levels: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``signs_and_residual_rows`` where sign's Triton codec runs (``DSQ_SIGN_CODEC``, a GPU's tensors, the
    first call's check); None where the caller runs torch's kernel."""
    if rows.dtype != torch.float32 or not rows.is_contiguous() or rows.numel() >= _LONGEST or not _taken(rows):
        return None
    return signs_and_residual_rows(rows, magnitudes, divisor, levels)


def _taken(rows: torch.Tensor) -> bool:
    """Whether this kernel runs for ``rows``: sign's codec chosen, a GPU's tensors, a little-endian host (a scale's
    bytes in memory order), and the first call's check passed on this GPU."""
    if sign_codec.codec() != "triton" or not rows.is_cuda or sys.byteorder != "little":
        return False
    return _works_on(device_index(rows))


def _agrees_with_torch(device: torch.device) -> bool:
    """On fixed rows (chunks that end inside an int8 block, a vector that does, signed zeros, a chunk all zero,
    an overflowing magnitude), the payloads, codes and scales are those of torch's ops, eager."""
    from ._payloads_and_residual import _signs_and_residual
    gen = torch.Generator(device=device).manual_seed(0)
    rows = torch.randn(3, 8 * 41, generator=gen, device=device) * torch.logspace(-3, 3, 8 * 41, device=device)
    rows[0, :4] = torch.tensor([0.0, -0.0, 1e-45, -1e-45])
    rows[2] = 0.0
    magnitudes = torch.cat([rows[0].abs().sum().reshape(1), torch.tensor([float("inf"), 0.0], device=device)])
    divisor, levels = torch.full((), 8.0 * 41, device=device), torch.full((), LEVELS, device=device)
    got = signs_and_residual_rows(rows, magnitudes, divisor, levels)
    with torch.no_grad():
        want = _signs_and_residual(rows, magnitudes, divisor, levels)
    return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


_works_on = checked_per_device("sign's Triton payloads with their residual", _agrees_with_torch)
