"""Top-k's payloads of a bucket's chunks and the int8 residual the error
memory keeps, on a GPU, written by the radix select's last launch.

Torch's path selected the positions (``radix_select``'s seven launches),
then ran inductor's kernel of ``_payloads_and_residual._topk_and_residual``:
a gather of the kept values into the payloads, a copy of the rows with the
kept elements zeroed, and that copy's int8 codes. Here the select's last
pass, which has each element's value and whether and where it is kept in
hand, writes the payload's values and positions at their places and, for
its tile of the vector (16 whole int8 blocks), the codes and block scales
of the rows with their kept elements set to +0.0, in the one launch: no
positions are written, and the rows are read once more, not three times.

The same bits as torch's path: the positions of ``radix_select`` (the first
of equals at the k-th place), the values' bits as they are, a kept
element's residual +0.0 (x - x for a finite x) and every other one's its
own bits, the int8 codes of ``state.compact.int8_codes``
(``int8_codes_of_tile``). A tile is whole int8 blocks of the flattened
rows when one row is cut (an owner's chunk, its last block padded with
zeros) or each row is whole blocks; other cuts, like every other device,
take torch's path (``topk_with_residual`` returns None)."""
from __future__ import annotations

import torch

from ..compressors import radix_select
from ..compressors.own_kernels import TORCH_REFERENCES, checked_per_device, device_index, tl, triton
from ..state.compact import BLOCK, LEVELS
from ..state._int8_triton import int8_codes_of_tile

__all__ = ["topk_with_residual"]

WARPS = 16  # a program's 4,096 values over 512 threads: under 100 registers a thread, where 4 warps take over 200

if triton is not None:
    kept_in_block = radix_select.kept_in_block

    @triton.jit
    def _payloads_and_residual(rows_ptr, hist_ptr, kept_ptr, words_ptr, levels_ptr, codes_ptr, scales_ptr,
                               stride, n, rows, k, blocks, row_blocks, int8_blocks,
                               BLOCK: tl.constexpr, SCAN: tl.constexpr, INT8: tl.constexpr):
        """Block ``program_id(0)`` of row ``program_id(1)``: its kept values' bits and positions at their places
        in the row's payload, seen as (rows, 2k) words; the int8 codes and scales of its ``BLOCK // INT8``
        memory blocks (those of the row: ``row_blocks`` per row) with the kept elements +0.0."""
        row, block = tl.program_id(1), tl.program_id(0)
        offsets, values, kept, place = kept_in_block(rows_ptr, hist_ptr, kept_ptr, stride, n, rows, k, blocks,
                                                     row, block, BLOCK, SCAN)
        payload = words_ptr + row.to(tl.int64) * (2 * k)
        tl.store(payload + place, values.to(tl.int32, bitcast=True), mask=kept > 0)
        tl.store(payload + k + place, offsets, mask=kept > 0)
        residual = tl.where(kept > 0, 0.0, values)  # values past the row's end are 0.0: a last block's padding
        start = row.to(tl.int64) * n  # a multiple of INT8: one row, or rows of whole blocks
        local = block * (BLOCK // INT8) + tl.arange(0, BLOCK // INT8)
        memory_block = tl.where(local < row_blocks, start // INT8 + local, int8_blocks)  # past the row: not written
        int8_codes_of_tile(tl.reshape(residual, [BLOCK // INT8, INT8 // 8, 8]), memory_block,
                           tl.reshape(start + offsets, [BLOCK // INT8, INT8 // 8, 8]), levels_ptr, codes_ptr,
                           scales_ptr, int8_blocks)


def payloads_and_residual_rows(rows: torch.Tensor, k: int, levels: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each row's top-k payload, (count, 8k) uint8; the int8 codes of the flattened rows with their kept
    elements +0.0, padded to whole blocks; their block scales). ``rows``: float32 (count, n), contiguous, one row
    or rows of whole int8 blocks; ``levels``: the int8 levels, a 0-d float32 tensor. Needs Triton."""
    count, n = rows.shape
    if not rows.is_contiguous() or not (count == 1 or n % BLOCK == 0):
        raise ValueError(f"topk_with_residual: wants contiguous rows, one of them or each whole blocks of {BLOCK}, "
                         f"got {tuple(rows.shape)}, strides {rows.stride()}")
    counts = radix_select.counted(rows, k)
    words = torch.empty(count, 2 * k, dtype=torch.int32, device=rows.device)
    int8_blocks = -(-rows.numel() // BLOCK)
    codes = torch.empty(int8_blocks * BLOCK, dtype=torch.int8, device=rows.device)
    scales = torch.empty(int8_blocks, dtype=torch.float32, device=rows.device)
    _payloads_and_residual[(counts.blocks, count)](
        rows, counts.hist, counts.kept, words, levels.reshape(1), codes, scales, rows.stride(0), n, count, k,
        counts.blocks, -(-n // BLOCK), int8_blocks, BLOCK=radix_select.KEEP_BLOCK, SCAN=radix_select.SCAN,
        INT8=BLOCK, num_warps=WARPS)
    return words.view(torch.uint8), codes, scales


def topk_with_residual(rows: torch.Tensor, k: int, levels: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``payloads_and_residual_rows`` where it runs: the radix select taken (``radix_select.taken``), rows it
    tiles, and its first-call check passed on this GPU; None where torch's path runs."""
    count, n = rows.shape
    if not (rows.is_contiguous() and (count == 1 or n % BLOCK == 0) and 1 <= k <= n and _taken(rows)):
        return None
    return payloads_and_residual_rows(rows, k, levels)


def _taken(rows: torch.Tensor) -> bool:
    return radix_select.taken(rows) and _works_on(device_index(rows))


def _agrees_with_torch(device: torch.device) -> bool:
    """On fixed rows without ties (one row ending inside an int8 block, rows of whole blocks over several
    programs, every element kept), the payloads, codes and scales are torch's kernel's from the radix select's
    positions (the first-call check)."""
    reference = TORCH_REFERENCES["topk_and_residual"]
    gen = torch.Generator(device=device).manual_seed(0)
    levels = torch.full((), float(LEVELS), device=device)
    for count, n, k in ((1, 1000, 17), (3, 2 * radix_select.KEEP_BLOCK + BLOCK, 300), (2, BLOCK, BLOCK)):
        rows = torch.randn(count, n, generator=gen, device=device)
        want = reference(rows, radix_select.torch_positions(rows, k), levels)
        got = payloads_and_residual_rows(rows, k, levels)
        if not all(torch.equal(a, b) for a, b in zip(got, want)):
            return False
    return True


_works_on = checked_per_device("top-k's payloads with their residual in Triton", _agrees_with_torch)
